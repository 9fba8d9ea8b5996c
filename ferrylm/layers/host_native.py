"""Native host GEMV kernels for the hybrid path's cold experts: x @ W.T at a few tokens, read at DRAM speed.

Torch's CPU paths read a bf16 expert at ~54 GB/s on the H200 host's 16 cores (oneDNN's GEMM, ~42 beside the
device's in-place reads) and decode NF4 through tensor ops that barely scale with threads (0.66 GB/s of codes;
`layers/cpu_experts.RowBlocks`). These kernels stream the weight once, converting in registers: bf16 -> fp32 by
a shift, NF4 codes -> their level by one 16-lane permute (`vpermps`: the 16 levels fit one AVX-512 register),
a group's products summed, then times its absmax; fp32 accumulation, one output row at a time; x is converted to fp32 once per call.
Where the CPU has AVX512-BF16 (and the compiler its target), NF4 runs on `vdpbf16ps` instead: levels from a bf16
table (`vpermw`), bf16 activations, 32 products an instruction (2-core box, one thread, in cache: 1.4-1.5x the fp32
kernel at 1-4 tokens; an expert from DRAM 9.1 ms against 12.7); its levels are rounded to bf16 (as the torch path
rounds each decoded weight), `nf4_x` prepares x for whichever kernel runs. Dense bf16 weights with bf16 x run on
`vdpbf16ps` too (`gemv_bf16_bx`: 1-16 tokens, no conversion of the weights).
Each call covers the rows it is given on the calling thread; `layers/cpu_experts` splits a weight's rows over its
pool of single-threaded workers (ctypes releases the GIL during the call), as it does for torch's GEMMs. The
bf16-x GEMV and the NF4 GEMV also run a whole matrix in one call on a pool of C threads (`gemv_bf16_bx_mt`,
`gemv_nf4(threads=)`), and a whole SiLU expert runs in one call there (`expert_silu_bf16`: gate and up, the SiLU
product rounded as torch rounds it, down). 2-core box, a Mixtral expert from DRAM at 1 / 2 / 4 / 8 / 16 tokens,
against oneDNN's bf16 GEMMs in the same run: 1.71 / 1.29 / 1.15 / 1.17 / 1.27x (docs/benchmarks.md, session 22).

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

from ferrylm.weights.quant import NF4_LEVELS

log = logging.getLogger(__name__)

SOURCE = r"""
#ifdef FERRY_NO_BF16  /* the AMX kernels use the AVX512-BF16 ones' helpers (fp8_words): no BF16, no AMX */
#define FERRY_NO_AMX
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>
#include <sys/syscall.h>

#define MAXT 16
#define AMX_MAXT 64  /* the AMX kernel: tokens in blocks of 16, each block's x packed apart */
#define XMAXT AMX_MAXT  /* the expert's buffers: the most tokens any kernel takes */

/* A pool of worker threads in C for the row-parallel entry points (`*_mt`): one call from Python runs a whole
   matrix on `threads` threads (the caller and threads - 1 workers), each taking the next chunk of rows as it
   comes free. The workers start on first use from the calling thread (they inherit its CPU binding), sleep on a
   condition variable between calls and live as long as the process; one parallel call runs at a time. */
typedef void (*ferry_task)(const void* args, int a, int c);  /* rows [a, a + c) */
static struct {
    pthread_mutex_t mu, call;
    pthread_cond_t go, done;
    int started, active, left, n, chunk;
    long gen;
    ferry_task fn;
    const void* args;
    atomic_int next;
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void run_chunks(ferry_task fn, const void* args, int n, int chunk) {
    for (;;) {
        int a = atomic_fetch_add(&P.next, chunk);
        if (a >= n) return;
        fn(args, a, n - a < chunk ? n - a : chunk);
    }
}

#define POOL_MAX 1024
static long pool_born[POOL_MAX];  /* the job count when each worker was started: it takes the jobs after it */

static void* pool_worker(void* arg) {
    const int id = (int)(intptr_t)arg;
    long seen = pool_born[id];
    pthread_mutex_lock(&P.mu);
    for (;;) {
        while (P.gen == seen) pthread_cond_wait(&P.go, &P.mu);
        seen = P.gen;
        const int mine = id < P.active;
        ferry_task fn = P.fn;
        const void* args = P.args;
        const int n = P.n, chunk = P.chunk;
        pthread_mutex_unlock(&P.mu);
        if (mine) run_chunks(fn, args, n, chunk);
        pthread_mutex_lock(&P.mu);
        if (mine && --P.left == 0) pthread_cond_signal(&P.done);
    }
    return NULL;
}

static void pool_after_fork(void) {  /* a forked child has none of the parent's workers */
    pthread_mutex_init(&P.mu, NULL);
    pthread_mutex_init(&P.call, NULL);
    pthread_cond_init(&P.go, NULL);
    pthread_cond_init(&P.done, NULL);
    P.started = 0;
}

/* fn over rows [0, n) in chunks of `chunk` rows on `threads` threads; returns 0, or -1 when fewer workers than
   asked could be started (the rows are all computed either way, on fewer threads) */
static int par_rows(ferry_task fn, const void* args, int n, int threads, int chunk) {
    if (threads <= 1 || n <= chunk) {  /* (so chunk < n below: the shared counter stays below 2n + threads * n) */
        fn(args, 0, n);
        return 0;
    }
    pthread_mutex_lock(&P.call);
    static int forked_hook = 0;
    if (!forked_hook) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        forked_hook = 1;
    }
    if (threads > POOL_MAX) threads = POOL_MAX;
    while (P.started < threads - 1) {
        pthread_t t;
        pool_born[P.started] = P.gen;  /* (gen changes only under P.call, held here) */
        if (pthread_create(&t, NULL, pool_worker, (void*)(intptr_t)P.started)) break;
        pthread_detach(t);
        P.started++;
    }
    const int workers = P.started < threads - 1 ? P.started : threads - 1;
    pthread_mutex_lock(&P.mu);
    P.fn = fn;
    P.args = args;
    P.n = n;
    P.chunk = chunk;
    atomic_store(&P.next, 0);
    P.active = P.left = workers;
    P.gen++;
    pthread_cond_broadcast(&P.go);
    pthread_mutex_unlock(&P.mu);
    run_chunks(fn, args, n, chunk);
    pthread_mutex_lock(&P.mu);
    while (P.left) pthread_cond_wait(&P.done, &P.mu);
    pthread_mutex_unlock(&P.mu);
    pthread_mutex_unlock(&P.call);
    return workers == threads - 1 ? 0 : -1;
}
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

/* NF4: K in chunks of whole groups whose x rows stay in L1 (T * KC elements of x in `budget`), every row per chunk */
static inline int k_chunk(int budget, int T, int g, int K) {
    int KC = (budget / T) / g * g;
    if (KC < g) KC = g;
    return KC > K ? K : KC;
}

/* NF4: more than 8 tokens run in passes of at most 8 (each decodes the codes again; one pass of 16 tokens ran 2.4x
   slower than two of 8 on the 2-core box: its accumulators no longer stayed in registers). ROWS(xt, t, ot): the
   kernel on pass rows xt (x's element type XT) into ot, t a compile-time constant in each case. */
#define PASSES_OF_8(XT, ROWS) \
    for (int t0 = 0; t0 < T; t0 += 8) { \
        const XT* xt = x + (int64_t)t0 * K; \
        float* ot = out + (int64_t)t0 * ldo; \
        switch (T - t0 < 8 ? T - t0 : 8) { \
            case 1: ROWS(xt, 1, ot); break; case 2: ROWS(xt, 2, ot); break; case 3: ROWS(xt, 3, ot); break; \
            case 4: ROWS(xt, 4, ot); break; case 5: ROWS(xt, 5, ot); break; case 6: ROWS(xt, 6, ot); break; \
            case 7: ROWS(xt, 7, ot); break; default: ROWS(xt, 8, ot); } }

/* the read ceiling of the same access pattern: every element of rows [0, N) loaded and summed (as integers), no
   GEMV; out[n] = the row's sum, so the loads cannot be dropped */
int ferry_read_bf16(int K, const uint16_t* w, int64_t ldw, int N, float* out) {
    if (K % 32) return -1;
    for (int n = 0; n < N; n++) {
        const uint16_t* row = w + (int64_t)n * ldw;
        __m512i a = _mm512_setzero_si512();
        for (int k = 0; k < K; k += 32) a = _mm512_add_epi32(a, _mm512_loadu_si512((const void*)(row + k)));
        out[n] = (float)_mm512_reduce_add_epi32(a);
    }
    return 0;
}

typedef struct { int K; const uint16_t* w; int64_t ldw; float* out; } read_args;
static void read_task(const void* p, int a, int c) {
    const read_args* r = (const read_args*)p;
    ferry_read_bf16(r->K, r->w + (int64_t)a * r->ldw, r->ldw, c, r->out + a);
}
/* `ferry_read_bf16` over rows [0, N) on `threads` threads of the pool, chunks of `chunk` rows */
int ferry_read_bf16_mt(int K, const uint16_t* w, int64_t ldw, int N, float* out, int threads, int chunk) {
    if (K % 32 || threads < 1 || chunk < 1) return -1;
    read_args r = {K, w, ldw, out};
    par_rows(read_task, &r, N, threads, chunk);
    return 0;
}

/* T a compile-time constant in each inlined copy (SWITCH_T): the accumulators stay in registers */
/* pf: at one token, prefetch the same columns pf rows on (0: the hardware prefetchers alone) */
ALWAYS void bf16_rows(const float* x, const int T, int K, const uint16_t* w, int64_t ldw, int N, float* out,
                      int64_t ldo, int pf) {
    if (T == 1 && K % 32 == 0) {  /* decode's case: two independent accumulators, x in L1 */
        for (int n = 0; n < N; n++) {
            const uint16_t* row = w + (int64_t)n * ldw;
            /* the same columns `pf` rows on (within this call's rows), one line an iteration */
            const char* ahead = (const char*)(w + (int64_t)(n + pf < N ? n + pf : n) * ldw);
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            if (pf && n + pf < N) {
                for (int k = 0; k < K; k += 32) {
                    _mm_prefetch(ahead + 2 * k, _MM_HINT_T0);
                    a0 = _mm512_fmadd_ps(bf16x16_to_f32(row + k), _mm512_loadu_ps(x + k), a0);
                    a1 = _mm512_fmadd_ps(bf16x16_to_f32(row + k + 16), _mm512_loadu_ps(x + k + 16), a1);
                }
            } else if (K % 64 == 0) {  /* four accumulators: FMA latency off the critical path */
                __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
                for (int k = 0; k < K; k += 64) {
                    a0 = _mm512_fmadd_ps(bf16x16_to_f32(row + k), _mm512_loadu_ps(x + k), a0);
                    a1 = _mm512_fmadd_ps(bf16x16_to_f32(row + k + 16), _mm512_loadu_ps(x + k + 16), a1);
                    a2 = _mm512_fmadd_ps(bf16x16_to_f32(row + k + 32), _mm512_loadu_ps(x + k + 32), a2);
                    a3 = _mm512_fmadd_ps(bf16x16_to_f32(row + k + 48), _mm512_loadu_ps(x + k + 48), a3);
                }
                a0 = _mm512_add_ps(a0, a2);
                a1 = _mm512_add_ps(a1, a3);
            } else {
                for (int k = 0; k < K; k += 32) {
                    a0 = _mm512_fmadd_ps(bf16x16_to_f32(row + k), _mm512_loadu_ps(x + k), a0);
                    a1 = _mm512_fmadd_ps(bf16x16_to_f32(row + k + 16), _mm512_loadu_ps(x + k + 16), a1);
                }
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
int ferry_gemv_bf16(const float* x, int T, int K, const uint16_t* w, int64_t ldw, int N, float* out, int64_t ldo,
                    int pf) {
    if (T < 1 || T > MAXT || K % 16 || pf < 0) return -1;
#define BF16_CALL(t) bf16_rows(x, t, K, w, ldw, N, out, ldo, pf)
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
    const int KC = k_chunk(KCHUNK_FLOATS, T, g, K);
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
#define NF4_ROWS(xt, t, ot) nf4_rows(xt, t, K, q, ldq, absmax, lds, g, lv, N, ot, ldo)
    PASSES_OF_8(float, NF4_ROWS)
    return 0;
}

/* NF4 with AVX512-BF16 dot products (`vdpbf16ps`: 32 bf16 products a instruction into 16 fp32 lanes, where the
   fp32 kernel above does 16): the levels are a bf16 table of 32 words (16 levels, then zeros) looked up by
   `vpermw`, x comes in bf16, per block of 64 elements its 32 even ones then its 32 odd ones (`nf4_x(bf16=True)`),
   so word j of a block's low-nibble weights (element 2j) meets x's word j. Products of two bf16 are exact in fp32;
   a group's sums times its absmax. g a multiple of 64. Built only where the compiler takes the target. */
#ifndef FERRY_NO_BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")
#define KCHUNK_BF16 8192  /* 16 KB of bf16 x per chunk of K */
ALWAYS void nf4b_rows(const uint16_t* x, const int T, int K, const uint8_t* q, int64_t ldq, const float* absmax,
                      int64_t lds, int g, __m512i lv, int N, float* out, int64_t ldo) {
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    const int KC = k_chunk(KCHUNK_BF16, T, g, K);
    for (int c0 = 0; c0 < K; c0 += KC) {
      const int c1 = c0 + KC < K ? c0 + KC : K;
      for (int n = 0; n < N; n++) {
        const uint8_t* row = q + (int64_t)n * ldq;
        const float* sc = absmax + (int64_t)n * lds;
        __m512 acc[8], gl[8], gh[8];
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int k0 = c0; k0 < c1; k0 += g) {
            _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                gl[t] = _mm512_setzero_ps();
                gh[t] = _mm512_setzero_ps();
            }
            for (int k = k0; k < k0 + g; k += 64) {
                __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(row + k / 2)));
                __m512i wl = _mm512_permutexvar_epi16(_mm512_and_si512(v, low4), lv);
                __m512i wh = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lv);
                _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                    const uint16_t* xt = x + (int64_t)t * K + k;
                    gl[t] = _mm512_dpbf16_ps(gl[t], (__m512bh)wl, (__m512bh)_mm512_loadu_si512((const void*)xt));
                    gh[t] = _mm512_dpbf16_ps(gh[t], (__m512bh)wh, (__m512bh)_mm512_loadu_si512((const void*)(xt + 32)));
                }
            }
            const __m512 s = _mm512_set1_ps(sc[k0 / g]);
            _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
                acc[t] = _mm512_fmadd_ps(_mm512_add_ps(gl[t], gh[t]), s, acc[t]);
        }
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            float v = _mm512_reduce_add_ps(acc[t]);
            out[(int64_t)t * ldo + n] = c0 ? out[(int64_t)t * ldo + n] + v : v;
        }
      }
    }
}

int ferry_gemv_nf4_bf16(const uint16_t* x, int T, int K, const uint8_t* q, int64_t ldq, const float* absmax,
                        int64_t lds, int g, const uint16_t* levels32, int N, float* out, int64_t ldo) {
    if (T < 1 || T > MAXT || K % g || g % 64) return -1;
    const __m512i lv = _mm512_loadu_si512((const void*)levels32);
#define NF4B_ROWS(xt, t, ot) nf4b_rows(xt, t, K, q, ldq, absmax, lds, g, lv, N, ot, ldo)
    PASSES_OF_8(uint16_t, NF4B_ROWS)
    return 0;
}
/* fp8 e4m3 rows (one byte a weight, in order) with AVX512-BF16 dot products: 32 codes become 32 bf16 words
   holding exactly their values (e4m3's range lies inside bf16's normal one): a normal code's 7 magnitude bits
   shifted under bf16's exponent with the bias moved from 7 to 127, a subnormal one (exponent 0) from a table of its
   8 values; the sign from the sign-extended byte. The two NaN codes read as +-480 (as `fp8_to_bf16`). x bf16 [T, K]
   in order; a group of g columns' sums times its fp32 scale (`gstep` 0: one scale a row, `scale[n * lds]`). */
ALWAYS __m512i fp8_words(__m256i codes, __m512i subtab) {
    const __m512i v = _mm512_cvtepi8_epi16(codes);  /* sign-extended: bit 15 is the sign */
    const __m512i normal = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(v, 4), _mm512_set1_epi16(0x07F0)),
                                            _mm512_set1_epi16(120 << 7));
    const __mmask32 sub = _mm512_testn_epi16_mask(v, _mm512_set1_epi16(0x78));
    /* a subnormal's low 5 bits are 00mmm: its table index as they stand (vpermw reads 5 bits) */
    const __m512i w = _mm512_mask_permutexvar_epi16(normal, sub, v, subtab);
    return _mm512_ternarylogic_epi32(w, v, _mm512_set1_epi16((short)0x8000), 0xF8);  /* w | (v & 0x8000) */
}

/* CH independent chains of dot products a token (CH blocks of 32 columns a step): at few tokens one chain is bound
   by `vdpbf16ps`' latency (one token, one chain: 4.7 GB/s on a Xeon core, most of it waiting) */
#define FP8_CH(T) ((T) <= 2 ? 4 : (T) <= 4 ? 2 : 1)
ALWAYS void fp8_rows(const uint16_t* x, const int T, int K, const uint8_t* q, int64_t ldq, const float* scale,
                     int64_t lds, int g, int gstep, __m512i subtab, int N, float* out, int64_t ldo) {
    const int KC = k_chunk(KCHUNK_BF16, T, g, K);
    const int CH = FP8_CH(T);
    for (int c0 = 0; c0 < K; c0 += KC) {
      const int c1 = c0 + KC < K ? c0 + KC : K;
      for (int n = 0; n < N; n++) {
        const uint8_t* row = q + (int64_t)n * ldq;
        const float* sc = scale + (int64_t)n * lds;
        __m512 acc[8], ga[4][8];
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int k0 = c0; k0 < c1; k0 += g) {
            _Pragma("GCC unroll 4") for (int j = 0; j < CH; j++)
                _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) ga[j][t] = _mm512_setzero_ps();
            int k = k0;
            for (; k + 32 * CH <= k0 + g; k += 32 * CH) {
                _Pragma("GCC unroll 4") for (int j = 0; j < CH; j++) {
                    const __m512i w = fp8_words(_mm256_loadu_si256((const __m256i*)(row + k + 32 * j)), subtab);
                    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
                        ga[j][t] = _mm512_dpbf16_ps(ga[j][t], (__m512bh)w,
                                                    (__m512bh)_mm512_loadu_si512((const void*)(x + (int64_t)t * K + k + 32 * j)));
                }
            }
            for (; k < k0 + g; k += 32) {  /* a group that is no multiple of 32 * CH: its tail on chain 0 */
                const __m512i w = fp8_words(_mm256_loadu_si256((const __m256i*)(row + k)), subtab);
                _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
                    ga[0][t] = _mm512_dpbf16_ps(ga[0][t], (__m512bh)w,
                                                (__m512bh)_mm512_loadu_si512((const void*)(x + (int64_t)t * K + k)));
            }
            const __m512 s = _mm512_set1_ps(sc[(k0 / g) * gstep]);
            _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                __m512 sum = ga[0][t];
                _Pragma("GCC unroll 4") for (int j = 1; j < CH; j++) sum = _mm512_add_ps(sum, ga[j][t]);
                acc[t] = _mm512_fmadd_ps(sum, s, acc[t]);
            }
        }
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            float v = _mm512_reduce_add_ps(acc[t]);
            out[(int64_t)t * ldo + n] = c0 ? out[(int64_t)t * ldo + n] + v : v;
        }
      }
    }
}

int ferry_gemv_fp8(const uint16_t* x, int T, int K, const uint8_t* q, int64_t ldq, const float* scale, int64_t lds,
                   int g, int gstep, const uint16_t* subtab32, int N, float* out, int64_t ldo) {
    if (T < 1 || T > MAXT || g < 32 || K % g || g % 32 || (gstep != 0 && gstep != 1)) return -1;
    const __m512i subtab = _mm512_loadu_si512((const void*)subtab32);
#define FP8_ROWS(xt, t, ot) fp8_rows(xt, t, K, q, ldq, scale, lds, g, gstep, subtab, N, ot, ldo)
    PASSES_OF_8(uint16_t, FP8_ROWS)
    return 0;
}
/* bf16 rows at one token with bf16 x (`vdpbf16ps`: 32 products an instruction, no conversion of the weights; x
   [K] bf16 is half the fp32 x's bytes, so a 14336-long x stays in L1): out[n] = sum_k x[k] * w[n * ldw + k]
   (products exact in fp32, fp32 sums). K a multiple of 32; pf as `bf16_rows`'. */
int ferry_gemv_bf16_bx(const uint16_t* x, int K, const uint16_t* w, int64_t ldw, int N, float* out, int pf) {
    if (K % 32 || pf < 0) return -1;
    for (int n = 0; n < N; n++) {
        const uint16_t* row = w + (int64_t)n * ldw;
        /* the same columns `pf` rows on (within this call's rows): the four lines of the next step there */
        const char* ahead = (const char*)(w + (int64_t)(pf && n + pf < N ? n + pf : n) * ldw);
        const int fetch = pf && n + pf < N;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        int k = 0;
        for (; k + 128 <= K; k += 128) {
            if (fetch) {
                _mm_prefetch(ahead + 2 * k, _MM_HINT_T0);
                _mm_prefetch(ahead + 2 * k + 64, _MM_HINT_T0);
                _mm_prefetch(ahead + 2 * k + 128, _MM_HINT_T0);
                _mm_prefetch(ahead + 2 * k + 192, _MM_HINT_T0);
            }
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void*)(row + k)),
                                  (__m512bh)_mm512_loadu_si512((const void*)(x + k)));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void*)(row + k + 32)),
                                  (__m512bh)_mm512_loadu_si512((const void*)(x + k + 32)));
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void*)(row + k + 64)),
                                  (__m512bh)_mm512_loadu_si512((const void*)(x + k + 64)));
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512((const void*)(row + k + 96)),
                                  (__m512bh)_mm512_loadu_si512((const void*)(x + k + 96)));
        }
        for (; k < K; k += 32)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void*)(row + k)),
                                  (__m512bh)_mm512_loadu_si512((const void*)(x + k)));
        out[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
    return 0;
}
/* bf16 rows at T tokens with bf16 x, T a compile-time constant: each 32 weights loaded once for every token (one
   `vdpbf16ps` a token), S accumulator registers a token (S * T >= 8 chains, so the instruction's latency is hidden
   at few tokens: at 2 tokens and one chain each the 2-core box ran 38 GB/s from L2 against 95 at one token on four);
   K in chunks whose x stays in L1 (T * KC * 2 bytes <= 32 KB: at 16 tokens 1024 of K), every row per chunk, the
   chunks' sums added in order (a row's result does not depend on which thread or call ran it). x comes packed
   (`bxt_pack`, once a call): per chunk, block by block [KC / 32][T][32], so a step's T loads are adjacent lines,
   where x's own rows, K * 2 bytes apart, fall in the same L1 sets and evict each other (2-core box: 2 tokens ran 24
   GB/s, 16 ran 7). Rows `pf` ahead are prefetched, the same chunk's lines, one a step: with K chunked a row is read
   in runs of KC * 2 bytes that the hardware's stream prefetchers, which stop at page ends, no longer follow. */
#define BXT_BUDGET 16384  /* x elements (32 KB of bf16) a chunk of K */
#define BXT_S(t) ((t) >= 8 ? 1 : (t) >= 4 ? 2 : (8 + (t) - 1) / (t))
static inline int bxt_kc(int T, int K) {
    int KC = (BXT_BUDGET / T) / 32 * 32;
    return KC > K ? K : KC;
}
/* x [T, K] -> xb [T * K]: element (t, k) of chunk [c0, c0 + KC) at c0 * T + ((k - c0) / 32 * T + t) * 32 + k % 32 */
static void bxt_pack(const uint16_t* x, int T, int K, uint16_t* xb) {
    const int KC = bxt_kc(T, K);
    for (int c0 = 0; c0 < K; c0 += KC) {
        const int c1 = c0 + KC < K ? c0 + KC : K;
        for (int k = c0; k < c1; k += 32)
            for (int t = 0; t < T; t++)
                memcpy(xb + (int64_t)c0 * T + ((int64_t)(k - c0) / 32 * T + t) * 32, x + (int64_t)t * K + k, 64);
    }
}
ALWAYS void bxt_rows(const uint16_t* xb, const int T, const int S, int K, const uint16_t* w, int64_t ldw, int N,
                     float* out, int64_t ldo, int pf) {
    const int KC = bxt_kc(T, K);
    for (int c0 = 0; c0 < K; c0 += KC) {
      const int c1 = c0 + KC < K ? c0 + KC : K;
      for (int n = 0; n < N; n++) {
        const uint16_t* row = w + (int64_t)n * ldw;
        /* the line `pf` rows on in this chunk, or past the last row the next chunk's first rows */
        const int an = n + pf < N ? n + pf : n + pf - N;
        const int ac = n + pf < N ? c0 : c0 + KC;
        const int fetch = pf && an < N && ac < K;
        const char* ahead = (const char*)(w + (int64_t)an * ldw + ac) - 2 * c0;
        __m512 acc[MAXT * 8];
        _Pragma("GCC unroll 16") for (int i = 0; i < T * S; i++) acc[i] = _mm512_setzero_ps();
        const uint16_t* xk = xb + (int64_t)c0 * T;
        int k = c0;
        for (; k + 32 * S <= c1; k += 32 * S) {
            _Pragma("GCC unroll 8") for (int s = 0; s < S; s++) {
                if (fetch) _mm_prefetch(ahead + 2 * (k + 32 * s), _MM_HINT_T0);
                const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(row + k + 32 * s));
                _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)
                    acc[s * T + t] = _mm512_dpbf16_ps(acc[s * T + t], wv,
                                                      (__m512bh)_mm512_load_si512((const void*)(xk + 32 * t)));
                xk += 32 * T;
            }
        }
        for (; k < c1; k += 32, xk += 32 * T) {
            if (fetch) _mm_prefetch(ahead + 2 * k, _MM_HINT_T0);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(row + k));
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)
                acc[t] = _mm512_dpbf16_ps(acc[t], wv, (__m512bh)_mm512_load_si512((const void*)(xk + 32 * t)));
        }
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) {
            __m512 a = acc[t];
            _Pragma("GCC unroll 8") for (int s = 1; s < S; s++) a = _mm512_add_ps(a, acc[s * T + t]);
            float v = _mm512_reduce_add_ps(a);
            out[(int64_t)t * ldo + n] = c0 ? out[(int64_t)t * ldo + n] + v : v;
        }
      }
    }
}
#ifndef FERRY_NO_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
/* AMX (Sapphire Rapids and later): a tile multiply takes 16 rows of the weight x 32 of K against 32 of K x T tokens
   (one `tdpbf16ps`, 16 x T x 32 products), so at 2-16 tokens the weight's bytes, not the arithmetic, bound a core:
   one thread read a Mixtral w13 at 13.6-14.9 GB/s at 1-16 tokens on the 2-core box where the AVX512-BF16 kernel
   above ran 5 GB/s at 16 (one `vdpbf16ps` a token per 32 weights). The weight is tile A as it lies (16 rows, 64
   bytes each, row stride ldw: no re-layout); x is tile B in the VNNI layout (`amx_pack`: per 32 of K, 16 rows of
   the pairs (k, k + 1) of every token), packed once a call. Every row's result is its K / 32 tile products summed
   in order of K, whichever rows share its tile: the bits do not depend on the thread split. Tiles: 0-3 results
   (16 rows x <= 16 tokens fp32 each: two row tiles x two token blocks), 4-5 weights, 6-7 x (a token block each). */
typedef struct { uint8_t palette_id, start_row, rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_cfg;
/* tiles for `rows` weight rows against token blocks of T0 and T1 (0: none) tokens: results 0-1 (block 0) and 2-3
   (block 1), weights 4-5, x 6 (block 0) and 7 (block 1) */
static void amx_config(int T0, int T1, int rows) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    c.rows[0] = c.rows[1] = c.rows[4] = c.rows[5] = rows;
    c.colsb[0] = c.colsb[1] = c.colsb[6] = 4 * T0;
    c.colsb[4] = c.colsb[5] = 64;
    c.rows[6] = 16;
    if (T1) {
        c.rows[2] = c.rows[3] = rows;
        c.colsb[2] = c.colsb[3] = c.colsb[7] = 4 * T1;
        c.rows[7] = 16;
    }
    _tile_loadconfig(&c);
}
/* the process's permission to use the tile registers (Linux: arch_prctl ARCH_REQ_XCOMP_PERM XTILEDATA); 0: granted */
int ferry_amx_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }
/* x [T, K] bf16 -> xv, tokens in blocks of 16 (block b: tokens [16b, 16b + Tb) at xv + 16b * K): element (t, k) of a
   block at (k / 32 * 16 + k % 32 / 2) * 2Tb + 2t + k % 2 */
static void amx_pack(const uint16_t* x, int T, int K, uint16_t* xv) {
    for (int t0 = 0; t0 < T; t0 += 16) {
        const int tb = T - t0 < 16 ? T - t0 : 16;
        const uint16_t* xt = x + (int64_t)t0 * K;
        uint16_t* v = xv + (int64_t)t0 * K;
        for (int p = 0; p < K / 2; p++)  /* the pair (k, k + 1) = (2p, 2p + 1), 4 bytes a copy */
            for (int t = 0; t < tb; t++) memcpy(v + ((int64_t)p * tb + t) * 2, xt + (int64_t)t * K + 2 * p, 4);
    }
}
static void amx_store(int j, float* c, int T, int rows, float* out, int64_t ldo) {
    switch (j) {  /* (a tile's number is an immediate) */
        case 0: _tile_stored(0, c, 4 * T); break;
        case 1: _tile_stored(1, c, 4 * T); break;
        case 2: _tile_stored(2, c, 4 * T); break;
        default: _tile_stored(3, c, 4 * T);
    }
    for (int i = 0; i < rows; i++)
        for (int t = 0; t < T; t++) out[(int64_t)t * ldo + i] = c[i * T + t];
}
/* token blocks of T0 and T1 (0: none; each <= 16, x packed for each alone, at xv0 and xv1) over rows [0, N): the
   weight tile loaded once for both blocks */
static void amx_block(const uint16_t* xv0, int T0, const uint16_t* xv1, int T1, int K, const uint16_t* w, int64_t ldw,
                      int N, float* out0, float* out1, int64_t ldo) {
    float c[16 * 16];
    const int64_t lw = ldw * 2;
    int n0 = 0;
    amx_config(T0, T1, 16);
    for (; n0 + 32 <= N; n0 += 32) {
        const uint16_t* r = w + (int64_t)n0 * ldw;
        _tile_zero(0);
        _tile_zero(1);
        if (T1) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int k = 0; k < K; k += 32) {
            _tile_loadd(6, xv0 + (int64_t)k * T0, 4 * T0);
            _tile_loadd(4, r + k, lw);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, r + 16 * ldw + k, lw);
            _tile_dpbf16ps(1, 5, 6);
            if (T1) {
                _tile_loadd(7, xv1 + (int64_t)k * T1, 4 * T1);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        amx_store(0, c, T0, 16, out0 + n0, ldo);
        amx_store(1, c, T0, 16, out0 + n0 + 16, ldo);
        if (T1) {
            amx_store(2, c, T1, 16, out1 + n0, ldo);
            amx_store(3, c, T1, 16, out1 + n0 + 16, ldo);
        }
    }
    for (int rows; n0 < N; n0 += rows) {
        rows = N - n0 < 16 ? N - n0 : 16;
        if (rows < 16) amx_config(T0, T1, rows);
        const uint16_t* r = w + (int64_t)n0 * ldw;
        _tile_zero(0);
        if (T1) _tile_zero(2);
        for (int k = 0; k < K; k += 32) {
            _tile_loadd(6, xv0 + (int64_t)k * T0, 4 * T0);
            _tile_loadd(4, r + k, lw);
            _tile_dpbf16ps(0, 4, 6);
            if (T1) {
                _tile_loadd(7, xv1 + (int64_t)k * T1, 4 * T1);
                _tile_dpbf16ps(2, 4, 7);
            }
        }
        amx_store(0, c, T0, rows, out0 + n0, ldo);
        if (T1) amx_store(2, c, T1, rows, out1 + n0, ldo);
    }
}
#define AMX_ROWS 32  /* rows a step above 32 tokens: each pair of token blocks over them while they sit in L2 (<= 1 MB) */
/* out[t * ldo + n] = sum_k x[t, k] w[n * ldw + k] for rows [0, N), x packed by `amx_pack`; 1 <= T <= AMX_MAXT, K a
   multiple of 32. Rows in pairs of tiles of 16 (the x tile loaded once for both), then one tile, then the last
   N % 16 rows in tiles of that many rows; tokens in blocks of 16, two at a time against each weight tile; above 32
   tokens, AMX_ROWS rows at a time, each pair of blocks over them in turn (the first pair reads them from DRAM, the
   next from L2). Each row's result for a token is its K / 32 tile products summed in order of K. */
static void amx_rows(const uint16_t* xv, int T, int K, const uint16_t* w, int64_t ldw, int N, float* out,
                     int64_t ldo) {
    const int step = T <= 32 ? N : AMX_ROWS;
    for (int n0 = 0; n0 < N; n0 += step) {
        const int m = N - n0 < step ? N - n0 : step;
        for (int t0 = 0; t0 < T; t0 += 32) {
            const int T0 = T - t0 < 16 ? T - t0 : 16, T1 = T - t0 - T0 < 16 ? (T - t0 - T0 > 0 ? T - t0 - T0 : 0) : 16;
            amx_block(xv + (int64_t)t0 * K, T0, T1 ? xv + (int64_t)(t0 + 16) * K : NULL, T1, K, w + (int64_t)n0 * ldw,
                      ldw, m, out + (int64_t)t0 * ldo + n0, T1 ? out + (int64_t)(t0 + 16) * ldo + n0 : NULL, ldo);
        }
    }
    _tile_release();
}
#define FP8_AMX_G 256  /* widest group the AMX fp8 kernel decodes at once (per channel: `fp8_group`'s g) */
/* fp8 rows on AMX tiles (one token block, T <= 16, x packed by `amx_pack`): per 16 rows, each group of g columns is
   decoded (`fp8_words`, exact) into bf16 tile rows in an L1 buffer and multiplied against x; each group's tile
   sums times its row's scale (gstep 0, one scale a row: the whole row's sums times it). Where the AVX512-BF16
   kernel spends one `vdpbf16ps` a token per 32 weights, a tile multiply does 16 rows x T tokens x 32. */
static void fp8_amx_rows(const uint16_t* xv, int T, int K, const uint8_t* q, int64_t ldq, const float* scale,
                         int64_t lds, int g, int gstep, __m512i subtab, int N, float* out, int64_t ldo) {
    uint16_t buf[16 * FP8_AMX_G] __attribute__((aligned(64)));
    float c[16 * 16], acc[16 * 16];
    int configured = 0;
    for (int n0 = 0; n0 < N; n0 += 16) {
        const int rows = N - n0 < 16 ? N - n0 : 16;
        if (configured != rows) {
            amx_config(T, 0, rows);
            configured = rows;
        }
        memset(acc, 0, sizeof acc);
        _tile_zero(0);
        for (int k0 = 0; k0 < K; k0 += g) {
            for (int i = 0; i < rows; i++) {
                const uint8_t* src = q + (int64_t)(n0 + i) * ldq + k0;
                for (int k = 0; k < g; k += 32)
                    _mm512_store_si512((void*)(buf + i * g + k),
                                       fp8_words(_mm256_loadu_si256((const __m256i*)(src + k)), subtab));
            }
            for (int k = 0; k < g; k += 32) {
                _tile_loadd(4, buf + k, 2 * g);
                _tile_loadd(6, xv + (int64_t)(k0 + k) * T, 4 * T);
                _tile_dpbf16ps(0, 4, 6);
            }
            if (gstep) {
                _tile_stored(0, c, 4 * T);
                _tile_zero(0);
                for (int i = 0; i < rows; i++) {
                    const float sc = scale[(int64_t)(n0 + i) * lds + k0 / g];
                    for (int t = 0; t < T; t++) acc[i * T + t] += c[i * T + t] * sc;
                }
            }
        }
        if (!gstep) {
            _tile_stored(0, c, 4 * T);
            for (int i = 0; i < rows; i++)
                for (int t = 0; t < T; t++) acc[i * T + t] = c[i * T + t] * scale[(int64_t)(n0 + i) * lds];
        }
        for (int i = 0; i < rows; i++)
            for (int t = 0; t < T; t++) out[(int64_t)t * ldo + n0 + i] = acc[i * T + t];
    }
    _tile_release();
}
int ferry_has_amx(void) { return 1; }
#pragma GCC pop_options
#else
int ferry_amx_init(void) { return -1; }
int ferry_has_amx(void) { return 0; }
#endif
/* x as the row kernels read it: at one token as it is, else `bxt_pack`ed, or `amx_pack`ed for the AMX kernel */
static void bx_pack(const uint16_t* x, int T, int K, uint16_t* xb, int amx) {
#ifndef FERRY_NO_AMX
    if (amx) {
        amx_pack(x, T, K, xb);
        return;
    }
#endif
    bxt_pack(x, T, K, xb);
}
/* rows [0, N) of w at T tokens: x the raw [1, K] at one token (`ferry_gemv_bf16_bx`), else packed (`bx_pack`); amx:
   the AMX kernel at more than one token */
static void bx_any(const uint16_t* x, int T, int K, const uint16_t* w, int64_t ldw, int N, float* out, int64_t ldo,
                   int pf, int amx) {
    if (T == 1) {
        ferry_gemv_bf16_bx(x, K, w, ldw, N, out, pf);
        return;
    }
#ifndef FERRY_NO_AMX
    if (amx) {
        amx_rows(x, T, K, w, ldw, N, out, ldo);
        return;
    }
#endif
#define BXT_CALL(t) bxt_rows(x, t, BXT_S(t), K, w, ldw, N, out, ldo, pf)
    SWITCH_T(BXT_CALL)
}
/* out[t * ldo + n] = sum_k x[t * K + k] * w[n * ldw + k] at 1..16 tokens (one token: `ferry_gemv_bf16_bx` is the
   faster), x [T, K] bf16 contiguous; K a multiple of 32; pf: rows ahead to prefetch (0: none) */
int ferry_gemv_bf16_bxt(const uint16_t* x, int T, int K, const uint16_t* w, int64_t ldw, int N, float* out,
                        int64_t ldo, int pf) {
    if (T < 1 || T > MAXT || K % 32 || pf < 0) return -1;
    uint16_t* xb = aligned_alloc(64, (size_t)T * K * 2);
    if (!xb) return -3;
    bxt_pack(x, T, K, xb);
#define BXT_CALL1(t) bxt_rows(xb, t, BXT_S(t), K, w, ldw, N, out, ldo, pf)
    SWITCH_T(BXT_CALL1)
    free(xb);
    return 0;
}
typedef struct {
    const uint16_t* x; int T, K; const uint16_t* w; int64_t ldw; float* out; int64_t ldo; int pf, amx;
} bx_args;
static void bx_task(const void* p, int a, int c) {
    const bx_args* b = (const bx_args*)p;
    bx_any(b->x, b->T, b->K, b->w + (int64_t)a * b->ldw, b->ldw, c, b->out + a, b->ldo, b->pf, b->amx);
}
/* `ferry_gemv_bf16_bx` (T = 1) / `ferry_gemv_bf16_bxt` (T > 1; amx: the AMX kernel) over rows [0, N) on `threads`
   threads of the pool, chunks of `chunk` rows (x packed once, by the calling thread) */
int ferry_gemv_bf16_bx_mt(const uint16_t* x, int T, int K, const uint16_t* w, int64_t ldw, int N, float* out,
                          int64_t ldo, int pf, int threads, int chunk, int amx) {
    if (T < 1 || T > (amx ? AMX_MAXT : MAXT) || K % 32 || pf < 0 || threads < 1 || chunk < 1) return -1;
#ifdef FERRY_NO_AMX
    if (amx) return -2;
#endif
    uint16_t* xb = NULL;
    if (T > 1) {
        if (!(xb = aligned_alloc(64, (size_t)T * K * 2))) return -3;
        bx_pack(x, T, K, xb, amx);
    }
    bx_args b = {T > 1 ? xb : x, T, K, w, ldw, out, ldo, pf, amx};
    par_rows(bx_task, &b, N, threads, chunk);
    free(xb);
    return 0;
}

/* fp32 -> bf16, round to nearest even (as torch converts; inputs here are finite or inf) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) return (uint16_t)((u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}
static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16 bits (low 16 of each lane), rounded to nearest even as `to_bf16` (and torch) round, NaN kept quiet;
   not `vcvtneps2bf16`, which flushes denormals */
static inline __m512i bf16_bits(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}
static inline __m512 bf16_round(__m512 f) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(f), 16)); }
/* e^x on 16 lanes: x = n ln2 + r (Cody-Waite), e^r by Cephes' expf polynomial, times 2^n (`vscalefps`: inf above
   ~88.7, gradual underflow below ~-87.3); within ~1 ulp of libm's expf, so the SiLU rounded to bf16 equals the
   scalar one but for a rare tie (tests/test_host_native.py) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(100.0f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* A whole SiLU expert on bf16 activations, y = w2 @ (silu(gate x) * up x), as `layers/cpu_experts.HostExpert`
   computes it on torch's bf16 tensors: gate and up rounded to bf16, silu in fp32 rounded to bf16, the product
   rounded to bf16, then the down GEMV. Two passes over the pool (the down rows need all of h): the first takes h's
   columns j in chunks (gate row j and up row I + j both), the second w2's rows. No torch op runs in between:
   one after another on the calling thread they leave its OpenMP team spinning for a while, and those spinners
   take cores from this pool's workers (2-core box, 2 tokens: 9.5 ms a Mixtral w13 against 5.1 without). */
#define EXPERT_SUB 128  /* gate / up rows a step within a chunk (their fp32 results on the stack) */
typedef struct {
    const uint16_t* x; int T, H, I; const uint16_t* w13; int64_t ld13, up; const uint16_t* w2; int64_t ld2;
    uint16_t* h; float* y32; uint16_t* y16; int pf, amx;
    uint16_t* hb;  /* `ferry_experts_silu_bf16`: h packed for the down pass (T > 1) */
} expert_args;
/* h[t, j] = bf16(bf16(silu(bf16(g[t, j]))) * bf16(u[t, j])) for m columns (g, u rows of EXPERT_SUB), h row stride I */
static inline void silu_mul(const float* g, const float* u, int T, int m, uint16_t* h, int I) {
    for (int t = 0; t < T; t++)
        for (int j = 0; j < m; j += 16) {
            const __mmask16 k = m - j < 16 ? (__mmask16)((1u << (m - j)) - 1) : (__mmask16)0xFFFF;
            const __m512 gb = bf16_round(_mm512_maskz_loadu_ps(k, g + t * EXPERT_SUB + j));
            const __m512 one = _mm512_set1_ps(1.0f);
            const __m512 den = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gb)));
            const __m512 sb = bf16_round(_mm512_div_ps(gb, den));
            const __m512 ub = bf16_round(_mm512_maskz_loadu_ps(k, u + t * EXPERT_SUB + j));
            _mm512_mask_cvtepi32_storeu_epi16(h + (int64_t)t * I + j, k, bf16_bits(_mm512_mul_ps(sb, ub)));
        }
}
static void expert_up_task(const void* p, int a, int c) {
    const expert_args* e = (const expert_args*)p;
    float g[XMAXT * EXPERT_SUB], u[XMAXT * EXPERT_SUB];
    for (int j0 = a; j0 < a + c; j0 += EXPERT_SUB) {
        const int m = a + c - j0 < EXPERT_SUB ? a + c - j0 : EXPERT_SUB;
        bx_any(e->x, e->T, e->H, e->w13 + (int64_t)j0 * e->ld13, e->ld13, m, g, EXPERT_SUB, e->pf, e->amx);
        bx_any(e->x, e->T, e->H, e->w13 + (e->up + j0) * e->ld13, e->ld13, m, u, EXPERT_SUB, e->pf, e->amx);
        silu_mul(g, u, e->T, m, e->h + j0, e->I);
    }
}
static void expert_down_task(const void* p, int a, int c) {
    const expert_args* e = (const expert_args*)p;
    if (e->y16) {  /* bf16 out: each row's fp32 sums rounded once */
        float y[XMAXT * EXPERT_SUB];
        for (int n0 = a; n0 < a + c; n0 += EXPERT_SUB) {
            const int m = a + c - n0 < EXPERT_SUB ? a + c - n0 : EXPERT_SUB;
            bx_any(e->h, e->T, e->I, e->w2 + (int64_t)n0 * e->ld2, e->ld2, m, y, EXPERT_SUB, e->pf, e->amx);
            for (int t = 0; t < e->T; t++)
                for (int j = 0; j < m; j++) e->y16[(int64_t)t * e->H + n0 + j] = to_bf16(y[t * EXPERT_SUB + j]);
        }
    } else {
        bx_any(e->h, e->T, e->I, e->w2 + (int64_t)a * e->ld2, e->ld2, c, e->y32 + a, e->H, e->pf, e->amx);
    }
}
/* x [T, H] bf16 contiguous, w13 [2I, H] (row stride ld13; gate row j at w13 + j * ld13, up row j at
   w13 + (up + j) * ld13: up = I for a whole expert, the full intermediate for a window of its columns), w2 [H, I]
   (row stride ld2), H and I multiples of 32;
   out [T, H] contiguous, bf16 (out_bf16) or fp32; pf1 / pfm: rows ahead prefetched at one token / more; the first
   pass on threads13 threads, chunk13 columns of h a chunk, the second on threads2, chunk2 rows of w2 a chunk; amx:
   the AMX kernel at more than one token. Returns 0, -1 on bad arguments, -2 without the AMX kernel, -3 without
   memory. */
int ferry_expert_silu_bf16(const uint16_t* x, int T, int H, int I, const uint16_t* w13, int64_t ld13, int64_t up,
                           const uint16_t* w2, int64_t ld2, void* out, int out_bf16, int pf1, int pfm, int threads13,
                           int chunk13, int threads2, int chunk2, int amx) {
    if (T < 1 || T > (amx ? AMX_MAXT : MAXT) || H % 32 || I % 32 || pf1 < 0 || pfm < 0 || threads13 < 1 || chunk13 < 1
        || threads2 < 1 || chunk2 < 1 || up < I)
        return -1;
#ifdef FERRY_NO_AMX
    if (amx) return -2;
#endif
    const size_t xbytes = (size_t)T * H * 2, hbytes = (size_t)T * I * 2;
    uint16_t* buf = aligned_alloc(64, (xbytes + 2 * hbytes + 63) / 64 * 64);
    if (!buf) return -3;
    uint16_t *xb = buf, *h = buf + (size_t)T * H, *hb = h + (size_t)T * I;
    if (T > 1) bx_pack(x, T, H, xb, amx);
    expert_args e = {T > 1 ? xb : x, T, H, I, w13, ld13, up, w2, ld2, h, out_bf16 ? NULL : (float*)out,
                     out_bf16 ? (uint16_t*)out : NULL, T > 1 ? pfm : pf1, amx};
    par_rows(expert_up_task, &e, I, threads13, chunk13);
    if (T > 1) {
        bx_pack(h, T, I, hb, amx);
        e.h = hb;
    }
    par_rows(expert_down_task, &e, H, threads2, chunk2);
    free(buf);
    return 0;
}

/* one pass over n experts' rows as one range [0, n * rows): expert i's rows [j, j + r) are `task`'s on the i-th of
   `args` (an array of n structs of `size` bytes); a chunk may span the end of one expert's rows and the next's */
typedef struct { int rows; const char* args; size_t size; ferry_task task; } multi_args;
static void multi_task(const void* p, int a, int c) {
    const multi_args* m = (const multi_args*)p;
    while (c > 0) {
        const int i = a / m->rows, j = a - i * m->rows, r = m->rows - j < c ? m->rows - j : c;
        m->task(m->args + (size_t)i * m->size, j, r);
        a += r;
        c -= r;
    }
}
static void par_experts(ferry_task task, const void* args, size_t size, int n, int rows, int threads, int chunk) {
    multi_args m = {rows, (const char*)args, size, task};
    par_rows(multi_task, &m, n * rows, threads, chunk);
}
/* Several SiLU experts of one bank in one call (a layer's host experts at a step): expert i at its own T[i] tokens,
   x[i] [T[i], H] bf16 contiguous, its weights at w13[i] / w2[i] (the same H, I, row strides and `up` for all, as
   `ferry_expert_silu_bf16` reads one), out[i] [T[i], H]; amx[i]: expert i on the AMX kernel. Each pass over the pool
   takes all the experts' rows as one range (expert i's h columns at [i I, (i + 1) I), its w2 rows at [i H, (i + 1) H)),
   so a chunk never waits for another expert's pass and the pool is woken twice a call, not twice an expert: with
   many small experts (Qwen3-30B-A3B's are 9.4 MB in bf16) two wake-ups an expert cost more than reading it. Each
   expert's bits are `ferry_expert_silu_bf16`'s (the same kernels on the same rows; the chunking moves no sum). */
int ferry_experts_silu_bf16(int n, const uint16_t* const* x, const int* T, int H, int I, const uint16_t* const* w13,
                            int64_t ld13, int64_t up, const uint16_t* const* w2, int64_t ld2, void* const* out,
                            int out_bf16, int pf1, int pfm, int threads13, int chunk13, int threads2, int chunk2,
                            const int* amx) {
    if (n < 1 || H % 32 || I % 32 || pf1 < 0 || pfm < 0 || threads13 < 1 || chunk13 < 1 || threads2 < 1 || chunk2 < 1
        || up < I || (int64_t)n * (H > I ? H : I) > 0x3FFFFFFF)  /* (par_rows' counter passes n by its chunks) */
        return -1;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (T[i] < 1 || T[i] > (amx[i] ? AMX_MAXT : MAXT)) return -1;
#ifdef FERRY_NO_AMX
        if (amx[i]) return -2;
#endif
        total += ((size_t)T[i] * (H + 2 * I) * 2 + 63) / 64 * 64;
    }
    expert_args* e = malloc(sizeof(expert_args) * n);
    uint16_t* buf = aligned_alloc(64, total);
    if (!e || !buf) {
        free(e);
        free(buf);
        return -3;
    }
    uint16_t* at = buf;
    for (int i = 0; i < n; i++) {
        uint16_t *xb = at, *h = xb + (size_t)T[i] * H, *hb = h + (size_t)T[i] * I;
        at += ((size_t)T[i] * (H + 2 * I) * 2 + 63) / 64 * 32;
        if (T[i] > 1) bx_pack(x[i], T[i], H, xb, amx[i]);
        e[i] = (expert_args){T[i] > 1 ? xb : x[i], T[i], H, I, w13[i], ld13, up, w2[i], ld2, h,
                             out_bf16 ? NULL : (float*)out[i], out_bf16 ? (uint16_t*)out[i] : NULL,
                             T[i] > 1 ? pfm : pf1, amx[i], hb};
    }
    par_experts(expert_up_task, e, sizeof *e, n, I, threads13, chunk13);
    for (int i = 0; i < n; i++)
        if (T[i] > 1) {
            bx_pack(e[i].h, T[i], I, e[i].hb, amx[i]);
            e[i].h = e[i].hb;
        }
    par_experts(expert_down_task, e, sizeof *e, n, H, threads2, chunk2);
    free(buf);
    free(e);
    return 0;
}

/* The same SiLU expert over fp8 weights (each side as `gemv_fp8` reads it: codes, fp32 scales of g columns, gstep 0
   for one a row), rounded where `HostExpert` rounds its two fp8 GEMVs and torch's ops between; on AMX tiles
   (`fp8_amx_rows`, x and h packed once) or the AVX512-BF16 kernel. T <= MAXT. */
typedef struct {
    const uint16_t* x; int T, H, I; const uint8_t* q13; int64_t ld13, up; const float* s13; int64_t lds13;
    int g13, gs13; const uint8_t* q2; int64_t ld2; const float* s2; int64_t lds2; int g2, gs2;
    const uint16_t* subtab; uint16_t* h; float* y32; uint16_t* y16; int amx;
} fp8_expert_args;
/* fp8 rows [0, N) on AMX tiles (x packed by `amx_pack`) or the AVX512-BF16 kernel (x as it is); 0, or the refusal */
static int fp8_any(const uint16_t* x, int T, int K, const uint8_t* q, int64_t ldq, const float* s, int64_t lds,
                   int g, int gstep, const uint16_t* subtab, int N, float* out, int64_t ldo, int amx) {
#ifndef FERRY_NO_AMX
    if (amx) {
        fp8_amx_rows(x, T, K, q, ldq, s, lds, g, gstep, _mm512_loadu_si512((const void*)subtab), N, out, ldo);
        return 0;
    }
#endif
    return ferry_gemv_fp8(x, T, K, q, ldq, s, lds, g, gstep, subtab, N, out, ldo);
}
static void fp8_expert_up_task(const void* p, int a, int c) {
    const fp8_expert_args* e = (const fp8_expert_args*)p;
    float g[MAXT * EXPERT_SUB], u[MAXT * EXPERT_SUB];
    for (int j0 = a; j0 < a + c; j0 += EXPERT_SUB) {
        const int m = a + c - j0 < EXPERT_SUB ? a + c - j0 : EXPERT_SUB;
        fp8_any(e->x, e->T, e->H, e->q13 + (int64_t)j0 * e->ld13, e->ld13, e->s13 + (int64_t)j0 * e->lds13, e->lds13,
                e->g13, e->gs13, e->subtab, m, g, EXPERT_SUB, e->amx);
        fp8_any(e->x, e->T, e->H, e->q13 + (e->up + j0) * e->ld13, e->ld13, e->s13 + (e->up + j0) * e->lds13,
                e->lds13, e->g13, e->gs13, e->subtab, m, u, EXPERT_SUB, e->amx);
        silu_mul(g, u, e->T, m, e->h + j0, e->I);
    }
}
static void fp8_expert_down_task(const void* p, int a, int c) {
    const fp8_expert_args* e = (const fp8_expert_args*)p;
    if (e->y16) {
        float y[MAXT * EXPERT_SUB];
        for (int n0 = a; n0 < a + c; n0 += EXPERT_SUB) {
            const int m = a + c - n0 < EXPERT_SUB ? a + c - n0 : EXPERT_SUB;
            fp8_any(e->h, e->T, e->I, e->q2 + (int64_t)n0 * e->ld2, e->ld2, e->s2 + (int64_t)n0 * e->lds2, e->lds2,
                    e->g2, e->gs2, e->subtab, m, y, EXPERT_SUB, e->amx);
            for (int t = 0; t < e->T; t++)
                for (int j = 0; j < m; j++) e->y16[(int64_t)t * e->H + n0 + j] = to_bf16(y[t * EXPERT_SUB + j]);
        }
    } else {
        fp8_any(e->h, e->T, e->I, e->q2 + (int64_t)a * e->ld2, e->ld2, e->s2 + (int64_t)a * e->lds2, e->lds2, e->g2,
                e->gs2, e->subtab, c, e->y32 + a, e->H, e->amx);
    }
}
/* x [T, H] bf16 contiguous; gate rows j of w13 at q13 + j * ld13 (scales s13 + j * lds13), up rows at up + j; w2
   [H, I] (q2, ld2, s2, lds2); g / gs: each side's scale group along K and gstep (`fp8_group`); H, I, g multiples of
   32; out [T, H] bf16 (out_bf16) or fp32. Returns 0, -1 on bad arguments, -2 without the AMX kernel, -3 without
   memory. */
int ferry_expert_silu_fp8(const uint16_t* x, int T, int H, int I, const uint8_t* q13, int64_t ld13, int64_t up,
                          const float* s13, int64_t lds13, int g13, int gs13, const uint8_t* q2, int64_t ld2,
                          const float* s2, int64_t lds2, int g2, int gs2, const uint16_t* subtab32, void* out,
                          int out_bf16, int threads13, int chunk13, int threads2, int chunk2, int amx) {
    if (T < 1 || T > MAXT || H % 32 || I % 32 || g13 < 32 || g2 < 32 || g13 % 32 || g2 % 32 || H % g13 || I % g2
        || (gs13 != 0 && gs13 != 1) || (gs2 != 0 && gs2 != 1) || threads13 < 1 || chunk13 < 1 || threads2 < 1
        || chunk2 < 1 || up < I)
        return -1;
#ifdef FERRY_NO_AMX
    if (amx) return -2;
#else
    if (amx && (g13 > FP8_AMX_G || g2 > FP8_AMX_G)) return -1;
#endif
    const size_t xbytes = (size_t)T * H * 2, hbytes = (size_t)T * I * 2;
    uint16_t* buf = aligned_alloc(64, (xbytes + 2 * hbytes + 63) / 64 * 64);
    if (!buf) return -3;
    uint16_t *xb = buf, *h = buf + (size_t)T * H, *hb = h + (size_t)T * I;
#ifndef FERRY_NO_AMX
    if (amx) amx_pack(x, T, H, xb);
#endif
    fp8_expert_args e = {amx ? xb : x, T, H, I, q13, ld13, up, s13, lds13, g13, gs13, q2, ld2, s2, lds2, g2, gs2,
                         subtab32, h, out_bf16 ? NULL : (float*)out, out_bf16 ? (uint16_t*)out : NULL, amx};
    par_rows(fp8_expert_up_task, &e, I, threads13, chunk13);
#ifndef FERRY_NO_AMX
    if (amx) {
        amx_pack(h, T, I, hb);
        e.h = hb;
    }
#endif
    par_rows(fp8_expert_down_task, &e, H, threads2, chunk2);
    free(buf);
    return 0;
}
/* `ferry_expert_silu_fp8` for several experts of one bank in one call, as `ferry_experts_silu_bf16` is for bf16 ones:
   expert i at T[i] tokens (x[i] [T[i], H] bf16), its codes and scales at q13[i], s13[i], q2[i], s2[i] (the same
   shapes, strides and groups for all), out[i] [T[i], H]; amx[i]: expert i on AMX tiles. Each expert's bits are its own
   call's. */
int ferry_experts_silu_fp8(int n, const uint16_t* const* x, const int* T, int H, int I, const uint8_t* const* q13,
                           int64_t ld13, int64_t up, const float* const* s13, int64_t lds13, int g13, int gs13,
                           const uint8_t* const* q2, int64_t ld2, const float* const* s2, int64_t lds2, int g2, int gs2,
                           const uint16_t* subtab32, void* const* out, int out_bf16, int threads13, int chunk13,
                           int threads2, int chunk2, const int* amx) {
    if (n < 1 || H % 32 || I % 32 || g13 < 32 || g2 < 32 || g13 % 32 || g2 % 32 || H % g13 || I % g2
        || (gs13 != 0 && gs13 != 1) || (gs2 != 0 && gs2 != 1) || threads13 < 1 || chunk13 < 1 || threads2 < 1
        || chunk2 < 1 || up < I || (int64_t)n * (H > I ? H : I) > 0x3FFFFFFF)
        return -1;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (T[i] < 1 || T[i] > MAXT) return -1;
#ifdef FERRY_NO_AMX
        if (amx[i]) return -2;
#else
        if (amx[i] && (g13 > FP8_AMX_G || g2 > FP8_AMX_G)) return -1;
#endif
        total += ((size_t)T[i] * (H + 2 * I) * 2 + 63) / 64 * 64;
    }
    fp8_expert_args* e = malloc(sizeof(fp8_expert_args) * n);
    uint16_t* buf = aligned_alloc(64, total);
    if (!e || !buf) {
        free(e);
        free(buf);
        return -3;
    }
    uint16_t* at = buf;
    for (int i = 0; i < n; i++) {
        uint16_t *xb = at, *h = xb + (size_t)T[i] * H;
        at += ((size_t)T[i] * (H + 2 * I) * 2 + 63) / 64 * 32;
#ifndef FERRY_NO_AMX
        if (amx[i]) amx_pack(x[i], T[i], H, xb);
#endif
        e[i] = (fp8_expert_args){amx[i] ? xb : x[i], T[i], H, I, q13[i], ld13, up, s13[i], lds13, g13, gs13, q2[i], ld2,
                                 s2[i], lds2, g2, gs2, subtab32, h, out_bf16 ? NULL : (float*)out[i],
                                 out_bf16 ? (uint16_t*)out[i] : NULL, amx[i]};
    }
    par_experts(fp8_expert_up_task, e, sizeof *e, n, I, threads13, chunk13);
#ifndef FERRY_NO_AMX
    for (int i = 0; i < n; i++)
        if (amx[i]) {
            uint16_t* hb = e[i].h + (size_t)T[i] * I;
            amx_pack(e[i].h, T[i], I, hb);
            e[i].h = hb;
        }
#endif
    par_experts(fp8_expert_down_task, e, sizeof *e, n, H, threads2, chunk2);
    free(buf);
    free(e);
    return 0;
}
/* The SiLU expert over NF4 weights (`ferry_gemv_nf4_bf16`'s rows: codes two a byte, an fp32 absmax a group of g
   columns), as `ferry_expert_silu_fp8` is over fp8: x [T, H] bf16 in the kernel's layout (per 64 columns the 32 even
   then the 32 odd, `nf4_x`); h is made in order (`silu_mul`), then laid out so for the down GEMV. */
typedef struct {
    const uint16_t* x; int T, H, I; const uint8_t* q13; int64_t ld13, up; const float* a13; int64_t lds13; int g13;
    const uint8_t* q2; int64_t ld2; const float* a2; int64_t lds2; int g2;
    const uint16_t* levels; uint16_t* h; float* y32; uint16_t* y16;
} nf4_expert_args;
static void nf4_expert_up_task(const void* p, int a, int c) {
    const nf4_expert_args* e = (const nf4_expert_args*)p;
    float g[MAXT * EXPERT_SUB], u[MAXT * EXPERT_SUB];
    for (int j0 = a; j0 < a + c; j0 += EXPERT_SUB) {
        const int m = a + c - j0 < EXPERT_SUB ? a + c - j0 : EXPERT_SUB;
        ferry_gemv_nf4_bf16(e->x, e->T, e->H, e->q13 + (int64_t)j0 * e->ld13, e->ld13, e->a13 + (int64_t)j0 * e->lds13,
                            e->lds13, e->g13, e->levels, m, g, EXPERT_SUB);
        ferry_gemv_nf4_bf16(e->x, e->T, e->H, e->q13 + (e->up + j0) * e->ld13, e->ld13,
                            e->a13 + (e->up + j0) * e->lds13, e->lds13, e->g13, e->levels, m, u, EXPERT_SUB);
        silu_mul(g, u, e->T, m, e->h + j0, e->I);
    }
}
static void nf4_expert_down_task(const void* p, int a, int c) {
    const nf4_expert_args* e = (const nf4_expert_args*)p;
    float y[MAXT * EXPERT_SUB];
    for (int n0 = a; n0 < a + c; n0 += EXPERT_SUB) {
        const int m = a + c - n0 < EXPERT_SUB ? a + c - n0 : EXPERT_SUB;
        ferry_gemv_nf4_bf16(e->h, e->T, e->I, e->q2 + (int64_t)n0 * e->ld2, e->ld2, e->a2 + (int64_t)n0 * e->lds2,
                            e->lds2, e->g2, e->levels, m, y, EXPERT_SUB);
        for (int t = 0; t < e->T; t++)
            for (int j = 0; j < m; j++) {
                const float v = y[t * EXPERT_SUB + j];
                if (e->y16) e->y16[(int64_t)t * e->H + n0 + j] = to_bf16(v);
                else e->y32[(int64_t)t * e->H + n0 + j] = v;
            }
    }
}
/* h [T, I] in the NF4 kernel's layout for the down GEMV: per 64 columns the 32 even, then the 32 odd */
static void nf4_h_layout(const uint16_t* h, int T, int I, uint16_t* hl) {
    for (int t = 0; t < T; t++)
        for (int b = 0; b < I; b += 64)
            for (int i = 0; i < 32; i++) {
                hl[(int64_t)t * I + b + i] = h[(int64_t)t * I + b + 2 * i];
                hl[(int64_t)t * I + b + 32 + i] = h[(int64_t)t * I + b + 2 * i + 1];
            }
}
/* x [T, H] bf16 in `nf4_x`'s layout; gate rows j of w13 at q13 + j * ld13 (absmax a13 + j * lds13), up rows at
   up + j; w2 [H, I] codes q2 (ld2 bytes a row), absmax a2 (lds2); g13, g2: each side's group (multiples of 64,
   dividing H and I); I a multiple of 64; out [T, H] bf16 (out_bf16) or fp32. 0, -1 on bad arguments, -3 without
   memory. */
int ferry_expert_silu_nf4(const uint16_t* x, int T, int H, int I, const uint8_t* q13, int64_t ld13, int64_t up,
                          const float* a13, int64_t lds13, int g13, const uint8_t* q2, int64_t ld2, const float* a2,
                          int64_t lds2, int g2, const uint16_t* levels32, void* out, int out_bf16, int threads13,
                          int chunk13, int threads2, int chunk2) {
    if (T < 1 || T > MAXT || H % 64 || I % 64 || g13 < 64 || g2 < 64 || g13 % 64 || g2 % 64 || H % g13 || I % g2
        || threads13 < 1 || chunk13 < 1 || threads2 < 1 || chunk2 < 1 || up < I)
        return -1;
    const size_t hn = (size_t)T * I;
    uint16_t* h = aligned_alloc(64, (2 * hn * 2 + 63) / 64 * 64);
    if (!h) return -3;
    uint16_t* hl = h + hn;
    nf4_expert_args e = {x, T, H, I, q13, ld13, up, a13, lds13, g13, q2, ld2, a2, lds2, g2, levels32, h,
                         out_bf16 ? NULL : (float*)out, out_bf16 ? (uint16_t*)out : NULL};
    par_rows(nf4_expert_up_task, &e, I, threads13, chunk13);
    nf4_h_layout(h, T, I, hl);
    e.h = hl;
    par_rows(nf4_expert_down_task, &e, H, threads2, chunk2);
    free(h);
    return 0;
}
/* `ferry_expert_silu_nf4` for several experts of one bank in one call, as `ferry_experts_silu_bf16` is for bf16 ones:
   expert i at T[i] tokens (x[i] in `nf4_x`'s layout), its codes and absmax at q13[i], a13[i], q2[i], a2[i] (the same
   shapes, strides and groups for all), out[i] [T[i], H]; each expert's bits are its own call's. */
int ferry_experts_silu_nf4(int n, const uint16_t* const* x, const int* T, int H, int I, const uint8_t* const* q13,
                           int64_t ld13, int64_t up, const float* const* a13, int64_t lds13, int g13,
                           const uint8_t* const* q2, int64_t ld2, const float* const* a2, int64_t lds2, int g2,
                           const uint16_t* levels32, void* const* out, int out_bf16, int threads13, int chunk13,
                           int threads2, int chunk2) {
    if (n < 1 || H % 64 || I % 64 || g13 < 64 || g2 < 64 || g13 % 64 || g2 % 64 || H % g13 || I % g2
        || threads13 < 1 || chunk13 < 1 || threads2 < 1 || chunk2 < 1 || up < I
        || (int64_t)n * (H > I ? H : I) > 0x3FFFFFFF)
        return -1;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (T[i] < 1 || T[i] > MAXT) return -1;
        total += ((size_t)T[i] * I * 4 + 63) / 64 * 64;
    }
    nf4_expert_args* e = malloc(sizeof(nf4_expert_args) * n);
    uint16_t* buf = aligned_alloc(64, total);
    if (!e || !buf) {
        free(e);
        free(buf);
        return -3;
    }
    uint16_t* at = buf;
    for (int i = 0; i < n; i++) {
        e[i] = (nf4_expert_args){x[i], T[i], H, I, q13[i], ld13, up, a13[i], lds13, g13, q2[i], ld2, a2[i], lds2, g2,
                                 levels32, at, out_bf16 ? NULL : (float*)out[i], out_bf16 ? (uint16_t*)out[i] : NULL};
        at += ((size_t)T[i] * I * 4 + 63) / 64 * 32;
    }
    par_experts(nf4_expert_up_task, e, sizeof *e, n, I, threads13, chunk13);
    for (int i = 0; i < n; i++) {
        uint16_t* hl = e[i].h + (size_t)T[i] * I;
        nf4_h_layout(e[i].h, T[i], I, hl);
        e[i].h = hl;
    }
    par_experts(nf4_expert_down_task, e, sizeof *e, n, H, threads2, chunk2);
    free(buf);
    free(e);
    return 0;
}
#pragma GCC pop_options
int ferry_has_bf16(void) { return 1; }
#else
int ferry_has_bf16(void) { return 0; }
int ferry_has_amx(void) { return 0; }
int ferry_amx_init(void) { return -1; }
#endif

typedef struct {
    int bf16, T, K, g, N;
    const void* x; const uint8_t* q; int64_t ldq; const float* absmax; int64_t lds; const void* levels;
    float* out; int64_t ldo;
    atomic_int rc;
} nf4_args;
static void nf4_task(const void* p, int a, int c) {
    nf4_args* n = (nf4_args*)p;
    int rc;
#ifndef FERRY_NO_BF16
    if (n->bf16)
        rc = ferry_gemv_nf4_bf16((const uint16_t*)n->x, n->T, n->K, n->q + (int64_t)a * n->ldq, n->ldq,
                                 n->absmax + (int64_t)a * n->lds, n->lds, n->g, (const uint16_t*)n->levels, c,
                                 n->out + a, n->ldo);
    else
#endif
        rc = ferry_gemv_nf4((const float*)n->x, n->T, n->K, n->q + (int64_t)a * n->ldq, n->ldq,
                            n->absmax + (int64_t)a * n->lds, n->lds, n->g, (const float*)n->levels, c, n->out + a,
                            n->ldo);
    if (rc) atomic_store(&n->rc, rc);  /* every chunk sees the same arguments: any one's refusal is all of them */
}
typedef struct {
    int T, K, g, gstep, N, amx;
    const uint16_t* x; const uint8_t* q; int64_t ldq; const float* scale; int64_t lds; const uint16_t* subtab;
    float* out; int64_t ldo;
    atomic_int rc;
} fp8_args;
static void fp8_task(const void* p, int a, int c) {
#ifndef FERRY_NO_BF16
    fp8_args* f = (fp8_args*)p;
    int rc = fp8_any(f->x, f->T, f->K, f->q + (int64_t)a * f->ldq, f->ldq, f->scale + (int64_t)a * f->lds, f->lds,
                     f->g, f->gstep, f->subtab, c, f->out + a, f->ldo, f->amx);
    if (rc) atomic_store(&f->rc, rc);
#endif
}
/* `ferry_gemv_fp8` (amx: `fp8_amx_rows`, x packed once by the calling thread) over rows [0, N) on `threads` threads
   of the pool, chunks of `chunk` rows */
int ferry_gemv_fp8_mt(const uint16_t* x, int T, int K, const uint8_t* q, int64_t ldq, const float* scale, int64_t lds,
                      int g, int gstep, const uint16_t* subtab32, int N, float* out, int64_t ldo, int threads,
                      int chunk, int amx) {
#ifdef FERRY_NO_BF16
    return -2;
#endif
#ifdef FERRY_NO_AMX
    if (amx) return -2;
#endif
    if (threads < 1 || chunk < 1 || T < 1 || T > MAXT || g < 32 || K % g || g % 32 || (gstep != 0 && gstep != 1))
        return -1;
    uint16_t* xv = NULL;
#ifndef FERRY_NO_AMX
    if (amx) {
        if (g > FP8_AMX_G) return -1;
        if (!(xv = aligned_alloc(64, (size_t)T * K * 2))) return -3;
        amx_pack(x, T, K, xv);
    }
#endif
    fp8_args f = {T, K, g, gstep, N, amx, xv ? xv : x, q, ldq, scale, lds, subtab32, out, ldo};
    atomic_init(&f.rc, 0);
    par_rows(fp8_task, &f, N, threads, chunk);
    free(xv);
    return atomic_load(&f.rc);
}
/* `ferry_gemv_nf4` (bf16: `ferry_gemv_nf4_bf16`) over rows [0, N) on `threads` threads of the pool, chunks of
   `chunk` rows */
int ferry_gemv_nf4_mt(int bf16, const void* x, int T, int K, const uint8_t* q, int64_t ldq, const float* absmax,
                      int64_t lds, int g, const void* levels, int N, float* out, int64_t ldo, int threads, int chunk) {
#ifdef FERRY_NO_BF16
    if (bf16) return -2;
#endif
    if (threads < 1 || chunk < 1) return -1;
    nf4_args n = {bf16, T, K, g, N, x, q, ldq, absmax, lds, levels, out, ldo};
    atomic_init(&n.rc, 0);
    par_rows(nf4_task, &n, N, threads, chunk);
    return atomic_load(&n.rc);
}
"""
FLAGS = ("-O3", "-mavx512f", "-shared", "-fPIC", "-fno-math-errno", "-pthread")
LIBS = ("-lm",)
MAX_TOKENS = 16
"""Most tokens a call takes (the kernels keep one accumulator register per token)."""
MAX_TOKENS_AMX = 64
"""Most tokens a bf16 call on the AMX kernel takes (`amx=True`: tokens in blocks of 16, the rows re-read from L2)."""

_lib = None
_why: str | None = None
_bf16 = False  # the AVX512-BF16 NF4 kernel is built and this CPU runs it
_amx = False  # the AMX kernel is built, this CPU has it and the OS lets this process use it
_lock = threading.Lock()


def _cache_dir() -> str:
    # (offload/calibration.cache_dir's folder; not imported from there: layers sit below offload)
    return os.path.join(os.environ.get("FERRYLM_CACHE_DIR") or os.path.expanduser("~/.cache/ferrylm"), "kernels")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def _cpu_has_avx512f() -> bool:
    return "avx512f" in _cpu_flags()


def _build(path: str) -> str | None:
    """Compile SOURCE into `path` (temp-then-rename); the AMX kernel, then the AVX512-BF16 ones, left out where the
    compiler does not take their targets. Returns why it failed, or None."""
    os.makedirs(_cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        src, out = os.path.join(tmp, "host_gemv.c"), os.path.join(tmp, "host_gemv.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        cc = os.environ.get("CC", "cc")
        for extra in ((), ("-DFERRY_NO_AMX",), ("-DFERRY_NO_BF16",)):
            r = subprocess.run([cc, *FLAGS, *extra, src, *LIBS, "-o", out], capture_output=True, text=True, timeout=120)
            if not r.returncode:
                os.replace(out, path)  # temp-then-rename: never a half-written library
                return None
        return f"the C compiler failed: {r.stderr.strip()[:300]}"


def _load():
    global _lib, _why
    lib = _lib
    if lib is not None:  # every chunk of every call comes here, from every pool worker: no lock once loaded
        return lib
    with _lock:
        if _lib is not None or _why is not None:
            return _lib
        if os.environ.get("FERRYLM_NO_NATIVE"):
            _why = "FERRYLM_NO_NATIVE is set"
            return None
        if not _cpu_has_avx512f():
            _why = "the CPU has no AVX-512F"
            return None
        digest = hashlib.sha256((SOURCE + " ".join(FLAGS + LIBS)).encode()).hexdigest()[:16]
        path = os.path.join(_cache_dir(), f"host_gemv-{digest}.so")
        if not os.path.exists(path):
            try:
                _why = _build(path)
            except (OSError, subprocess.SubprocessError) as e:
                _why = f"no C compiler ran ({e})"
            if _why is not None:
                return None
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            _why = f"cannot load {path} ({e})"
            return None
        i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.ferry_gemv_bf16.argtypes = [p, i32, i32, p, i64, i32, p, i64, i32]
        lib.ferry_gemv_nf4.argtypes = [p, i32, i32, p, i64, p, i64, i32, p, i32, p, i64]
        lib.ferry_gemv_bf16.restype = lib.ferry_gemv_nf4.restype = i32
        lib.ferry_has_bf16.restype = i32
        lib.ferry_read_bf16.argtypes = [i32, p, i64, i32, p]
        lib.ferry_read_bf16.restype = i32
        lib.ferry_read_bf16_mt.argtypes = [i32, p, i64, i32, p, i32, i32]
        lib.ferry_read_bf16_mt.restype = i32
        lib.ferry_gemv_nf4_mt.argtypes = [i32, p, i32, i32, p, i64, p, i64, i32, p, i32, p, i64, i32, i32]
        lib.ferry_gemv_nf4_mt.restype = i32
        global _bf16
        _bf16 = bool(lib.ferry_has_bf16()) and {"avx512bw", "avx512_bf16"} <= _cpu_flags()
        if _bf16:
            lib.ferry_gemv_nf4_bf16.argtypes = lib.ferry_gemv_nf4.argtypes
            lib.ferry_gemv_nf4_bf16.restype = i32
            lib.ferry_expert_silu_fp8.argtypes = [p, i32, i32, i32, p, i64, i64, p, i64, i32, i32, p, i64, p, i64, i32,
                                                  i32, p, p, i32, i32, i32, i32, i32, i32]
            lib.ferry_expert_silu_fp8.restype = i32
            lib.ferry_experts_silu_fp8.argtypes = [i32, p, p, i32, i32, p, i64, i64, p, i64, i32, i32, p, i64, p, i64,
                                                   i32, i32, p, p, i32, i32, i32, i32, i32, p]
            lib.ferry_experts_silu_fp8.restype = i32
            lib.ferry_expert_silu_nf4.argtypes = [p, i32, i32, i32, p, i64, i64, p, i64, i32, p, i64, p, i64, i32, p,
                                                  p, i32, i32, i32, i32, i32]
            lib.ferry_expert_silu_nf4.restype = i32
            lib.ferry_experts_silu_nf4.argtypes = [i32, p, p, i32, i32, p, i64, i64, p, i64, i32, p, i64, p, i64, i32,
                                                   p, p, i32, i32, i32, i32, i32]
            lib.ferry_experts_silu_nf4.restype = i32
            lib.ferry_gemv_fp8.argtypes = [p, i32, i32, p, i64, p, i64, i32, i32, p, i32, p, i64]
            lib.ferry_gemv_fp8.restype = i32
            lib.ferry_gemv_fp8_mt.argtypes = [p, i32, i32, p, i64, p, i64, i32, i32, p, i32, p, i64, i32, i32, i32]
            lib.ferry_gemv_fp8_mt.restype = i32
            lib.ferry_gemv_bf16_bx.argtypes = [p, i32, p, i64, i32, p, i32]
            lib.ferry_gemv_bf16_bx.restype = i32
            lib.ferry_gemv_bf16_bxt.argtypes = [p, i32, i32, p, i64, i32, p, i64, i32]
            lib.ferry_gemv_bf16_bxt.restype = i32
            lib.ferry_gemv_bf16_bx_mt.argtypes = [p, i32, i32, p, i64, i32, p, i64, i32, i32, i32, i32]
            lib.ferry_expert_silu_bf16.argtypes = [p, i32, i32, i32, p, i64, i64, p, i64, p, i32, i32, i32, i32, i32,
                                                   i32, i32, i32]
            lib.ferry_expert_silu_bf16.restype = i32
            lib.ferry_experts_silu_bf16.argtypes = [i32, p, p, i32, i32, p, i64, i64, p, i64, p, i32, i32, i32, i32,
                                                    i32, i32, i32, p]
            lib.ferry_experts_silu_bf16.restype = i32
            lib.ferry_gemv_bf16_bx_mt.restype = i32
        global _amx
        _amx = _bf16 and bool(lib.ferry_has_amx()) and {"amx_tile", "amx_bf16"} <= _cpu_flags()
        if _amx and lib.ferry_amx_init() != 0:  # the kernel refuses the process its tile registers
            log.info("native host kernels: the CPU has AMX but the kernel does not grant it; AVX-512 only")
            _amx = False
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


def gemv_bf16(x32: torch.Tensor, w: torch.Tensor, out: torch.Tensor, prefetch: int = 0) -> torch.Tensor:
    """out [T, N] fp32 (a view with unit column stride) = x32 [T, K] fp32 contiguous @ w.T, w [N, K] bf16 with unit
    column stride (any row stride: a view of a bank's rows or columns); K a multiple of 16, T <= MAX_TOKENS.
    `prefetch`: at one token, software-prefetch the same columns that many rows on (0: the hardware prefetchers
    alone; which wins depends on the CPU, `layers/cpu_experts.NATIVE_PREFETCH_ROWS`)."""
    lib = _load()
    T, K = x32.shape
    N = w.shape[0]
    if w.stride(1) != 1 or out.stride(1) != 1 or not x32.is_contiguous() or w.dtype != torch.bfloat16:
        raise ValueError("native bf16 GEMV: x32 contiguous fp32, w bf16 and out with unit column stride")
    _check(lib.ferry_gemv_bf16(x32.data_ptr(), T, K, w.data_ptr(), w.stride(0), N, out.data_ptr(), out.stride(0),
                               prefetch), "bf16 GEMV")
    return out


def max_tokens(amx: bool) -> int:
    """Most tokens a bf16-x call takes: `MAX_TOKENS_AMX` on the AMX kernel, else `MAX_TOKENS`."""
    return MAX_TOKENS_AMX if amx else MAX_TOKENS


def _bx_check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, amx: bool = False) -> None:
    if not _bf16:
        raise ValueError("native bf16 GEMV with bf16 x needs the AVX512-BF16 kernel (nf4_bf16() is False)")
    T, most = x.shape[0], max_tokens(amx)
    if (x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or not 1 <= T <= most
            or w.stride(1) != 1 or w.dtype != torch.bfloat16 or x.shape[1] != w.shape[1] or out.dtype != torch.float32
            or out.dim() != 2 or out.stride(1) != 1 or tuple(out.shape) != (T, w.shape[0])):
        raise ValueError(f"native bf16 GEMV (bf16 x): x [T, K] bf16 contiguous with T <= {most}, w [N, K] bf16 "
                         "with unit column stride, out [T, N] fp32 with unit column stride")


def gemv_bf16_bx(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, prefetch: int = 0) -> torch.Tensor:
    """out [T, N] fp32 (unit column stride) = x [T, K] bf16 (contiguous, T <= MAX_TOKENS) @ w.T on the AVX512-BF16
    dot product (`nf4_bf16()` tells whether it runs here): w [N, K] bf16 with unit column stride, K a multiple of
    32. One token: four accumulators over the row, `prefetch` as `gemv_bf16`'s; more: one accumulator a token, K in
    chunks whose x stays in L1 (`prefetch` unused)."""
    lib = _load()
    _bx_check(x, w, out)
    if x.shape[0] == 1:
        _check(lib.ferry_gemv_bf16_bx(x.data_ptr(), x.shape[1], w.data_ptr(), w.stride(0), w.shape[0],
                                      out.data_ptr(), prefetch), "bf16 GEMV (bf16 x)")
    else:
        _check(lib.ferry_gemv_bf16_bxt(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.stride(0), w.shape[0],
                                       out.data_ptr(), out.stride(0), prefetch), "bf16 GEMV (bf16 x)")
    return out


def read_bf16(w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [N] fp32 = each row's elements summed as integers: the loads of `gemv_bf16` at one token without its
    arithmetic (a read ceiling for benchmarks). w [N, K] bf16 with unit column stride, K a multiple of 32."""
    lib = _load()
    if w.stride(1) != 1 or w.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError("native bf16 read: w bf16 with unit column stride, out contiguous")
    _check(lib.ferry_read_bf16(w.shape[1], w.data_ptr(), w.stride(0), w.shape[0], out.data_ptr()), "bf16 read")
    return out


def gemv_bf16_bx_mt(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, threads: int, chunk: int,
                    prefetch: int = 0, amx: bool = False) -> torch.Tensor:
    """`gemv_bf16_bx` over all of w's rows on `threads` threads of the C pool (the calling thread and
    threads - 1 workers), each taking the next `chunk` rows as it comes free: one call from Python a matrix,
    where `layers/cpu_experts.SplitRows` makes one a chunk from as many Python workers (on the H200 host's 16
    cores their row chunks read 40 GB/s against a plain read's 85, 53 against 54 on 8: the workers' turns at the
    GIL). Results bit-identical to one `gemv_bf16_bx` call (each row's sums run in the same order). `amx`: more than
    one token on the AMX kernel (`amx()` tells whether it runs here; its sums run in another order: fp32 rounding of
    the K-long dot, and the same bits whatever `threads` and `chunk`)."""
    lib = _load()
    _amx_check(amx)
    _bx_check(x, w, out, amx)
    _check(lib.ferry_gemv_bf16_bx_mt(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.stride(0), w.shape[0],
                                     out.data_ptr(), out.stride(0), prefetch, threads, chunk, int(amx)),
           "bf16 GEMV (bf16 x, threads)")
    return out


def expert_silu_bf16(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor,
                     split13: tuple[int, int], split2: tuple[int, int], prefetch: int = 0,
                     prefetch_multi: int = 0, amx: bool = False, cols: int = 0) -> torch.Tensor:
    """out [T, H] (bf16 or fp32, contiguous) = w2 @ (silu(gate x) * up x) for x [T, H] bf16 contiguous (T <=
    `max_tokens(amx)`), w13 [2I, H] (gate rows, then up rows) and w2 [H, I] bf16 with unit column strides, H and I multiples
    of 32: a whole expert in one call on the C pool (split13 = (threads, h's columns a chunk), then split2 = (threads,
    w2's rows a chunk)), rounded to bf16 where `HostExpert`'s torch ops round (the same bits as `gemv_bf16_bx`
    twice with torch's SiLU between, where libm's expf and torch's agree); `prefetch` rows ahead at one token,
    `prefetch_multi` at more (`gemv_bf16_bx`'s); `amx`: more than one token on the AMX kernel (`gemv_bf16_bx_mt`'s).
    `cols` > 0 (a multiple of 32 below I): the expert on its intermediate columns [cols, I) only (gate rows [cols, I),
    up rows [I + cols, 2I), w2's columns [cols, I)), as the hybrid split computes a miss's host part."""
    lib = _load()
    _amx_check(amx)
    T, H = x.shape
    I, most = w2.shape[1], max_tokens(amx)
    if not _bf16:
        raise ValueError("native expert: needs the AVX512-BF16 kernel (nf4_bf16() is False)")
    if (x.dtype != torch.bfloat16 or not x.is_contiguous() or not 1 <= T <= most
            or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16 or w13.stride(1) != 1 or w2.stride(1) != 1
            or tuple(w13.shape) != (2 * I, H) or w2.shape[0] != H or out.dtype not in (torch.bfloat16, torch.float32)
            or not out.is_contiguous() or tuple(out.shape) != (T, H) or cols % 32 or not 0 <= cols < I):
        raise ValueError(f"native expert: x [T, H] bf16 contiguous with T <= {most}, w13 [2I, H] and w2 [H, I] "
                         "bf16 with unit column strides, out [T, H] bf16 or fp32 contiguous, cols a multiple of 32 "
                         "below I")
    e = w2.element_size()
    _check(lib.ferry_expert_silu_bf16(x.data_ptr(), T, H, I - cols, w13.data_ptr() + cols * w13.stride(0) * e,
                                      w13.stride(0), I, w2.data_ptr() + cols * e, w2.stride(0), out.data_ptr(),
                                      int(out.dtype == torch.bfloat16), prefetch, prefetch_multi, *split13, *split2,
                                      int(amx)), "expert (SiLU, bf16)")
    return out


def experts_silu_bf16(xs: list[torch.Tensor], w13s: list[torch.Tensor], w2s: list[torch.Tensor],
                      outs: list[torch.Tensor], split13: tuple[int, int], split2: tuple[int, int], prefetch: int = 0,
                      prefetch_multi: int = 0, amx: list[bool] | None = None, cols: int = 0) -> list[torch.Tensor]:
    """`expert_silu_bf16` for several experts of one bank in one call: outs[i] = expert (w13s[i], w2s[i]) of xs[i]
    (each as `expert_silu_bf16` takes it; one H and I, one row stride a side, one `cols`, one out dtype for all;
    amx[i]: expert i on the AMX kernel, default none). Each pass of the C pool takes every expert's rows as one range
    (split13 = (threads, h columns a chunk), split2 = (threads, w2 rows a chunk), counted over all the experts), so a
    layer's host experts wake the pool twice, not twice each. The same bits as `expert_silu_bf16` expert by expert."""
    lib = _load()
    n = len(xs)
    amx = [False] * n if amx is None else list(amx)
    if not _bf16:
        raise ValueError("native experts: need the AVX512-BF16 kernel (nf4_bf16() is False)")
    if not n or not len(w13s) == len(w2s) == len(outs) == len(amx) == n:
        raise ValueError(f"native experts: {n} x, {len(w13s)} w13, {len(w2s)} w2, {len(outs)} out, {len(amx)} amx")
    if any(amx):
        _amx_check(True)
    H, I = w2s[0].shape
    ld13, ld2, odt = w13s[0].stride(0), w2s[0].stride(0), outs[0].dtype
    for x, w13, w2, out, a in zip(xs, w13s, w2s, outs, amx):
        T = x.shape[0]
        if (x.dtype != torch.bfloat16 or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != H
                or not 1 <= T <= max_tokens(a) or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16
                or tuple(w13.shape) != (2 * I, H) or tuple(w2.shape) != (H, I) or w13.stride() != (ld13, 1)
                or w2.stride() != (ld2, 1) or out.dtype != odt or odt not in (torch.bfloat16, torch.float32)
                or not out.is_contiguous() or tuple(out.shape) != (T, H)):
            raise ValueError("native experts: each x [T, H] bf16 contiguous (T <= max_tokens), w13 [2I, H] and w2 "
                             "[H, I] bf16 with the first's row strides and unit column strides, out [T, H] contiguous "
                             "in the first's dtype (bf16 or fp32)")
    if H % 32 or I % 32 or cols % 32 or not 0 <= cols < I:
        raise ValueError(f"native experts: H {H} and I {I} multiples of 32, cols {cols} a multiple of 32 below I")
    e = w2s[0].element_size()

    def ptrs(ts, offset: int = 0) -> torch.Tensor:
        return torch.tensor([t.data_ptr() + offset for t in ts], dtype=torch.int64)

    keep = (ptrs(xs), torch.tensor([x.shape[0] for x in xs], dtype=torch.int32), ptrs(w13s, cols * ld13 * e),
            ptrs(w2s, cols * e), ptrs(outs), torch.tensor(amx, dtype=torch.int32))
    _check(lib.ferry_experts_silu_bf16(n, keep[0].data_ptr(), keep[1].data_ptr(), H, I - cols, keep[2].data_ptr(),
                                       ld13, I, keep[3].data_ptr(), ld2, keep[4].data_ptr(),
                                       int(odt == torch.bfloat16), prefetch, prefetch_multi, *split13, *split2,
                                       keep[5].data_ptr()), "experts (SiLU, bf16)")
    return outs


def _fp8_expert(x: torch.Tensor, w13: tuple, w2: tuple, out: torch.Tensor, cols: int, amx: bool) -> tuple:
    """`expert_silu_fp8`'s arguments checked -> (T, H, n, the C call's weight arguments from q13 to gs2) for the window
    [cols, I) (n = I - cols columns)."""
    (q13, s13, g13), (q2, s2, g2) = w13, w2
    T, H = x.shape
    I = q2.shape[1]
    if (x.dtype != torch.bfloat16 or not x.is_contiguous() or not 1 <= T <= MAX_TOKENS
            or q13.dtype != torch.uint8 or q2.dtype != torch.uint8 or q13.stride(1) != 1 or q2.stride(1) != 1
            or tuple(q13.shape) != (2 * I, H) or q2.shape[0] != H or s13.dtype != torch.float32
            or s2.dtype != torch.float32 or s13.stride(-1) != 1 or s2.stride(-1) != 1 or H % g13 or I % g2
            or tuple(s13.shape) != (2 * I, H // g13) or tuple(s2.shape) != (H, I // g2)
            or out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous() or tuple(out.shape) != (T, H)):
        raise ValueError(f"native fp8 expert: x [T, H] bf16 contiguous with T <= {MAX_TOKENS}, codes w13 [2I, H] and w2 "
                         "[H, I] uint8 with unit column strides and their fp32 scales [rows, K / group], out [T, H]")
    per_channel = g2 == I
    if cols % 32 or not 0 <= cols < I or (cols and not per_channel and cols % g2):
        raise ValueError(f"native fp8 expert: cols {cols} must be a multiple of 32 below I = {I}"
                         + ("" if per_channel else f" and of w2's group {g2}"))
    n = I - cols  # the window's columns: gate rows [cols, I), up rows [I + cols, 2I), w2's columns [cols, I)
    (ga, sa), (gb, sb) = fp8_group(H, g13), fp8_group(n, n if per_channel else g2)
    if amx and max(ga, gb) > FP8_AMX_GROUP:
        raise ValueError(f"native fp8 expert on AMX: groups of at most {FP8_AMX_GROUP}")
    s2_at = s2.data_ptr() + (0 if per_channel else cols // g2 * 4)  # fp32 scales
    return T, H, n, (q13.data_ptr() + cols * q13.stride(0), q13.stride(0), I, s13.data_ptr() + cols * s13.stride(0) * 4,
                     s13.stride(0), ga, sa, q2.data_ptr() + cols, q2.stride(0), s2_at, s2.stride(0), gb, sb)


def expert_silu_fp8(x: torch.Tensor, w13: tuple, w2: tuple, out: torch.Tensor, split13: tuple[int, int],
                    split2: tuple[int, int], amx: bool = False, cols: int = 0) -> torch.Tensor:
    """`expert_silu_bf16` over fp8 weights: w13 = (codes [2I, H] uint8, scales [2I, H / g13] fp32, g13) with the gate
    rows then the up rows, w2 = (codes [H, I], scales [H, I / g2], g2), as `gemv_fp8` reads each (g = K: one scale a
    row); x [T, H] bf16 contiguous, T <= MAX_TOKENS; out [T, H] bf16 or fp32. The same bits as `gemv_fp8` twice with
    torch's bf16 SiLU and product between (where libm's expf and torch's agree); `amx`: on AMX tiles. `cols` > 0 (a
    multiple of 32, and of g2 where w2 is group-wise): the intermediate columns [cols, I) only, as
    `expert_silu_bf16`'s (the hybrid split's host part); split13 then counts the window's columns."""
    lib = _load()
    _amx_check(amx)
    if not _bf16:
        raise ValueError("native fp8 expert: needs the AVX512-BF16 kernel (nf4_bf16() is False)")
    T, H, n, weights = _fp8_expert(x, w13, w2, out, cols, amx)
    _check(lib.ferry_expert_silu_fp8(x.data_ptr(), T, H, n, *weights, _FP8_SUBNORMALS_BF16.data_ptr(), out.data_ptr(),
                                     int(out.dtype == torch.bfloat16), *split13, *split2, int(amx)),
           "expert (SiLU, fp8)")
    return out


def experts_silu_fp8(xs: list[torch.Tensor], w13s: list[tuple], w2s: list[tuple], outs: list[torch.Tensor],
                     split13: tuple[int, int], split2: tuple[int, int], amx: list[bool] | None = None,
                     cols: int = 0) -> list[torch.Tensor]:
    """`expert_silu_fp8` for several experts of one bank in one call, as `experts_silu_bf16` is for bf16 ones (one
    shape, strides and groups for all; amx[i]: expert i on AMX tiles, default none; split13 / split2 counted over all
    the experts' rows): each expert's bits are its own call's."""
    lib = _load()
    if not _bf16:
        raise ValueError("native fp8 experts: need the AVX512-BF16 kernel (nf4_bf16() is False)")
    n = len(xs)
    amx = [False] * n if amx is None else list(amx)
    if not n or not len(w13s) == len(w2s) == len(outs) == len(amx) == n:
        raise ValueError(f"native fp8 experts: {n} x, {len(w13s)} w13, {len(w2s)} w2, {len(outs)} out, {len(amx)} amx")
    if any(amx):
        _amx_check(True)
    calls = [_fp8_expert(x, w13, w2, out, cols, a) for x, w13, w2, out, a in zip(xs, w13s, w2s, outs, amx)]
    _, H, cn, first = calls[0]
    strides = lambda w: w[1:3] + w[4:7] + w[8:9] + w[10:]  # noqa: E731 (all but the pointers)
    if any(c[1:3] != (H, cn) or strides(c[3]) != strides(first) for c in calls) or len({o.dtype for o in outs}) > 1:
        raise ValueError("native fp8 experts: one H, I, group, row stride and out dtype for all")

    def ptrs(at: int) -> torch.Tensor:
        return torch.tensor([c[3][at] for c in calls], dtype=torch.int64)

    keep = (torch.tensor([x.data_ptr() for x in xs], dtype=torch.int64),
            torch.tensor([c[0] for c in calls], dtype=torch.int32), ptrs(0), ptrs(3), ptrs(7), ptrs(9),
            torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64), torch.tensor(amx, dtype=torch.int32))
    (ld13, up), (lds13, g13, gs13), (ld2,), (lds2, g2, gs2) = first[1:3], first[4:7], first[8:9], first[10:]
    _check(lib.ferry_experts_silu_fp8(n, keep[0].data_ptr(), keep[1].data_ptr(), H, cn, keep[2].data_ptr(), ld13, up,
                                      keep[3].data_ptr(), lds13, g13, gs13, keep[4].data_ptr(), ld2,
                                      keep[5].data_ptr(), lds2, g2, gs2, _FP8_SUBNORMALS_BF16.data_ptr(),
                                      keep[6].data_ptr(), int(outs[0].dtype == torch.bfloat16), *split13, *split2,
                                      keep[7].data_ptr()), "experts (SiLU, fp8)")
    return outs


def amx() -> bool:
    """Whether the AMX kernel runs here (`gemv_bf16_bx_mt(amx=True)`, `expert_silu_bf16(amx=True)`): built, the CPU has
    AMX-BF16 and the OS grants this process the tile registers."""
    return _load() is not None and _amx


def _amx_check(amx: bool) -> None:
    if amx and not _amx:
        raise ValueError("native bf16 GEMV: amx=True needs the AMX kernel (amx() is False here)")


def read_bf16_mt(w: torch.Tensor, out: torch.Tensor, threads: int, chunk: int) -> torch.Tensor:
    """`read_bf16` over all of w's rows on `threads` threads of the C pool, `chunk` rows at a time (a benchmark's
    read ceiling for `gemv_bf16_bx_mt`)."""
    lib = _load()
    if (w.stride(1) != 1 or w.dtype != torch.bfloat16 or not out.is_contiguous() or out.dtype != torch.float32
            or out.numel() != w.shape[0]):
        raise ValueError("native bf16 read: w [N, K] bf16 with unit column stride, out [N] fp32 contiguous")
    _check(lib.ferry_read_bf16_mt(w.shape[1], w.data_ptr(), w.stride(0), w.shape[0], out.data_ptr(), threads,
                                  chunk), "bf16 read (threads)")
    return out


def nf4_bf16() -> bool:
    """Whether `gemv_nf4` can take bf16 activations (the AVX512-BF16 kernel: built, and this CPU has it)."""
    return _load() is not None and _bf16


def _levels_bf16() -> torch.Tensor:
    """The NF4 levels as bf16 words, padded to 32 (made at import, see `_FP8_SUBNORMALS_BF16`)."""
    return _NF4_LEVELS_BF16


def nf4_x(x: torch.Tensor, group: int | None = None, bf16: bool | None = None) -> torch.Tensor:
    """x [T, K] -> what `gemv_nf4` reads, made once per call and shared by every chunk of rows: with `bf16` (default:
    where `nf4_bf16()`, K and `group` multiples of 64) bf16, per block of 64 its 32 even elements then its 32 odd
    ones (the AVX512-BF16 kernel); else `nf4_x32`."""
    T, K = x.shape
    if bf16 is None:
        bf16 = nf4_bf16() and K % 64 == 0 and (group is None or group % 64 == 0)
    if bf16:
        return x.to(torch.bfloat16).reshape(T, K // 64, 32, 2).transpose(2, 3).contiguous().view(T, K)
    return nf4_x32(x)


def nf4_x32(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] (K a multiple of 32) -> fp32 [T, K] deinterleaved as `gemv_nf4`'s fp32 kernel reads it: per block of
    32, the 16 even elements, then the 16 odd ones."""
    T, K = x.shape
    return x.float().reshape(T, K // 32, 16, 2).transpose(2, 3).contiguous().view(T, K)


_FP8_SUBNORMALS_BF16 = torch.cat([torch.arange(8, dtype=torch.float32) * 2.0 ** -9, torch.zeros(24)]).to(torch.bfloat16)
"""e4m3's 8 subnormal values (m * 2^-9) as bf16 words, padded to 32: `fp8_words`' table (made at import: pool threads
share it, and it outlives every call that passes its address)."""
_NF4_LEVELS_BF16 = torch.cat([NF4_LEVELS, torch.zeros(16)]).to(torch.bfloat16)


def fp8_amx(K: int, group: int) -> bool:
    """Whether `gemv_fp8` / `expert_silu_fp8` can run a row of K with scale groups of `group` on AMX tiles here."""
    return amx() and fp8_group(K, group)[0] <= FP8_AMX_GROUP


def fp8_group(K: int, group: int) -> tuple[int, int]:
    """(g, gstep) `gemv_fp8` runs a weight of row length K with scale groups of `group` (K: one a row) in: a row's
    scale is read once per g columns (gstep 0: always its first)."""
    if group != K:
        return group, 1
    return next(g for g in (256, 128, 64, 32) if K % g == 0), 0


FP8_AMX_GROUP = 256
"""Widest scale group the AMX fp8 kernel takes (its L1 buffer; block-wise FP8 checkpoints use 128)."""


def gemv_fp8(xb: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, out: torch.Tensor,
             threads: int = 1, chunk: int = 0, amx: bool = False) -> torch.Tensor:
    """out [T, N] fp32 = x [T, K] @ W.T for fp8 e4m3 W (AVX512-BF16: `nf4_bf16()`): xb bf16 [T, K] contiguous, codes
    q [N, K] uint8 (unit column stride), scale [N, K/group] fp32 (unit column stride; group K: per channel),
    group and K multiples of 32, T <= MAX_TOKENS. Products of the exact e4m3 values with bf16 x, fp32 sums, each
    group's sum times its scale. `threads` > 1: on that many threads of the C pool, `chunk` rows at a time. `amx`:
    on AMX tiles (`amx()`; groups of at most FP8_AMX_GROUP), each group decoded into tile rows first."""
    lib = _load()
    if not _bf16:
        raise ValueError("native fp8 GEMV: needs the AVX512-BF16 kernel (nf4_bf16() is False)")
    T, K = xb.shape
    N = q.shape[0]
    if (xb.dtype != torch.bfloat16 or not xb.is_contiguous() or q.dtype != torch.uint8 or q.stride(1) != 1
            or scale.dtype != torch.float32 or scale.stride(-1) != 1 or out.stride(1) != 1 or K % 32 or group % 32
            or K % group or scale.shape != (N, K // group) or out.shape != (T, N) or T < 1):
        raise ValueError("native fp8 GEMV: bf16 x [T, K] (T >= 1), uint8 codes [N, K], fp32 scales [N, K/group] and out "
                         "[T, N] with unit column strides, K and group multiples of 32")
    g, gstep = fp8_group(K, group)
    _amx_check(amx)
    if amx and g > FP8_AMX_GROUP:
        raise ValueError(f"native fp8 GEMV on AMX: groups of at most {FP8_AMX_GROUP}, not {g}")
    args = (xb.data_ptr(), T, K, q.data_ptr(), q.stride(0), scale.data_ptr(), scale.stride(0), g, gstep,
            _FP8_SUBNORMALS_BF16.data_ptr(), N, out.data_ptr(), out.stride(0))
    if threads > 1 or amx:
        chunk = chunk or -(-N // threads)
        _check(lib.ferry_gemv_fp8_mt(*args, threads, max(1, chunk), int(amx)), "fp8 GEMV (threads)")
    else:
        _check(lib.ferry_gemv_fp8(*args), "fp8 GEMV")
    return out


def _nf4_expert(x: torch.Tensor, w13: tuple, w2: tuple, out: torch.Tensor, cols: int) -> tuple:
    """`expert_silu_nf4`'s arguments checked -> (T, H, n, the C call's weight arguments from q13 to g2) for the window
    [cols, I) (n = I - cols columns)."""
    (q13, a13, g13), (q2, a2, g2) = w13, w2
    T, H = x.shape
    I = q2.shape[1] * 2
    if g13 < 64 or g2 < 64:
        raise ValueError(f"native NF4 expert: groups of {g13} / {g2} columns (multiples of 64)")
    if (x.dtype != torch.bfloat16 or not x.is_contiguous() or not 1 <= T <= MAX_TOKENS
            or q13.dtype != torch.uint8 or q2.dtype != torch.uint8 or q13.stride(1) != 1 or q2.stride(1) != 1
            or tuple(q13.shape) != (2 * I, H // 2) or q2.shape[0] != H or a13.dtype != torch.float32
            or a2.dtype != torch.float32 or a13.stride(-1) != 1 or a2.stride(-1) != 1 or H % g13 or I % g2
            or g13 % 64 or g2 % 64 or H % 64 or I % 64
            or tuple(a13.shape) != (2 * I, H // g13) or tuple(a2.shape) != (H, I // g2)
            or out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous() or tuple(out.shape) != (T, H)):
        raise ValueError(f"native NF4 expert: x [T, H] bf16 contiguous with T <= {MAX_TOKENS}, codes w13 [2I, H/2] and "
                         "w2 [H, I/2] uint8 with unit column strides, fp32 absmax [rows, K / group], groups and H, I "
                         "multiples of 64, out [T, H]")
    if cols % 64 or cols % g2 or not 0 <= cols < I:
        raise ValueError(f"native NF4 expert: cols {cols} must be a multiple of 64 and of w2's group {g2} below I = {I}")
    # the window: gate rows [cols, I), up rows [I + cols, 2I), w2's columns [cols, I)
    return T, H, I - cols, (q13.data_ptr() + cols * q13.stride(0), q13.stride(0), I,
                            a13.data_ptr() + cols * a13.stride(0) * 4, a13.stride(0), g13, q2.data_ptr() + cols // 2,
                            q2.stride(0), a2.data_ptr() + cols // g2 * 4, a2.stride(0), g2)


def expert_silu_nf4(x: torch.Tensor, w13: tuple, w2: tuple, out: torch.Tensor, split13: tuple[int, int],
                    split2: tuple[int, int], cols: int = 0) -> torch.Tensor:
    """`expert_silu_fp8` over NF4 weights on the AVX512-BF16 kernel: w13 = (codes [2I, H/2] uint8, absmax [2I, H / g13]
    fp32, g13) with the gate rows then the up rows, w2 = (codes [H, I/2], absmax [H, I / g2], g2), as `gemv_nf4` reads
    each; x [T, H] bf16 as `nf4_x` lays it (per 64 columns the 32 even, then the 32 odd), T <= MAX_TOKENS; out [T, H]
    bf16 or fp32. The same bits as `gemv_nf4` twice with torch's bf16 SiLU and product between. `cols` > 0 (a multiple
    of 64 and of g2): the intermediate columns [cols, I) only (the hybrid split's host part)."""
    lib = _load()
    if not _bf16:
        raise ValueError("native NF4 expert: needs the AVX512-BF16 kernel (nf4_bf16() is False)")
    T, H, n, weights = _nf4_expert(x, w13, w2, out, cols)
    _check(lib.ferry_expert_silu_nf4(x.data_ptr(), T, H, n, *weights, _levels_bf16().data_ptr(), out.data_ptr(),
                                     int(out.dtype == torch.bfloat16), *split13, *split2), "expert (SiLU, NF4)")
    return out


def experts_silu_nf4(xs: list[torch.Tensor], w13s: list[tuple], w2s: list[tuple], outs: list[torch.Tensor],
                     split13: tuple[int, int], split2: tuple[int, int], cols: int = 0) -> list[torch.Tensor]:
    """`expert_silu_nf4` for several experts of one bank in one call, as `experts_silu_bf16` is for bf16 ones (one
    shape, strides and groups for all; split13 / split2 counted over all the experts' rows): each expert's bits are
    its own call's."""
    lib = _load()
    if not _bf16:
        raise ValueError("native NF4 experts: need the AVX512-BF16 kernel (nf4_bf16() is False)")
    n = len(xs)
    if not n or not len(w13s) == len(w2s) == len(outs) == n:
        raise ValueError(f"native NF4 experts: {n} x, {len(w13s)} w13, {len(w2s)} w2, {len(outs)} out")
    calls = [_nf4_expert(*args, cols) for args in zip(xs, w13s, w2s, outs)]
    _, H, cn, first = calls[0]
    strides = lambda w: w[1:3] + w[4:6] + w[7:8] + w[9:]  # noqa: E731 (all but the pointers)
    if any(c[1:3] != (H, cn) or strides(c[3]) != strides(first) for c in calls) or len({o.dtype for o in outs}) > 1:
        raise ValueError("native NF4 experts: one H, I, group, row stride and out dtype for all")

    def ptrs(at: int) -> torch.Tensor:
        return torch.tensor([c[3][at] for c in calls], dtype=torch.int64)

    keep = (torch.tensor([x.data_ptr() for x in xs], dtype=torch.int64),
            torch.tensor([c[0] for c in calls], dtype=torch.int32), ptrs(0), ptrs(3), ptrs(6), ptrs(8),
            torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64))
    (ld13, up), (lds13, g13), (ld2,), (lds2, g2) = first[1:3], first[4:6], first[7:8], first[9:]
    _check(lib.ferry_experts_silu_nf4(n, keep[0].data_ptr(), keep[1].data_ptr(), H, cn, keep[2].data_ptr(), ld13, up,
                                      keep[3].data_ptr(), lds13, g13, keep[4].data_ptr(), ld2, keep[5].data_ptr(),
                                      lds2, g2, _levels_bf16().data_ptr(), keep[6].data_ptr(),
                                      int(outs[0].dtype == torch.bfloat16), *split13, *split2), "experts (SiLU, NF4)")
    return outs


def gemv_nf4(x32: torch.Tensor, q: torch.Tensor, absmax: torch.Tensor, group: int, levels: torch.Tensor,
             out: torch.Tensor, threads: int = 1, chunk: int = 0) -> torch.Tensor:
    """out [T, N] fp32 = x [T, K] @ W.T for NF4 W, x32 = `nf4_x(x, group)` (fp32: the fp32 kernel; bf16: the
    AVX512-BF16 one, its levels rounded to bf16): codes q [N, K/2] uint8 (unit column stride), absmax [N, K/group] fp32
    (unit column stride), levels [16] fp32. `threads` > 1: all N rows on that many threads of the C pool (as
    `gemv_bf16_bx_mt`), `chunk` rows at a time (0: N / threads)."""
    lib = _load()
    T, K = x32.shape
    N = q.shape[0]
    if (q.stride(1) != 1 or absmax.stride(1) != 1 or out.stride(1) != 1 or not x32.is_contiguous()
            or absmax.dtype != torch.float32 or not levels.is_contiguous()):
        raise ValueError("native NF4 GEMV: unit column strides, fp32 absmax and levels")
    if x32.dtype == torch.bfloat16:  # `nf4_x(bf16=True)`: the AVX512-BF16 kernel, its own bf16 level table
        if not _bf16:
            raise ValueError("native NF4 GEMV: bf16 activations need the AVX512-BF16 kernel (nf4_bf16() is False)")
        fn, lv = lib.ferry_gemv_nf4_bf16, _levels_bf16()
    else:
        fn, lv = lib.ferry_gemv_nf4, levels
    if threads > 1:
        if chunk < 0:
            raise ValueError(f"native NF4 GEMV: chunk {chunk} rows (0: the rows split evenly over the threads)")
        chunk = chunk or -(-N // threads)
        _check(lib.ferry_gemv_nf4_mt(int(fn is not lib.ferry_gemv_nf4), x32.data_ptr(), T, K, q.data_ptr(),
                                     q.stride(0), absmax.data_ptr(), absmax.stride(0), group, lv.data_ptr(), N,
                                     out.data_ptr(), out.stride(0), threads, max(1, chunk)), "NF4 GEMV (threads)")
        return out
    _check(fn(x32.data_ptr(), T, K, q.data_ptr(), q.stride(0), absmax.data_ptr(), absmax.stride(0), group,
              lv.data_ptr(), N, out.data_ptr(), out.stride(0)), "NF4 GEMV")
    return out
