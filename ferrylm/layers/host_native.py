"""Native host GEMV kernels for the hybrid path's cold experts: x @ W.T at a few tokens, read at DRAM speed.

Torch's CPU paths read a bf16 expert at ~54 GB/s on the H200 host's 16 cores (oneDNN's GEMM, ~42 beside the
device's in-place reads) and decode NF4 through tensor ops that barely scale with threads (0.66 GB/s of codes;
`layers/cpu_experts.RowBlocks`). These kernels stream the weight once, converting in registers: bf16 -> fp32 by
a shift, NF4 codes -> their level by one 16-lane permute (`vpermps`: the 16 levels fit one AVX-512 register),
a group's products summed, then times its absmax; fp32 accumulation, one output row at a time; x is converted to fp32 once per call.
Each call covers the rows it is given on the calling thread; `layers/cpu_experts` splits a weight's rows over its
pool of single-threaded workers (ctypes releases the GIL during the call), as it does for torch's GEMMs.

They are C compiled at first use with the system's C compiler (`cc`, -O3 -mavx512f) into
`$FERRYLM_CACHE_DIR/kernels/` (default `~/.cache/ferrylm`), named by a hash of the source and flags, written to
a temp file then renamed; loaded through ctypes (no Python headers, no torch headers). `available()` is False,
with the reason in `why_unavailable()`, where the CPU lacks AVX-512F, no compiler runs, or the build fails; the
callers then keep torch's paths. Numerics: the weights are used unrounded in fp32 (the torch paths round a decoded
NF4 weight to bf16 first) and summed in another order, so results agree with the plain paths to fp32 rounding of
a K-long dot product, not bit for bit (tests/test_host_native.py)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define MAXT 16
#define KCHUNK_FLOATS 4096  /* NF4: 16 KB of x per chunk of K stays in L1 beside the streamed codes */

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

static inline __m512 bf16x16_to_f32(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define ALWAYS static inline __attribute__((always_inline))
#define SWITCH_T(CALL) switch (T) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break; \
    case 9: CALL(9); break; case 10: CALL(10); break; case 11: CALL(11); break; case 12: CALL(12); break; \
    case 13: CALL(13); break; case 14: CALL(14); break; case 15: CALL(15); break; default: CALL(16); }

/* T a compile-time constant in each inlined copy (SWITCH_T): the accumulators stay in registers */
ALWAYS void bf16_rows(const float* x, const int T, int K, const uint16_t* w, int64_t ldw, int N, float* out,
                      int64_t ldo) {
    if (T == 1 && K % 32 == 0) {  /* decode's case: two independent accumulators, x in L1 */
        for (int n = 0; n < N; n++) {
            const uint16_t* row = w + (int64_t)n * ldw;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            for (int k = 0; k < K; k += 32) {
                a0 = _mm512_fmadd_ps(bf16x16_to_f32(row + k), _mm512_loadu_ps(x + k), a0);
                a1 = _mm512_fmadd_ps(bf16x16_to_f32(row + k + 16), _mm512_loadu_ps(x + k + 16), a1);
            }
            out[n] = hsum(_mm512_add_ps(a0, a1));
        }
        return;
    }
    /* several tokens: R rows at a time share each load of x (R * T accumulators in registers) */
    const int R = T <= 2 ? 8 : T <= 4 ? 4 : T <= 8 ? 2 : 1;
    int n = 0;
    for (; n + R <= N; n += R) {
        __m512 acc[8][MAXT];
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) {
            __m512 wv[8];
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = bf16x16_to_f32(w + (int64_t)(n + r) * ldw + k);
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) {
                __m512 xv = _mm512_loadu_ps(x + (int64_t)t * K + k);
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) out[(int64_t)t * ldo + n + r] = hsum(acc[r][t]);
    }
    for (; n < N; n++) {
        const uint16_t* row = w + (int64_t)n * ldw;
        __m512 acc[MAXT];
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) {
            __m512 wv = bf16x16_to_f32(row + k);
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)
                acc[t] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (int64_t)t * K + k), acc[t]);
        }
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) out[(int64_t)t * ldo + n] = hsum(acc[t]);
    }
}

/* out[t * ldo + n] = sum_k x[t * K + k] * w[n * ldw + k], rows n in [0, N); K a multiple of 16 */
int ferry_gemv_bf16(const float* x, int T, int K, const uint16_t* w, int64_t ldw, int N, float* out, int64_t ldo) {
    if (T < 1 || T > MAXT || K % 16) return -1;
#define BF16_CALL(t) bf16_rows(x, t, K, w, ldw, N, out, ldo)
    SWITCH_T(BF16_CALL)
    return 0;
}

/* NF4: codes [N, K/2] bytes (row stride ldq bytes), element 2j the low nibble of byte j, 2j+1 the high one;
   absmax [N, K/g] fp32 (row stride lds), g a multiple of 32; levels: the 16 fp32 levels. x comes deinterleaved
   (`nf4_x`): per block of 32 elements its 16 even ones, then its 16 odd ones, so one byte's two nibbles meet
   their two x lanes without a shuffle. A block's 32 weights are decoded once for every token; a group's
   products are summed unscaled, then times its absmax.
   out[t * ldo + n] = sum_k x[t, k] * levels[code(n, k)] * absmax[n, k / g] */
ALWAYS void nf4_rows(const float* x, const int T, int K, const uint8_t* q, int64_t ldq, const float* absmax,
                     int64_t lds, int g, __m512 lv, int N, float* out, int64_t ldo) {
    const __m512i low4 = _mm512_set1_epi32(0x0F);
    /* K in chunks of whole groups whose x rows stay in L1 (T * KC floats <= 16 KB), every row per chunk */
    int KC = (KCHUNK_FLOATS / T) / g * g;
    if (KC < g) KC = g;
    if (KC > K) KC = K;
    for (int c0 = 0; c0 < K; c0 += KC) {
      const int c1 = c0 + KC < K ? c0 + KC : K;
      for (int n = 0; n < N; n++) {
        const uint8_t* row = q + (int64_t)n * ldq;
        const float* sc = absmax + (int64_t)n * lds;
        __m512 acc[MAXT], ga[MAXT];
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int k0 = c0; k0 < c1; k0 += g) {
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) ga[t] = _mm512_setzero_ps();
            for (int k = k0; k < k0 + g; k += 32) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + k / 2)));
                __m512 wl = _mm512_permutexvar_ps(_mm512_and_si512(v, low4), lv);
                __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lv);
                _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) {
                    const float* xt = x + (int64_t)t * K + k;
                    ga[t] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xt), ga[t]);
                    ga[t] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xt + 16), ga[t]);
                }
            }
            const __m512 s = _mm512_set1_ps(sc[k0 / g]);
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) acc[t] = _mm512_fmadd_ps(ga[t], s, acc[t]);
        }
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) {
            float v = hsum(acc[t]);
            out[(int64_t)t * ldo + n] = c0 ? out[(int64_t)t * ldo + n] + v : v;
        }
      }
    }
}

int ferry_gemv_nf4(const float* x, int T, int K, const uint8_t* q, int64_t ldq, const float* absmax, int64_t lds,
                   int g, const float* levels, int N, float* out, int64_t ldo) {
    if (T < 1 || T > MAXT || K % g || g % 32) return -1;
    const __m512 lv = _mm512_loadu_ps(levels);
    /* more than 8 tokens: passes of at most 8 (each decodes the codes again; one pass of 16 tokens ran 2.4x slower
       than two of 8 on the 2-core box: its accumulators no longer stayed in registers) */
    for (int t0 = 0; t0 < T; t0 += 8) {
        const float* xt = x + (int64_t)t0 * K;
        float* ot = out + (int64_t)t0 * ldo;
        const int n = T - t0 < 8 ? T - t0 : 8;
        switch (n) {
#define NF4_CASE(t) case t: nf4_rows(xt, t, K, q, ldq, absmax, lds, g, lv, N, ot, ldo); break;
            NF4_CASE(1) NF4_CASE(2) NF4_CASE(3) NF4_CASE(4) NF4_CASE(5) NF4_CASE(6) NF4_CASE(7) NF4_CASE(8)
        }
    }
    return 0;
}
"""
FLAGS = ("-O3", "-mavx512f", "-shared", "-fPIC", "-fno-math-errno")
MAX_TOKENS = 16
"""Most tokens a call takes (the kernels keep one accumulator register per token)."""

_lib = None
_why: str | None = None
_lock = threading.Lock()


def _cache_dir() -> str:
    # (offload/calibration.cache_dir's folder; not imported from there: layers sit below offload)
    return os.path.join(os.environ.get("FERRYLM_CACHE_DIR") or os.path.expanduser("~/.cache/ferrylm"), "kernels")


def _cpu_has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def _load():
    global _lib, _why
    with _lock:
        if _lib is not None or _why is not None:
            return _lib
        if os.environ.get("FERRYLM_NO_NATIVE"):
            _why = "FERRYLM_NO_NATIVE is set"
            return None
        if not _cpu_has_avx512f():
            _why = "the CPU has no AVX-512F"
            return None
        digest = hashlib.sha256((SOURCE + " ".join(FLAGS)).encode()).hexdigest()[:16]
        path = os.path.join(_cache_dir(), f"host_gemv-{digest}.so")
        if not os.path.exists(path):
            try:
                os.makedirs(_cache_dir(), exist_ok=True)
                with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
                    src, out = os.path.join(tmp, "host_gemv.c"), os.path.join(tmp, "host_gemv.so")
                    with open(src, "w") as f:
                        f.write(SOURCE)
                    cc = os.environ.get("CC", "cc")
                    r = subprocess.run([cc, *FLAGS, src, "-o", out], capture_output=True, text=True, timeout=120)
                    if r.returncode:
                        _why = f"the C compiler failed: {r.stderr.strip()[:300]}"
                        return None
                    os.replace(out, path)  # temp-then-rename: never a half-written library
            except (OSError, subprocess.SubprocessError) as e:
                _why = f"no C compiler ran ({e})"
                return None
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            _why = f"cannot load {path} ({e})"
            return None
        i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.ferry_gemv_bf16.argtypes = [p, i32, i32, p, i64, i32, p, i64]
        lib.ferry_gemv_nf4.argtypes = [p, i32, i32, p, i64, p, i64, i32, p, i32, p, i64]
        lib.ferry_gemv_bf16.restype = lib.ferry_gemv_nf4.restype = i32
        _lib = lib
        return lib


def available() -> bool:
    """Whether the kernels are built and loaded (built now on first call)."""
    return _load() is not None


def why_unavailable() -> str | None:
    _load()
    return _why


def _check(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"native {what} refused its arguments (rc {rc})")


def gemv_bf16(x32: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, N] fp32 (a view with unit column stride) = x32 [T, K] fp32 contiguous @ w.T, w [N, K] bf16 with unit
    column stride (any row stride: a view of a bank's rows or columns); K a multiple of 16, T <= MAX_TOKENS."""
    lib = _load()
    T, K = x32.shape
    N = w.shape[0]
    if w.stride(1) != 1 or out.stride(1) != 1 or not x32.is_contiguous() or w.dtype != torch.bfloat16:
        raise ValueError("native bf16 GEMV: x32 contiguous fp32, w bf16 and out with unit column stride")
    _check(lib.ferry_gemv_bf16(x32.data_ptr(), T, K, w.data_ptr(), w.stride(0), N, out.data_ptr(), out.stride(0)),
           "bf16 GEMV")
    return out


def nf4_x(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] (K a multiple of 32) -> fp32 [T, K] deinterleaved as `gemv_nf4` reads it: per block of 32, the 16
    even elements, then the 16 odd ones. Made once per call and shared by every chunk of rows."""
    T, K = x.shape
    return x.float().reshape(T, K // 32, 16, 2).transpose(2, 3).contiguous().view(T, K)


def gemv_nf4(x32: torch.Tensor, q: torch.Tensor, absmax: torch.Tensor, group: int, levels: torch.Tensor,
             out: torch.Tensor) -> torch.Tensor:
    """out [T, N] fp32 = x [T, K] @ W.T for NF4 W, x32 = `nf4_x(x)`: codes q [N, K/2] uint8 (unit column stride),
    absmax [N, K/group] fp32 (unit column stride), levels [16] fp32."""
    lib = _load()
    T, K = x32.shape
    N = q.shape[0]
    if (q.stride(1) != 1 or absmax.stride(1) != 1 or out.stride(1) != 1 or not x32.is_contiguous()
            or absmax.dtype != torch.float32 or not levels.is_contiguous()):
        raise ValueError("native NF4 GEMV: unit column strides, fp32 absmax and levels")
    _check(lib.ferry_gemv_nf4(x32.data_ptr(), T, K, q.data_ptr(), q.stride(0), absmax.data_ptr(), absmax.stride(0),
                              group, levels.data_ptr(), N, out.data_ptr(), out.stride(0)), "NF4 GEMV")
    return out
