"""bench/pipeline_bubble.py at a tiny size (p=2, m=2, gpipe): runs and writes its JSON (no timing thresholds)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pipeline_bubble  # noqa: E402

TINY = ["--schedules", "gpipe", "--stages", "2", "--micro", "2", "--hidden", "32", "--heads", "4", "--ffn", "64",
        "--vocab", "64", "--length", "8", "--micro-batch", "1", "--steps", "1", "--warmup", "1",
        "--timeout", "200", "--collective-timeout", "120"]


@pytest.mark.slow
@pytest.mark.timeout(240)  # 6-20 s on this machine; minutes when it is heavily loaded (forked workers)
def test_pipeline_bubble_tiny(tmp_path, capfd):  # capfd: the workers need a real stderr (faulthandler)
    out = tmp_path / "bubble.json"
    assert pipeline_bubble.main(TINY + ["--json", str(out)]) == 0
    assert "theory" in capfd.readouterr().out
    result = json.loads(out.read_text())
    for key in ("cores", "max_processes", "contention", "load_average", "model", "rows"):
        assert key in result, key
    assert result["cores"] >= 1 and result["max_processes"] == 2
    (row,) = result["rows"]
    assert row["ok"], row.get("error")
    assert (row["schedule"], row["p"], row["m"], row["v"]) == ("gpipe", 2, 2, 1)
    assert row["theory"] == pytest.approx(1 / 3)
    assert 0 <= row["idle_fraction"] < 1
    assert len(row["idle_fraction_per_rank"]) == 2 and all(0 <= x < 1 for x in row["idle_fraction_per_rank"])
    assert row["ratio"] == pytest.approx(row["idle_fraction"] / row["theory"])
    # every rank ran m forwards and m backwards of its stage; the last one also the loss
    actions = row["actions_per_rank"]
    assert [a["F"]["count"] for a in actions] == [2, 2] and [a["B"]["count"] for a in actions] == [2, 2]
    assert "loss" in actions[1] and "loss" not in actions[0]
    assert row["step_time_s"] > 0 and all(b > 0 for b in row["busy_s_per_rank"])
