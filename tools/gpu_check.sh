#!/usr/bin/env bash
# The one command for a lent GPU machine (README, "GPU"): its own python and torch, no venv, pip or network.
#   bench      the throughput bench: the 1B GPT, paratrain against plain PyTorch loops (its table, and a
#              profile of one step of each side; it fails when the sides' losses disagree)
#   suite      tests/gpu's tests that need one GPU (fp8's apart)
#   refusals   one line and exit 2, before anything starts: 2 ranks on 1 GPU (paratrain launch), fp8 on the CPU
#   fp8        tests/gpu/test_gpu_fp8.py: the small GPT 50 steps in fp8 within 2 % of bf16
#   shared     tests/gpu's tests that need two GPUs, with two ranks sharing this one over gloo when it is the only
#              one (tests/gpu/conftest.py), and the table of which collectives carry CUDA tensors
#   fp8-speed  paratrain train on the 1B GPT, compiled, bf16 then fp8: tokens/s and their ratio
# bash tools/gpu_check.sh [PART...] runs those parts (default: all, in that order: the figures first). Each part
# has a time limit, cut to what is left of GPU_CHECK_BUDGET_S (default 570 s) so that the whole stays within 10
# minutes; a part with under 20 s left is not started and counts as failed. Every part runs; the script exits 1 if any failed.
# Results under $OUT/gpu_check/ when OUT is set, else runs/gpu_check/: each part's log (PART.log), the pytest
# parts' JUnit XML (PART.xml), the refusals' stderr, the bench JSON, collectives.json, fp8_speed/fp8_speed.json.
set -u
cd "$(dirname "$0")/.."
declare -A limits=([suite]=150 [refusals]=60 [bench]=240 [fp8]=120 [shared]=240 [fp8-speed]=200)
parts=("$@")
[ ${#parts[@]} = 0 ] && parts=(bench suite refusals fp8 shared fp8-speed)
for name in "${parts[@]}"; do
    if [ -z "${limits[$name]:-}" ]; then
        echo "gpu_check: unknown part '$name': the parts are bench suite refusals fp8 shared fp8-speed" >&2
        exit 2
    fi
done
python=$(bash tools/gpu_python.sh) || exit 1
export PYTHONPATH="$PWD$(ls wheels/*.whl 2>/dev/null | sed "s|^|:$PWD/|" | tr -d '\n')" PARATRAIN_DEVICE=cuda \
    PYTHONUNBUFFERED=1
out=${OUT:-runs}/gpu_check  # under $OUT where the runner brings that folder back
mkdir -p "$out"
budget=${GPU_CHECK_BUDGET_S:-570}
failed=()

part() {  # part NAME LIMIT_S FUNCTION: run it within its limit and the budget; its output also in $out/NAME.log
    local name=$1 limit=$2 start=$SECONDS code
    shift 2
    local left=$((budget - SECONDS))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        echo "== gpu_check: $name: not run, ${left} s left of the ${budget} s budget"
        failed+=("$name (not run)")
        return
    fi
    echo "== gpu_check: $name: $* (limit $limit s)"
    "$@" "$limit" 2>&1 | tee "$out/$name.log"
    code=${PIPESTATUS[0]}
    case $code in 124 | 137) echo "== gpu_check: $name ran past its time limit of $limit s" ;; esac
    echo "== gpu_check: $name: exit $code after $((SECONDS - start)) s"
    [ "$code" = 0 ] || failed+=("$name")
}

gpu_tests() {  # gpu_tests PART WHICH(one|several) LIMIT PYTEST_ARGS...
    local name=$1 which=$2 limit=$3
    shift 3
    PARATRAIN_GPU_TESTS=$which PARATRAIN_GPU_REPORT="$out" timeout -k 10 "$limit" "$python" -m pytest -v -rs \
        -p no:cacheprovider --junitxml="$out/$name.xml" "$@"
}

suite() { gpu_tests suite one "$1" tests/gpu --ignore=tests/gpu/test_gpu_fp8.py; }
shared() { gpu_tests shared several "$1" tests/gpu; }
fp8() { gpu_tests fp8 one "$1" tests/gpu/test_gpu_fp8.py; }

bench() {
    timeout -k 10 "$1" "$python" bench/gpu_throughput.py --steps 8 --warmup 2 --profile --json "$out/gpu_throughput.json"
}

refused() {  # refused NAME EXPECTED_START LIMIT COMMAND...: exit 2 and one line on stderr that starts so
    local err="$out/refused-$1.err" expected=$2 limit=$3
    shift 3
    timeout -k 10 "$limit" "$@" > /dev/null 2> "$err"
    local code=$?
    cat "$err"
    if [ $code = 2 ] && [ "$(wc -l < "$err")" = 1 ] && grep -q "^$expected" "$err"; then
        echo "refused as expected: exit 2, one line"
        return 0
    fi
    echo "expected exit 2 and one line '$expected...', got exit $code"
    return 1
}

refusals() {
    local limit=$(($1 / 2)) code=0
    PARATRAIN_SHARED_GPU= CUDA_VISIBLE_DEVICES=0 \
        refused two-ranks "paratrain: 2 ranks on this host but 1 GPU(s) visible" "$limit" "$python" -m paratrain launch \
        --nproc-per-node 2 --name gpu-check-refusal -- train --config examples/demo.toml \
        --parallel.data_parallel=2 --parallel.model_parallel=1 --parallel.pipeline_stage=1 || code=1
    PARATRAIN_DEVICE=cpu refused fp8-on-cpu "paratrain: invalid configuration: train.mixed_precision='fp8' cannot run here: \
the device is the CPU" "$limit" "$python" -m paratrain train --run.dir="$out/fp8-refused" \
        --train.mixed_precision=fp8 --train.steps=1 || code=1
    return $code
}

fp8_speed() {  # the 1B GPT of the bench, compiled, 12 steps each in bf16 and fp8 (one device, synthetic data)
    local limit=$1 start=$SECONDS precision
    for precision in bf16 fp8; do
        [ $((limit - (SECONDS - start))) -ge 10 ] || return 124
        timeout -k 10 $((limit - (SECONDS - start))) "$python" -m paratrain train --model.kind=gpt --model.vocab_size=32000 \
            --model.hidden_size=2048 --model.num_heads=16 --model.ffn_hidden_size=8192 --model.decoder_layers=18 \
            --model.seq_length=2048 --model.hidden_dropout=0 --model.attention_dropout=0 \
            --train.global_batch_size=8 --train.steps=12 --train.compile=true --train.mixed_precision=$precision \
            --metrics.log_steps=1 --metrics.progress=false --checkpoint.save_steps=0 --checkpoint.resume=none \
            --run.dir="$out/fp8_speed/$precision" || return $?
    done
    "$python" - "$out/fp8_speed" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

root = Path(sys.argv[1])
result = {}
for precision in ("bf16", "fp8"):
    records = [json.loads(line) for line in (root / precision / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > 4]  # after compilation
    result[precision] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
                         "losses": [r["loss"] for r in records]}
result["fp8_over_bf16"] = result["fp8"]["tokens_per_s"] / result["bf16"]["tokens_per_s"]
(root / "fp8_speed.json").write_text(json.dumps(result, indent=1))
for precision in ("bf16", "fp8"):
    print(f"fp8_speed: {precision}: {result[precision]['tokens_per_s']:,.0f} tokens/s (median of steps 5-12), "
          f"losses {', '.join(f'{x:.3f}' for x in result[precision]['losses'])}")
print(f"fp8_speed: fp8 / bf16 = {result['fp8_over_bf16']:.3f} (issue 41 asks for 1.20 on this model)")
EOF
}

"$python" -c 'import torch; print(f"gpu_check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (compute "
                                  f"capability {torch.cuda.get_device_capability(0)}), torch {torch.__version__}, python",
                                  __import__("sys").version.split()[0])'
"$python" -c 'import torchao; print(f"gpu_check: torchao {torchao.__version__} from {torchao.__file__}")' \
    || echo "gpu_check: torchao does not import: fp8 is refused here (make gpu-wheels fetches its wheel into wheels/)"
for name in "${parts[@]}"; do
    part "$name" "${limits[$name]}" "${name//-/_}"
done
if [ ${#failed[@]} = 0 ]; then
    echo "== gpu_check: all ${#parts[@]} parts passed in $SECONDS s"
    exit 0
fi
echo "== gpu_check: FAILED: ${failed[*]} ($SECONDS s)"
exit 1
