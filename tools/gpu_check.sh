#!/usr/bin/env bash
# The one command for a lent GPU machine (README, "GPU"): its own python and torch, no venv, pip or network.
#   1. the GPU suite (tests/gpu; tests needing more GPUs than there are are skipped, with the reason)
#   2. the throughput bench: the 1B GPT in bf16, paratrain against a plain PyTorch loop (tokens/s, MFU,
#      peak memory, their ratio; it fails when the two sides' losses disagree)
#   3. the refusal of 2 ranks on 1 GPU: one line, exit 2, before any rank starts
# Each part has a time limit, so that the whole stays within 10 minutes; every part runs, and the script
# exits 1 if any failed. Results: $OUT/gpu_check/ when OUT is set, else runs/gpu_check/ (the bench JSON, the
# refusal output).
set -u
cd "$(dirname "$0")/.."
python=$(bash tools/gpu_python.sh) || exit 1
export PYTHONPATH="$PWD$(ls wheels/*.whl 2>/dev/null | sed "s|^|:$PWD/|" | tr -d '\n')" PARATRAIN_DEVICE=cuda
out=${OUT:-runs}/gpu_check  # under $OUT where the runner brings that folder back
mkdir -p "$out"
failed=()

part() {  # part NAME COMMAND...: run it, say how it went and how long it took
    local name=$1 start=$SECONDS code
    shift
    echo "== gpu_check: $name: $*"
    "$@"
    code=$?
    [ $code = 124 ] && echo "== gpu_check: $name ran past its time limit"
    echo "== gpu_check: $name: exit $code after $((SECONDS - start)) s"
    [ $code = 0 ] || failed+=("$name")
}

refused_two_ranks_on_one_gpu() {
    CUDA_VISIBLE_DEVICES=0 timeout 60 "$python" -m paratrain launch --nproc-per-node 2 --name gpu-check-refusal -- \
        train --config examples/demo.toml --parallel.data_parallel=2 --parallel.model_parallel=1 \
        --parallel.pipeline_stage=1 > "$out/refusal.out" 2> "$out/refusal.err"
    local code=$?
    cat "$out/refusal.err"
    if [ $code = 2 ] && [ "$(wc -l < "$out/refusal.err")" = 1 ] \
            && grep -q "^paratrain: 2 ranks on this host but 1 GPU(s) visible" "$out/refusal.err"; then
        echo "refused as expected: exit 2, one line"
        return 0
    fi
    echo "expected exit 2 and one line 'paratrain: 2 ranks on this host but 1 GPU(s) visible...', got exit $code"
    return 1
}

"$python" -c 'import torch; print(f"gpu_check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
                                  f"torch {torch.__version__}, python", __import__("sys").version.split()[0])'
part "1/3 GPU suite" timeout 300 "$python" -m pytest -v -rs -p no:cacheprovider tests/gpu
part "2/3 throughput bench" timeout 220 "$python" bench/gpu_throughput.py --steps 8 --warmup 2 \
    --json "$out/gpu_throughput.json"
part "3/3 two ranks on one GPU" refused_two_ranks_on_one_gpu
if [ ${#failed[@]} = 0 ]; then
    echo "== gpu_check: all 3 parts passed in $SECONDS s"
    exit 0
fi
echo "== gpu_check: FAILED: ${failed[*]} ($SECONDS s)"
exit 1
