#!/usr/bin/env bash
# llama.cpp's side of issue 10's comparison on the lent GPU box (the issue's figures are for the Mixtral shape
# only; this adds Qwen3-30B-A3B). llama.cpp cannot be built there in a call's time, so it is built on the dev box
# (benchmarks/build_llamacpp.sh: CUDA 13 for sm_90, CPU code for the Sapphire Rapids hosts the lent GPUs sit in)
# and carried as the ignored benchmarks/llamacpp-cuda.tar.xz; it links the image's own libcudart and libcublas.
# Random-weight GGUFs are written there by benchmarks/llamacpp_gguf.py (seconds; no quantizer runs). Checked on the
# dev box with a native CPU build of the same llama.cpp: the tiny Qwen3 (Q4_K_M) and Mixtral (bf16) GGUFs load and
# run in llama-bench and llama-batched-bench, and ferrylm loads them too (finite logits).
#
#   run carry=[benchmarks/llamacpp-cuda.tar.xz]:  bash benchmarks/device_llamacpp.sh COMMIT [BUDGET] [PARTS]
# PARTS (default "check qwen3-q4 qwen3-bf16"):
#   check       a tiny model loads and runs, then Mixtral 16L Q4_K_M (13.33 GiB; the issue's: 13.4) with experts on
#               the CPU against the issue's 21.5 tok/s (its own llama.cpp build, same box kind): a fair stand-in?
#   qwen3-q4    Qwen3-30B-A3B 48L Q4_K_M, experts on the CPU: tg batch 1, pp512, batched decode 1/4/16
#   qwen3-bf16  the same in bf16 (56.9 GiB: in /dev/shm or on disk where it fits, else skipped)
set -u
commit=${1:-unknown}
budget=${2:-560}
parts=${3:-check qwen3-q4 qwen3-bf16}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, machine
machine
L=/tmp/lcpp
mkdir -p $L && tar -xJf benchmarks/llamacpp-cuda.tar.xz -C $L || { echo "no llama.cpp build carried"; exit 1; }
site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')  # torch's CUDA 13 libraries
cuda_libs=$(find "$site/nvidia" -name 'libcublas.so.*' -o -name 'libcudart.so.*' | xargs -n1 dirname | sort -u | paste -sd:)
export LD_LIBRARY_PATH=$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ldconfig -p | grep -q 'libgomp.so.1 ' || LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$L/lib-extra
ldd $L/bin/llama-bench | grep "not found" && { echo "llama.cpp cannot load a library"; exit 1; }
export PYTHONPATH=$L/gguf-py
df -h /tmp /dev/shm | sed 's/^/  /'
gen() { step "$1" python3 benchmarks/llamacpp_gguf.py --shape "$2" --quant "$3" --out "$4" ${5:+--layers $5} 2>&1 | grep -v Writing | tail -2; }
# tg: batch-1 decode of 64 tokens; pp: a 512-token prompt; experts' tensors on the CPU, the rest on the GPU.
bench() {
    local model=$1 secs=$2; shift 2
    step "$secs" $L/bin/llama-bench -m "$model" -ngl 99 -ot exps=CPU -t 16 -fa 1 -r 2 "$@" -o md 2>&1 | grep -E "^\||error|failed" | tail -8
}
batched() {
    step "$2" $L/bin/llama-batched-bench -m "$1" -ngl 99 -ot exps=CPU -t 16 -fa on -c 8192 -b 2048 -ub 512 \
        -npp 128 -ntg 32 -npl 1,4,16 2>&1 | grep -E "^\||error|failed" | tail -6
}
if [[ $parts == *check* ]]; then
    gen 30 tiny-qwen3 q4_k_m /tmp/tiny.gguf
    bench /tmp/tiny.gguf 30 -p 32 -n 16 -r 1
    gen 90 mixtral q4_k_m /tmp/mix16.gguf 16
    bench /tmp/mix16.gguf 100 -p 0 -n 64
    rm -f /tmp/mix16.gguf /tmp/tiny.gguf
    echo "check done at $(( $(date +%s) - t0 )) s"
fi
if [[ $parts == *qwen3-q4* ]]; then
    gen 90 qwen3-30b q4_k_m /tmp/qwen3-q4.gguf
    bench /tmp/qwen3-q4.gguf 100 -p 512 -n 64
    batched /tmp/qwen3-q4.gguf 90
    rm -f /tmp/qwen3-q4.gguf
    echo "qwen3 q4 done at $(( $(date +%s) - t0 )) s"
fi
if [[ $parts == *qwen3-bf16* ]]; then
    dir=""
    for d in /dev/shm /tmp; do [ "$(df --output=avail -B1G $d | tail -1)" -ge 58 ] && { dir=$d; break; }; done
    if [ -z "$dir" ]; then echo "qwen3 bf16 skipped: no 58 GiB free in /dev/shm or /tmp (the file is 56.9 GiB)"; else
        gen 150 qwen3-30b bf16 $dir/qwen3-bf16.gguf
        bench $dir/qwen3-bf16.gguf 120 -p 512 -n 32
        batched $dir/qwen3-bf16.gguf 90
        rm -f $dir/qwen3-bf16.gguf
    fi
    echo "qwen3 bf16 done at $(( $(date +%s) - t0 )) s"
fi
echo "all done at $(( $(date +%s) - t0 )) s"
