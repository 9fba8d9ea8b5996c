#!/usr/bin/env bash
# Session 43's first call (docs/benchmarks.md, pending item 0): the batched host experts after session 42's
# measurements. Tests (the batch floor `cpu_experts.native_batch_min`, the fp8 fix), then where a batched call's time
# goes (`bench_host_batched.py`: the native call alone against `rows` around it, bf16 and NF4, every expert on the
# host), then the Qwen3-30B-A3B hybrid case with the calibration that times the batched call (VERSION 13: does `auto`
# split batch 16 between the host and the copies now? s42: share 0, 24.0 tok/s against llama.cpp's 32.85).
# PART int4 (a second call, ~500 s): the int4 case against llama.cpp's Q4_K_M (38.3 / 67.0 tok/s at 1 / 16
# sequences on an H100 box, s42); never run before.
#   bash benchmarks/device_s52.sh COMMIT [BUDGET] [PART]   (~530 s)
set -u
commit=${1:-unknown}
budget=${2:-560}
part=${3:-first}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, machine
machine
offload() {  # offload CASE SECONDS
    (cd benchmarks && PYTHONPATH=.. step "$2" python bench_offload.py --cases "$1" --commit "$commit" \
        --out "$OUT/offload-$1-s52.json" > "$OUT/offload-$1-s52.log" 2>&1; echo "exit $?")
    grep "tok/s\|calibrated\|Error\|Traceback" "$OUT/offload-$1-s52.log" | cut -c1-160
    echo "$1 done at $(( $(date +%s) - t0 )) s"
}
if [ "$part" = int4 ]; then
    offload hybrid-qwen3-30b-int4 "$(left 520)"
    exit 0
fi
bash benchmarks/gpu_tests.sh "$OUT/tests-s52.txt" 60 "test_host_native.py::experts_in_one_call" \
    40 "test_hybrid.py::host_rows_run"
grep -E "^[0-9]+ (passed|failed)|FAILED|^E " "$OUT/tests-s52.txt" | cut -c1-200 | tail -12
for fmt in bf16 nf4; do
    (cd benchmarks && PYTHONPATH=.. step 60 python bench_host_batched.py --format $fmt --threads 16 --gpu-share 0 \
        --tokens 1 4 16 --rounds 9 --commit "$commit" --out "$OUT/host-batched-$fmt-s52.json" 2>&1 \
        | grep -v '^{' | tail -4)
done
echo "host batched done at $(( $(date +%s) - t0 )) s"
offload hybrid-qwen3-30b 275
