"""The reference suite against MindSpore 2.7.0 (``make test-mindspore``, in its own venv): each test builds the
same net in MindSpore and in paratrain and compares. Left out where MindSpore is not installed (``make test``
also leaves this folder out)."""
import pytest

try:
    import mindspore
except ImportError:
    mindspore = None

collect_ignore_glob = ["test_*.py"] if mindspore is None else []


@pytest.fixture(autouse=True, scope="session")
def _pynative_cpu():
    """MindSpore in PyNative mode on the CPU, as paratrain's face runs eagerly."""
    mindspore.set_context(mode=mindspore.PYNATIVE_MODE, device_target="CPU")
    yield


@pytest.fixture(autouse=True)
def _seeded():
    """The same initial weights (MindSpore's, copied into paratrain's nets) on every run."""
    mindspore.set_seed(0)


def pytest_terminal_summary(terminalreporter):
    """The max relative difference each comparison measured."""
    if mindspore is None:
        return
    from reference import measured

    if measured:
        terminalreporter.section("max relative difference to MindSpore 2.7.0")
        for what, difference in sorted(measured.items()):
            terminalreporter.write_line(f"{difference:9.2e}  {what}")
