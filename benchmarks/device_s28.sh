#!/usr/bin/env bash
# Session 27's second device call, kept as it ran (the spin it measured was reverted after it: no
# `FERRYLM_POOL_SPIN_US` any more). Does the C pool's spin (`host_native.set_pool_spin`, FERRYLM_POOL_SPIN_US; 100 us
# by default, 0 = the old sleep at once) shorten host experts on the 16-core host, and the hybrid steps that call
# them? Then where the Qwen3-30B-A3B bf16 batch-1 mapped step goes (against a resident run of the same 16 layers),
# and the NF4 copy-path prefill's profile. Writes under $OUT; each step gets at most its own limit and what is left
# of BUDGET seconds (skipped under 30, said on the call's output).
#
#   bash benchmarks/device_s28.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-550}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(lscpu | grep -m1 'Model name'); commit $commit"
# host experts back to back, Qwen3-30B-A3B shape (small: a call's fixed cost shows) and Mixtral, old pool vs spin
for spin in 0 100; do
    FERRYLM_POOL_SPIN_US=$spin PYTHONPATH=. step 60 python benchmarks/bench_host_rowblocks.py --formats bf16 fp8-g128 \
        --hidden 2048 --inter 768 --experts 48 --tokens 1 4 --reps 5 --threads 14 > "$OUT/rowblocks-qwen3-spin$spin.txt" 2>&1
    echo "qwen3 spin $spin: $(grep -E '^(bf16|fp8-g128) native' "$OUT/rowblocks-qwen3-spin$spin.txt" | tr '\n' ' ' | cut -c1-400)"
done
for spin in 0 100; do
    FERRYLM_POOL_SPIN_US=$spin PYTHONPATH=. step 50 python benchmarks/bench_host_rowblocks.py --formats bf16 --experts 3 \
        --tokens 1 --reps 5 --threads 14 > "$OUT/rowblocks-mixtral-spin$spin.txt" 2>&1
    echo "mixtral spin $spin: $(grep -E '^bf16 native' "$OUT/rowblocks-mixtral-spin$spin.txt" | tr '\n' ' ' | cut -c1-300)"
done
# the engine's hybrid decode, Qwen3 16L fp8 under 4 GiB, batch 1: auto / copy only / host only, old pool vs spin
for spin in 0 100; do
    FERRYLM_POOL_SPIN_US=$spin PYTHONPATH=benchmarks:. step 110 python benchmarks/profile_offload.py --experts auto gpu cpu \
        --expert-quant fp8-g128 --warm 64 > "$OUT/hybrid-qwen3-fp8-spin$spin.txt" 2>&1
    grep -E '^\{"experts"' "$OUT/hybrid-qwen3-fp8-spin$spin.txt" | cut -c1-330 | sed "s/^/spin $spin /"
done
echo "spin done at $(( $(date +%s) - t0 )) s"
# issue 8: the bf16 batch-1 mapped step, profiled, and the same 16 layers resident
PYTHONPATH=benchmarks:. step 120 python benchmarks/profile_offload.py --experts gpu --warm 64 --profile \
    > "$OUT/prof-bf16-q16.txt" 2>&1; grep -E '^\{"experts"' "$OUT/prof-bf16-q16.txt" | cut -c1-300
PYTHONPATH=benchmarks:. step 80 python benchmarks/profile_offload.py --experts gpu --warm 8 --budget-gib 60 \
    > "$OUT/resident-bf16-q16.txt" 2>&1; grep -E '^\{"experts"' "$OUT/resident-bf16-q16.txt" | cut -c1-200
PYTHONPATH=benchmarks:. step 150 python benchmarks/profile_offload.py --experts gpu --shape mixtral --layers 8 \
    --budget-gib 5 --expert-quant nf4 --tokens 4 --prefill-tokens 512 --profile > "$OUT/prof-nf4-prefill.txt" 2>&1
grep -E '^\{"experts"' "$OUT/prof-nf4-prefill.txt" | cut -c1-300
echo "all done at $(( $(date +%s) - t0 )) s"
