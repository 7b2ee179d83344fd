"""The shape of the code: no import cycle among paratrain's modules, one FLOP model shared by the trainer and
the planner, MFU never above 100 %, and one way the command line reports user errors."""
import ast
from pathlib import Path

import pytest

from conftest import ROOT, tiny_config

PACKAGE = ROOT / "paratrain"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """paratrain module -> the paratrain modules it imports anywhere in its file (functions included)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                # `from pkg import sub` imports pkg, and the submodule when there is one
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            # a module's own parent packages are being imported already: not an edge
            ancestors = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
            edges |= {t for t in targets if t in modules and t != name and t not in ancestors}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_paratrain():
    graph = import_graph()
    assert {"paratrain.config", "paratrain.parallel"} <= graph["paratrain.trainer"]  # the walk sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert [m for m, edges in graph.items() if "paratrain.cli" in edges] == ["paratrain.__main__"]  # the entry points
    assert "paratrain.plan" not in graph["paratrain.trainer"] and "paratrain.plan.search" not in graph["paratrain.trainer"]


def test_one_implementation_of_the_transformer_parts():
    """The built-in models and paratrain.nn's blocks compose the same modules, layer and stack, and only the
    built-ins know models/: neither paratrain.nn, paratrain.modules nor the tensor-parallel placement imports a
    model file."""
    from paratrain import nn as blocks
    from paratrain.models import build_model
    from paratrain.modules.transformer import Attention, FeedForward, TransformerLayer, TransformerStack

    graph = import_graph()
    readers = [m for m, edges in graph.items() if m.startswith(("paratrain.nn", "paratrain.modules"))
               or m in ("paratrain.parallel.tensor", "paratrain.parallel.user")]
    assert "paratrain.nn.layers" in readers and "paratrain.modules.transformer" in readers
    assert [m for m in readers if any(e.startswith("paratrain.models") for e in graph[m])] == []
    gpt = build_model(tiny_config(model={"kind": "gpt"}).model)
    layer = gpt.layers["0"]
    assert isinstance(layer.attn, Attention) and isinstance(layer.ffn, FeedForward)
    assert issubclass(blocks.MultiHeadAttention, Attention) and issubclass(blocks.FeedForward, FeedForward)
    assert isinstance(layer, TransformerLayer) and isinstance(gpt, TransformerStack)
    assert all(issubclass(getattr(blocks, f"Transformer{part}Layer"), TransformerLayer) and
               issubclass(getattr(blocks, f"Transformer{part}"), TransformerStack) for part in ("Encoder", "Decoder"))



MINDSPORE_FACE = ("paratrain.train", "paratrain.nn", "paratrain.ops", "paratrain.context", "paratrain.amp",
                  "paratrain.auto_parallel", "paratrain.communication")
TOML_FACE = ("paratrain.config_file", "paratrain.deepspeed_config", "paratrain.deepspeed_keys", "paratrain.cli",
             "paratrain.trainer")


def _within(module: str, packages: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``packages`` or inside one."""
    return module in packages or module.startswith(tuple(f"{p}." for p in packages))


def test_the_mindspore_face_imports_only_the_settings_vocabulary():
    """The settings vocabulary (paratrain.config: the dataclasses) stands alone, and the MindSpore face takes
    its settings from it and checks them by the one set of rules (paratrain.config_rules), never from the TOML
    face (files, overrides, hints, DeepSpeed's mapping)."""
    graph = import_graph()
    face = [m for m in graph if _within(m, MINDSPORE_FACE)]
    assert "paratrain.train.model" in face and "paratrain.nn.config" in face and "paratrain.context" in face
    assert {"paratrain.config"} <= graph["paratrain.nn.config"] and {"paratrain.config"} <= graph["paratrain.context"]
    assert {m: sorted(graph[m] & set(TOML_FACE)) for m in face if graph[m] & set(TOML_FACE)} == {}
    assert graph["paratrain.config"] == {"paratrain.errors"}  # the vocabulary leans on no face
    assert graph["paratrain.config_file"] == {"paratrain.config"}
    assert graph["paratrain.config_rules"] == {"paratrain.config"}
    for module in ("paratrain.context", "paratrain.nn.config", "paratrain.amp"):  # the rules paratrain train applies
        assert "paratrain.config_rules" in graph[module], module


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_trainer_and_planner_count_the_same_flops(tmp_path):
    """The FLOPs the trainer reports for a step of the encoder-decoder with source and target of different
    lengths are the planner's for that global batch."""
    from paratrain.plan import model_flops
    from paratrain.trainer import Trainer

    cfg = tiny_config(run={"dir": str(tmp_path)}, model={"src_seq_length": 12, "tgt_seq_length": 8},
                      train={"steps": 1}, metrics={"progress": False})
    record = Trainer(cfg).train()[0]
    planned = model_flops(cfg.model, cfg.train.global_batch_size)
    assert record["flops"] == planned
    swapped = tiny_config(model={"src_seq_length": 8, "tgt_seq_length": 12}).model
    assert model_flops(swapped, cfg.train.global_batch_size) != planned  # the lengths are counted where they act


def test_mfu_never_above_one_when_the_start_peak_was_too_low(tmp_path):
    """A peak measured under load at start: a faster step re-measures it and mfu stays <= 1."""
    from paratrain.trainer import Trainer

    trainer = Trainer(tiny_config(run={"dir": str(tmp_path)}, train={"steps": 3}, metrics={"progress": False}))
    trainer.timer.peak_tflops = trainer.timer.local_peak = 1e-9
    history = trainer.train()
    assert all(0 < r["mfu"] <= 1.0 for r in history)
    assert trainer.timer.peak_tflops > 1e-6 and "measured again" in trainer.timer.peak_source


def test_user_errors_are_one_line_and_leftover_arguments_are_refused(tmp_path, capsys):
    from paratrain.cli import main

    assert main(["checkpoint", "info", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paratrain: ") and "Traceback" not in err and len(err.splitlines()) == 1
    assert main(["summary", str(tmp_path), "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "usage: paratrain summary" in err and "unexpected --bogus" in err and len(err.splitlines()) == 1
    assert main(["jobs", "--section.key=1"]) == 2 and "unexpected" in capsys.readouterr().err


@pytest.mark.parametrize("value, expected", [("cpu", "cpu"), ("auto", "cpu")])
def test_one_device_choice(monkeypatch, value, expected):
    import torch

    from paratrain.device import backend, device
    from paratrain.errors import UserError

    if torch.cuda.is_available():
        pytest.skip("checks the choice on a machine without CUDA")
    monkeypatch.setenv("PARATRAIN_DEVICE", value)
    assert device().type == expected and backend() == "gloo"
    monkeypatch.setenv("PARATRAIN_DEVICE", "cuda")
    with pytest.raises(UserError, match="no CUDA device"):
        device()
    monkeypatch.setenv("PARATRAIN_DEVICE", "tpu")
    with pytest.raises(UserError, match="not one of auto, cpu, cuda"):
        device()


def test_the_command_line_lists_its_commands_without_torch():
    """jobs, logs and stop answer at once: building the parser imports no torch (it costs seconds)."""
    import subprocess

    from conftest import PYTHON

    code = "import sys; from paratrain.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_dependencies_run_one_way():
    """modules <- placement (parallel/) <- engine <- faces: no module file imports a placement, and no placement
    file imports a model file, the engine, the loop or a face."""
    graph = import_graph()
    above = {"paratrain.modules": ("paratrain.parallel", "paratrain.models", "paratrain.engine", "paratrain.loop",
                                   "paratrain.trainer", "paratrain.train"),
             "paratrain.parallel": ("paratrain.models", "paratrain.engine", "paratrain.loop", "paratrain.trainer",
                                    "paratrain.train")}
    assert "paratrain.parallel.micro_batches" in graph and "paratrain.modules.moe" in graph
    wrong = {m: sorted(e for e in graph[m] if e.startswith(above[layer]))
             for layer in above for m in graph if m.startswith(layer)}
    assert {m: edges for m, edges in wrong.items() if edges} == {}


def test_placement_knows_no_face():
    """parallel/ places the models of both faces and imports neither: what a face's settings decide (compile the
    layers, ...) reaches it as arguments, and MindSpore's own parallel modes (op strategies, hybrid, the strategy
    search) live with the MindSpore face."""
    graph = import_graph()
    placement = [m for m in graph if _within(m, ("paratrain.parallel",))]
    assert {"paratrain.parallel.user", "paratrain.parallel.traced_pipeline"} <= set(placement)
    assert "paratrain.context" in graph["paratrain.train.model"]  # the walk sees a face's imports
    wrong = {m: sorted(e for e in graph[m] if _within(e, MINDSPORE_FACE + TOML_FACE)) for m in placement}
    assert {m: edges for m, edges in wrong.items() if edges} == {}


# the engine and what it stands on; the command modules among them (``*.commands``, ``metrics.report``) are the
# command line's own
ENGINE = ("paratrain.engine", "paratrain.loop", "paratrain.parallel", "paratrain.modules", "paratrain.models",
          "paratrain.metrics", "paratrain.checkpoint", "paratrain.plan", "paratrain.data", "paratrain.mesh",
          "paratrain.precision", "paratrain.optim", "paratrain.distributed", "paratrain.device")


def _engine_modules(graph: dict) -> list[str]:
    return sorted(m for m in graph if _within(m, ENGINE) and not m.endswith(".commands")
                  and m != "paratrain.metrics.report")


def test_the_engine_reaches_no_face_through_any_import():
    """No face below the faces: no engine module imports a face module directly or through another (the graph's
    closure), and importing them all loads none (the run: ``paratrain``'s own ``__init__`` included)."""
    import subprocess

    from conftest import PYTHON

    graph = import_graph()
    engine = _engine_modules(graph)
    assert {"paratrain.engine", "paratrain.metrics.logger", "paratrain.parallel.user"} <= set(engine)

    def reached(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    wrong = {m: sorted(e for e in reached(m) if _within(e, MINDSPORE_FACE + TOML_FACE)) for m in engine}
    assert {m: edges for m, edges in wrong.items() if edges} == {}
    faces = MINDSPORE_FACE + TOML_FACE
    inside = tuple(f"{face}." for face in faces)
    code = (f"import importlib, sys\nfor m in {engine!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m in {faces!r} or m.startswith({inside!r})))")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_both_faces_hand_the_engine_one_placed_model():
    """Every placement (the built-ins' parallelize, a user's net by its blocks, hybrid, op strategies, each through
    the one entry point ``place``) returns the one PlacedModel class, which no class extends, and which owns the
    step's forward and backward: the engine knows placement only through it, and no face builds a step's loss or
    runs micro-batches itself."""
    import inspect

    from paratrain.parallel import parallelize, place
    from paratrain.parallel.user import place_net
    from paratrain.train.parallel_modes.hybrid import place_hybrid
    from paratrain.train.parallel_modes.semi_auto import place_semi_auto

    placements = (place, parallelize, place_net, place_hybrid, place_semi_auto)
    assert [inspect.signature(f).return_annotation for f in placements] == ["PlacedModel"] * len(placements)
    extending = [f"{path.relative_to(ROOT)}: {node.name}" for path in PACKAGE.rglob("*.py")
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                 and any(isinstance(base, ast.Name) and base.id == "PlacedModel" for base in node.bases)]
    assert extending == []
    graph = import_graph()
    assert {e for e in graph["paratrain.engine"] if _within(e, ("paratrain.parallel",))} == {"paratrain.parallel.placed"}
    for face in ("paratrain.trainer", "paratrain.train.model"):  # the faces' steps
        assert not graph[face] & {"paratrain.parallel.micro_batches", "paratrain.parallel.expert"}, face
