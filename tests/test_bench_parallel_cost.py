"""bench/parallel_cost.py at a tiny size: counted communication and model-state bytes match the analytic model.

These are byte counts of real training steps (forked gloo workers), not timings.
"""
import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import parallel_cost  # noqa: E402

TINY = ["--vocab", "64", "--hidden", "32", "--heads", "4", "--ffn", "64", "--layers", "1", "--length", "8",
        "--batch", "4", "--steps", "1", "--models", "transformer"]


@functools.cache
def rows():
    args = parallel_cost.parse_args(TINY + ["--layouts", "dp2_zero1,dp2_zero2,mp2_sp,mp2,dp2_ep2_moe", "--timeout", "200"])
    return {r["name"].split("/")[1]: r for r in parallel_cost.run(args)}


def assert_close(row, key):
    assert 0.95 <= row[key] <= 1.05, (f"{row['name']} {key}={row[key]:.3f}: analytic {row['comm_analytic_parts']} "
                                      f"measured by phase {row['comm_by_phase']}")


@pytest.mark.slow
@pytest.mark.timeout(240)  # ~30 s on an idle machine; the first test runs the workers
@pytest.mark.parametrize("layout", ["dp2_zero1", "dp2_zero2", "mp2_sp", "mp2", "dp2_ep2_moe"])
def test_counted_bytes_match_analytic(layout):
    row = rows()[layout]
    assert row["comm_bytes"] > 0 and row["state_bytes"] > 0
    if "ep2" in layout:  # the experts' all-to-all is counted and costed
        assert row["comm_analytic_parts"]["ep_all_to_all"] > 0
        assert any(e["kind"] == "all_to_all" for e in row["events"])
    assert_close(row, "comm_ratio")
    assert_close(row, "state_ratio")


