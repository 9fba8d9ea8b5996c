#!/usr/bin/env bash
# Written in session 31 (four starts failed; not yet run). The packed prefill's host and kernel fixes (b6e23cf) against
# the tree before them (313d69c, `git archive`), alternating. First the CUDA tests of `decode_experts`' 4-bit kernel
# and of the packed prefill; `decode_experts` alone on eight NF4 Mixtral experts by tile (the old tile decode last);
# then the resident 8-layer NF4 Mixtral's 512-token prefill (`profile_prefill.py`: session 31's first call 49.9 ms,
# `_decode_experts` 19.8 ms, the device idle 25 ms of 63): old / new with the 4-bit kernel (`--tile4 32,256`: off by
# default until a GPU has run it) / new with the tile decode; the same under 5 GiB; the 32-layer NF4 Mixtral under
# 16 GiB (batch 64, 2k prefill) on the new tree as it defaults. PART=short: the tests, `decode_experts` alone and one
# old / new resident prefill pair, for a call with little budget left.
#   bash benchmarks/device_s38.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-480}
part=rest  # no issue-10 aims in this call, whatever the GPU
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" 90 "test_fused_moe_formats.py::decoded_experts or packed_experts_equal" \
    $([ "${PART:-}" = short ] || echo '70 test_offload.py::packed_prefill')
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -12
PYTHONPATH=. step 60 python benchmarks/bench_decode_experts.py 2>&1 | tail -7
old=/tmp/old313
mkdir -p $old && git archive 313d69c | tar -x -C $old && cp benchmarks/profile_prefill.py $old/benchmarks/ || echo "no old tree"
prof() {  # label dir args...
    local label=$1 dir=$2; shift 2
    (cd "$dir/benchmarks" && PYTHONPATH=.. step 80 python profile_prefill.py --layers 8 --expert-quant nf4 --top 8 "$@" \
        > "$OUT/prefill-$label.txt" 2>&1)
    grep -v '^{' "$OUT/prefill-$label.txt" | grep -E "prefill|device time|host time|timeline|^_|^aten::_grouped|^aten::copy_|^cuda|^aten::to|^aten::pin" \
        | head -16 | sed "s/^/$label: /"
    echo "$label done at $(( $(date +%s) - t0 )) s"
}
prof old-a $old --tokens 512
prof new-a . --tokens 512 --tile4 32,256
[ "${PART:-}" = short ] && { echo "short: done at $(( $(date +%s) - t0 )) s"; exit 0; }
prof old-b $old --tokens 512
prof new-b . --tokens 512 --tile4 32,256
prof new-tile-decode . --tokens 512
prof old-5gib $old --tokens 512 --budget-gib 5
prof new-5gib . --tokens 512 --budget-gib 5 --tile4 32,256
(cd benchmarks && PYTHONPATH=.. step 100 python bench_offload.py --cases mixtral-32L-nf4-b64 --commit "$commit" \
    --out "$OUT/offload-32L-nf4-b64-new.json" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | sed "s/^/32L new: /" | tail -4)
echo "done at $(( $(date +%s) - t0 )) s"
