#!/usr/bin/env bash
# Builds the llama.cpp that benchmarks/device_llamacpp.sh carries to the lent GPU box, on the dev box (no GPU, no
# network but the package registries): llama.cpp's source from llama-cpp-python's sdist (it vendors llama.cpp),
# CUDA 13.0's compiler, runtime and cuBLAS from NVIDIA's pip wheels (the lent box's driver is CUDA 13.0 and its
# torch carries libcudart/libcublas 13, which the binaries load at run time), sm_90 only, and CPU code for the
# Sapphire Rapids Xeons the lent GPUs sit in (AVX-512 with VNNI and BF16, AMX): not the dev box's own, so the
# binaries do not run here. libcuda is a link-time stub (the driver's library is the box's own).
# Takes about an hour on 2 cores (the build; packing 2 min). Writes benchmarks/llamacpp-cuda.tar.xz (ignored by git).
#
#   bash benchmarks/build_llamacpp.sh [WORKDIR]
set -eu
W=${1:-/tmp/lcpp}
out=$(cd "$(dirname "$0")" && pwd)/llamacpp-cuda.tar.xz
pip=${PIP:-pip}
mkdir -p "$W/cuda" "$W/cu" && cd "$W"
$pip download --no-deps -q -d . --no-binary :all: llama-cpp-python==0.3.36
$pip download --no-deps -q -d cuda "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cublas==13.*" \
    "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
for w in cuda/*.whl; do (cd cu && python3 -m zipfile -e "../$w" .); done
C=$W/cu/nvidia/cu13
chmod +x $C/bin/* $C/bin/crt/* $C/nvvm/bin/* 2>/dev/null || true
ln -sfn lib $C/lib64
(cd $C/lib && ln -sf libcudart.so.13 libcudart.so && ln -sf libcublas.so.13 libcublas.so && ln -sf libcublasLt.so.13 libcublasLt.so)
mkdir -p $C/lib/stubs
syms="cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve cuMemCreate
      cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap cuGetProcAddress cuInit"
for s in $syms; do echo "int $s(void){return 1;}"; done > stub.c
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 stub.c -o $C/lib/stubs/libcuda.so
tar xzf llama_cpp_python-0.3.36.tar.gz
S=$W/llama_cpp_python-0.3.36/vendor/llama.cpp
export CUDA_HOME=$C PATH=$C/bin:$PATH
cmake -S $S -B $S/build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_CUDA_COMPILER=$C/bin/nvcc -DCUDAToolkit_ROOT=$C -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=ON \
    -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON
cmake --build $S/build -j"$(nproc)" --target llama-bench llama-batched-bench
# the two binaries share ~65 MB of CUDA code: a dictionary larger than one of them packs both in ~43 MB (the
# carry limit is 64 MiB); libgomp goes along in case the image has none (the device script adds it only then)
rm -rf pack && mkdir -p pack/bin pack/lib-extra && cp $S/build/bin/llama-bench $S/build/bin/llama-batched-bench pack/bin/
strip pack/bin/*
cp -L /lib/x86_64-linux-gnu/libgomp.so.1 pack/lib-extra/
cp -r $S/gguf-py pack/gguf-py && rm -rf pack/gguf-py/tests
tar -c -C pack . | xz -T1 --lzma2=preset=6,dict=160MiB > "$out"
ls -la "$out"
