"""bench/llama_hf.py at a tiny size: both sides train the same HF directory on the same saved batches with the
same losses on 1 and 2 forked gloo ranks, and the report catches a loss mismatch. Checks the pieces, not timings."""
import copy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

pytest.importorskip("transformers")
import llama_hf  # noqa: E402
from forked_ranks import run_distributed  # noqa: E402

TINY = ["--vocab", "97", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--layers", "2",
        "--length", "16", "--batch", "4", "--quick"]


@pytest.mark.slow
def test_both_sides_give_the_same_losses_and_the_report_catches_a_mismatch(tmp_path):
    a = llama_hf.parse_args(TINY + ["--out", str(tmp_path)])
    common = llama_hf.prepare(a)
    runs = {ranks: {side: [run_distributed(llama_hf.run_worker, ranks, {
        **common, "side": side, "run_dir": str(tmp_path / f"{side}{ranks}"), "out_dir": str(tmp_path)}, timeout=120)]
        for side in llama_hf.SIDES} for ranks in (1, 2)}
    report = llama_hf.build_report(runs, common, a.tolerance)
    for ranks in ("1", "2"):
        entry = report["by_ranks"][ranks]
        assert entry["losses_agree"], entry["max_loss_rel_diff"]
        assert set(entry["ratios"]) == {"tokens_per_s", "peak_rss"}
        assert len(entry["sides"]["paratrain"]["losses"]) == a.warmup + a.steps
    broken = copy.deepcopy(runs)
    broken[2]["paratrain"][0][0]["losses"][1] *= 1.01
    assert "ratios" not in llama_hf.build_report(broken, common, a.tolerance)["by_ranks"]["2"]
