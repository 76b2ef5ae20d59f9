/* Routed experts on the host CPU: the `cpu` miss policy's kernel (tidejax/residency/cpu.py).

   moe(isa, kind, gate_up, gate_up_scales, down, down_scales, x, rows, tokens, weights, limit, y)
   computes, for every pick p (pool row rows[p], token tokens[p], routing weight weights[p]),
       y[t] += w_p * down_r(swiglu(gate_up_r @ x[t]))
   in float32, the picks of one token summed in pick order, straight from the host pool's
   memory (read once a step: each expert's rows are streamed once for all its tokens).

   Formats (tidejax/pallas/bank.py): kind 0 MXFP4 (gate_up [N, 2I, D/32, 16] uint8 codes, two e2m1
   values a byte, low nibble first, and [N, 2I, D/32] e8m0 scales; down [N, D, I/32, 16] and
   [N, D, I/32]), kind 1 float32, kind 2 bfloat16 (gate_up [N, 2I, D], down [N, D, I]).

   MXFP4 decoding: the weights are exact (an e2m1 value times a power-of-two scale), so only the
   order of the float32 sums differs from the jnp reference. The activations are permuted once a
   block ([16 even elements, 16 odd ones]), so the low nibbles of a block's 16 bytes multiply the
   first half and the high nibbles the second half without any interleaving. AVX-512: the 16
   bytes are widened to 16 int32 lanes and VPERMPS (which reads the low 4 bits of each lane)
   looks each code up in the 16-entry e2m1 table scaled by the block's e8m0 scale; AVX2: a byte
   shuffle (VPSHUFB) maps the codes to the doubled values -12..12, widened to float32 and scaled.

   Threads: a persistent pool (one a CPU the process may run on, but one) splits each phase into
   items of one expert's row slice: (1) gate and up rows and the SwiGLU, (2) down rows, (3) the
   weighted sum over D slices. The ISA is chosen at run time (__builtin_cpu_supports).
*/
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity */
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdio.h>
#include <unistd.h>

#include "cpu_kernel.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TJ_X86 1
#define TJ_AVX512 __attribute__((target("avx512f")))
#define TJ_AVX2 __attribute__((target("avx2,fma")))
#define TJ_INLINE static inline __attribute__((always_inline))
#else
#define TJ_X86 0
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *ISA_NAMES[] = {"scalar", "avx2", "avx512"};
enum { KIND_MXFP4 = 0, KIND_F32 = 1, KIND_BF16 = 2 };

#define RA 32   /* intermediate units (gate and up rows) per phase-1 item */
#define RB 64   /* down rows per phase-2 item */
#define RC 256  /* output columns per phase-3 item */
#define NTMAX 4 /* tokens one pass over a row serves */

static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static float SCALE[256]; /* e8m0: 2**(s - 127); 255 is NaN */

/* ---- row dots: res[j] = dot(row, xs[j]) for NT tokens ------------------------------------- */

/* One matrix of one expert: `rows` rows of `cols` inputs. */
typedef struct {
    int kind;
    const uint8_t *data;   /* the pool leaf */
    const uint8_t *scales; /* MXFP4 only */
    int64_t rows, cols;
} Mat;

static inline const uint8_t *row_ptr(const Mat *m, int64_t expert, int64_t r) {
    int64_t i = expert * m->rows + r;
    if (m->kind == KIND_MXFP4) return m->data + i * (m->cols / 2);
    return m->data + i * m->cols * (m->kind == KIND_F32 ? 4 : 2);
}

static inline const uint8_t *scale_ptr(const Mat *m, int64_t expert, int64_t r) {
    return m->scales + (expert * m->rows + r) * (m->cols / 32);
}

static inline float bf16(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void mx_row_scalar(const uint8_t *w, const uint8_t *sc, int64_t cols,
                          const float *const *xs, int nt, float *res) {
    for (int j = 0; j < nt; j++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < cols / 32; b++) {
            float s = SCALE[sc[b]];
            const float *x = xs[j] + 32 * b;
            for (int i = 0; i < 16; i++) {
                uint8_t c = w[16 * b + i];
                acc += E2M1[c & 15] * s * x[i] + E2M1[c >> 4] * s * x[16 + i];
            }
        }
        res[j] = acc;
    }
}

static void dense_row_scalar(const uint8_t *w, int kind, int64_t cols, const float *const *xs,
                             int nt, float *res) {
    for (int j = 0; j < nt; j++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < cols; i++) {
            float v = kind == KIND_F32 ? ((const float *)w)[i] : bf16(((const uint16_t *)w)[i]);
            acc += v * xs[j][i];
        }
        res[j] = acc;
    }
}

#if TJ_X86
/* -- AVX-512 -- */
TJ_INLINE TJ_AVX512 void mx_row_512(const uint8_t *w, const uint8_t *sc, int64_t nblk,
                                    const float *const *xs, const int NT, float *res) {
    const __m512 table = _mm512_loadu_ps(E2M1);
    __m512 acc[NTMAX][4];
    for (int j = 0; j < NT; j++)
        for (int a = 0; a < 4; a++) acc[j][a] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nblk; b += 2) {
        for (int h = 0; h < 2; h++) {
            __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 16 * (b + h))));
            __m512 t = _mm512_mul_ps(table, _mm512_set1_ps(SCALE[sc[b + h]]));
            __m512 lo = _mm512_permutexvar_ps(c, t);
            __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t);
            for (int j = 0; j < NT; j++) {
                const float *x = xs[j] + 32 * (b + h);
                acc[j][2 * h] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x), acc[j][2 * h]);
                acc[j][2 * h + 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), acc[j][2 * h + 1]);
            }
        }
    }
    for (; b < nblk; b++) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 16 * b)));
        __m512 t = _mm512_mul_ps(table, _mm512_set1_ps(SCALE[sc[b]]));
        __m512 lo = _mm512_permutexvar_ps(c, t);
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t);
        for (int j = 0; j < NT; j++) {
            const float *x = xs[j] + 32 * b;
            acc[j][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x), acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), acc[j][1]);
        }
    }
    for (int j = 0; j < NT; j++)
        res[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]),
                                                    _mm512_add_ps(acc[j][2], acc[j][3])));
}

TJ_INLINE TJ_AVX512 __m512 load16_512(const uint8_t *w, int kind, int64_t i) {
    if (kind == KIND_F32) return _mm512_loadu_ps((const float *)w + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TJ_INLINE TJ_AVX512 void dense_row_512(const uint8_t *w, int kind, int64_t cols,
                                       const float *const *xs, const int NT, float *res) {
    __m512 acc[NTMAX][2];
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= cols; i += 32) {
        __m512 w0 = load16_512(w, kind, i), w1 = load16_512(w, kind, i + 16);
        for (int j = 0; j < NT; j++) {
            acc[j][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs[j] + i), acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs[j] + i + 16), acc[j][1]);
        }
    }
    for (int j = 0; j < NT; j++) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]));
        for (int64_t k = i; k < cols; k++)
            s += (kind == KIND_F32 ? ((const float *)w)[k] : bf16(((const uint16_t *)w)[k])) * xs[j][k];
        res[j] = s;
    }
}

/* -- AVX2 -- */
TJ_INLINE TJ_AVX2 float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TJ_INLINE TJ_AVX2 void mx_row_256(const uint8_t *w, const uint8_t *sc, int64_t nblk,
                                  const float *const *xs, const int NT, float *res) {
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m256 acc[NTMAX][4];
    for (int j = 0; j < NT; j++)
        for (int a = 0; a < 4; a++) acc[j][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(w + 16 * b));
        __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, low4));
        __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        __m256 s = _mm256_set1_ps(SCALE[sc[b]] * 0.5f); /* the table holds doubled values */
        __m256 v[4] = {
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), s),
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), s),
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), s),
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), s)};
        for (int j = 0; j < NT; j++) {
            const float *x = xs[j] + 32 * b;
            for (int a = 0; a < 4; a++)
                acc[j][a] = _mm256_fmadd_ps(v[a], _mm256_loadu_ps(x + 8 * a), acc[j][a]);
        }
    }
    for (int j = 0; j < NT; j++)
        res[j] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[j][0], acc[j][1]),
                                       _mm256_add_ps(acc[j][2], acc[j][3])));
}

TJ_INLINE TJ_AVX2 __m256 load8_256(const uint8_t *w, int kind, int64_t i) {
    if (kind == KIND_F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

TJ_INLINE TJ_AVX2 void dense_row_256(const uint8_t *w, int kind, int64_t cols,
                                     const float *const *xs, const int NT, float *res) {
    __m256 acc[NTMAX][2];
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= cols; i += 16) {
        __m256 w0 = load8_256(w, kind, i), w1 = load8_256(w, kind, i + 8);
        for (int j = 0; j < NT; j++) {
            acc[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[j] + i), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs[j] + i + 8), acc[j][1]);
        }
    }
    for (int j = 0; j < NT; j++) {
        float s = hsum256(_mm256_add_ps(acc[j][0], acc[j][1]));
        for (int64_t k = i; k < cols; k++)
            s += (kind == KIND_F32 ? ((const float *)w)[k] : bf16(((const uint16_t *)w)[k])) * xs[j][k];
        res[j] = s;
    }
}
#endif

/* dot_rows: outs[j][r] = dot(row r0 + r of expert `e`, xs[j]), r < nr, j < nt. One version per
   ISA; each row is read from memory once and reused from L1 for every chunk of NTMAX tokens. */
typedef void (*dot_rows_fn)(const Mat *, int64_t, int64_t, int, const float *const *,
                            float *const *, int);

#define DOT_ROWS(NAME, ATTR, MX_ROW, DENSE_ROW)                                                  \
    static ATTR void NAME(const Mat *m, int64_t e, int64_t r0, int nr, const float *const *xs,  \
                          float *const *outs, int nt) {                                         \
        float res[NTMAX];                                                                       \
        for (int r = 0; r < nr; r++) {                                                          \
            const uint8_t *w = row_ptr(m, e, r0 + r);                                           \
            for (int j0 = 0; j0 < nt; j0 += NTMAX) {                                            \
                int n = nt - j0 < NTMAX ? nt - j0 : NTMAX;                                      \
                const float *const *x = xs + j0;                                                \
                if (m->kind == KIND_MXFP4) {                                                    \
                    const uint8_t *sc = scale_ptr(m, e, r0 + r);                                \
                    int64_t nb = m->cols / 32;                                                  \
                    switch (n) {                                                                \
                    case 1: MX_ROW(w, sc, nb, x, 1, res); break;                                \
                    case 2: MX_ROW(w, sc, nb, x, 2, res); break;                                \
                    case 3: MX_ROW(w, sc, nb, x, 3, res); break;                                \
                    default: MX_ROW(w, sc, nb, x, 4, res); break;                               \
                    }                                                                           \
                } else {                                                                        \
                    switch (n) {                                                                \
                    case 1: DENSE_ROW(w, m->kind, m->cols, x, 1, res); break;                   \
                    case 2: DENSE_ROW(w, m->kind, m->cols, x, 2, res); break;                   \
                    case 3: DENSE_ROW(w, m->kind, m->cols, x, 3, res); break;                   \
                    default: DENSE_ROW(w, m->kind, m->cols, x, 4, res); break;                  \
                    }                                                                           \
                }                                                                               \
                for (int j = 0; j < n; j++) outs[j0 + j][r] = res[j];                           \
            }                                                                                   \
        }                                                                                       \
    }

static void mx_row_scalar_n(const uint8_t *w, const uint8_t *sc, int64_t nblk,
                            const float *const *xs, int nt, float *res) {
    mx_row_scalar(w, sc, nblk * 32, xs, nt, res);
}

DOT_ROWS(dot_rows_scalar, , mx_row_scalar_n, dense_row_scalar)
#if TJ_X86
DOT_ROWS(dot_rows_avx2, TJ_AVX2, mx_row_256, dense_row_256)
DOT_ROWS(dot_rows_avx512, TJ_AVX512, mx_row_512, dense_row_512)
#endif

static dot_rows_fn DOT_ROWS_BY_ISA[3] = {dot_rows_scalar,
#if TJ_X86
                                         dot_rows_avx2, dot_rows_avx512
#else
                                         NULL, NULL
#endif
};

static int best_isa(void) {
#if TJ_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* ---- the thread pool ------------------------------------------------------------------------- */

typedef void (*item_fn)(void *, int);

static struct {
    int n; /* threads, the caller included */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint gen;
    item_fn fn;
    void *arg;
    int items;
    atomic_int next;
    atomic_int busy; /* workers still on the current job */
} pool = {.n = 0, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one moe() at a time */

static inline void relax(void) {
#if TJ_X86
    _mm_pause();
#endif
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void run_items(void) {
    int i;
    while ((i = atomic_fetch_add(&pool.next, 1)) < pool.items) pool.fn(pool.arg, i);
}

/* A worker spins this long for the next job before it sleeps: longer than a decode step's gap
   between two MoE layers, so the layers of a step never pay for waking threads (a futex wake of
   an idle vCPU costs ~1 ms in a VM). It yields as it spins, so the threads that drive the device
   still get a CPU. */
#define SPIN_S 5e-3

static void *worker(void *unused) {
    (void)unused;
    unsigned seen = 0;
    for (;;) {
        unsigned g = atomic_load_explicit(&pool.gen, memory_order_acquire);
        double start = now_s();
        for (int spin = 0; g == seen; spin++) {
            relax();
            if ((spin & 63) == 63) sched_yield();
            if ((spin & 255) == 255 && now_s() - start > SPIN_S) {
                pthread_mutex_lock(&pool.mu);
                while ((g = atomic_load(&pool.gen)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
            g = atomic_load_explicit(&pool.gen, memory_order_acquire);
        }
        seen = g;
        run_items();
        atomic_fetch_sub_explicit(&pool.busy, 1, memory_order_release);
    }
    return NULL;
}

static int cpu_count(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* Threads: one a CPU but one, left to the threads that drive the device and the Python loop (a
   phase waits for its slowest item, so a worker that loses its CPU to them stalls a phase). */
static int pool_size(void) {
    int n = cpu_count();
    return n > 2 ? n - 1 : n;
}

static int start_pool(void) {
    if (pool.n) return 0;
    int n = pool_size();
    for (int i = 1; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, NULL) != 0) return -1;
        pthread_detach(t);
    }
    pool.n = n;
    return 0;
}

/* fn(arg, i) for i < items, over every thread; returns when all are done. */
static void parallel_for(item_fn fn, void *arg, int items) {
    if (pool.n <= 1 || items <= 1) {
        for (int i = 0; i < items; i++) fn(arg, i);
        return;
    }
    pool.fn = fn;
    pool.arg = arg;
    pool.items = items;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.busy, pool.n - 1);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.gen, 1, memory_order_release);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    run_items();
    for (int spin = 0; atomic_load_explicit(&pool.busy, memory_order_acquire) > 0; spin++) {
        if (spin < 100000) relax();
        else sched_yield();
    }
}

/* ---- one layer's missed picks ------------------------------------------------------------------ */

typedef struct {
    Mat gu, dn;
    int64_t d, inter;
    float limit;
    int mx; /* activations permuted by block */
    dot_rows_fn dot;
    int n_picks, n_experts;
    const int64_t *rows, *tokens;
    const float *weights;
    int64_t *order;   /* [P] picks grouped by expert (pick order within one) */
    int64_t *ustart;  /* [U + 1] */
    const float *x;   /* [T, D] */
    float *xp;        /* [T, D] permuted (MXFP4) */
    float *act;       /* [P, I] */
    float *out;       /* [P, D] */
    float *y;         /* [T, D] */
    int64_t t;
} Work;

static inline int64_t perm32(int64_t i) { /* position of element i in a block-permuted vector */
    return (i & ~(int64_t)31) | ((i & 1) << 4) | ((i & 31) >> 1);
}

static void permute_token(void *arg, int t) {
    Work *w = arg;
    for (int64_t i = 0; i < w->d; i++) w->xp[t * w->d + perm32(i)] = w->x[t * w->d + i];
}

static inline float swiglu(float g, float u, float limit) {
    if (limit > 0) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g * (1.0f / (1.0f + expf(-g))) * u;
}

/* Phase 1 item: RA gate and up rows of one expert, for all its picks, then their SwiGLU. */
static void gate_up_item(void *arg, int item) {
    Work *w = arg;
    int64_t per = (w->inter + RA - 1) / RA;
    int64_t u = item / per, r0 = (item % per) * RA;
    int nr = (int)(w->inter - r0 < RA ? w->inter - r0 : RA);
    int64_t e = w->rows[w->order[w->ustart[u]]];
    const float *xs[NTMAX];
    float g[NTMAX][RA], up[NTMAX][RA];
    float *gs[NTMAX], *us[NTMAX];
    const float *xbase = w->mx ? w->xp : w->x;
    for (int64_t p0 = w->ustart[u]; p0 < w->ustart[u + 1]; p0 += NTMAX) {
        int n = (int)(w->ustart[u + 1] - p0 < NTMAX ? w->ustart[u + 1] - p0 : NTMAX);
        for (int j = 0; j < n; j++) {
            xs[j] = xbase + w->tokens[w->order[p0 + j]] * w->d;
            gs[j] = g[j];
            us[j] = up[j];
        }
        w->dot(&w->gu, e, r0, nr, xs, gs, n);
        w->dot(&w->gu, e, w->inter + r0, nr, xs, us, n);
        for (int j = 0; j < n; j++) {
            float *a = w->act + w->order[p0 + j] * w->inter;
            for (int r = 0; r < nr; r++) {
                int64_t i = r0 + r;
                a[w->mx ? perm32(i) : i] = swiglu(g[j][r], up[j][r], w->limit);
            }
        }
    }
}

/* Phase 2 item: RB down rows of one expert, for all its picks. */
static void down_item(void *arg, int item) {
    Work *w = arg;
    int64_t per = (w->d + RB - 1) / RB;
    int64_t u = item / per, r0 = (item % per) * RB;
    int nr = (int)(w->d - r0 < RB ? w->d - r0 : RB);
    int64_t e = w->rows[w->order[w->ustart[u]]];
    const float *as[NTMAX];
    float *os[NTMAX];
    for (int64_t p0 = w->ustart[u]; p0 < w->ustart[u + 1]; p0 += NTMAX) {
        int n = (int)(w->ustart[u + 1] - p0 < NTMAX ? w->ustart[u + 1] - p0 : NTMAX);
        for (int j = 0; j < n; j++) {
            int64_t p = w->order[p0 + j];
            as[j] = w->act + p * w->inter;
            os[j] = w->out + p * w->d + r0;
        }
        w->dot(&w->dn, e, r0, nr, as, os, n);
    }
}

/* Phase 3 item: columns [c0, c0 + RC) of y, every pick added in pick order. */
static void sum_item(void *arg, int item) {
    Work *w = arg;
    int64_t c0 = (int64_t)item * RC, c1 = c0 + RC < w->d ? c0 + RC : w->d;
    for (int64_t p = 0; p < w->n_picks; p++) {
        float *y = w->y + w->tokens[p] * w->d;
        const float *o = w->out + p * w->d;
        float wt = w->weights[p];
        for (int64_t c = c0; c < c1; c++) y[c] += wt * o[c];
    }
}

static const int64_t *sort_rows; /* qsort's key (under call_mu) */

static int by_row(const void *a, const void *b) {
    int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
    if (sort_rows[i] != sort_rows[j]) return sort_rows[i] < sort_rows[j] ? -1 : 1;
    return i < j ? -1 : (i > j);
}

static void run_work(Work *w) {
    for (int64_t p = 0; p < w->n_picks; p++) w->order[p] = p;
    sort_rows = w->rows;
    qsort(w->order, w->n_picks, sizeof(int64_t), by_row);
    int64_t u = 0;
    for (int64_t p = 0; p < w->n_picks; p++)
        if (p == 0 || w->rows[w->order[p]] != w->rows[w->order[p - 1]]) w->ustart[u++] = p;
    w->ustart[u] = w->n_picks;
    w->n_experts = (int)u;
    if (w->mx) parallel_for(permute_token, w, (int)w->t);
    parallel_for(gate_up_item, w, (int)(u * ((w->inter + RA - 1) / RA)));
    parallel_for(down_item, w, (int)(u * ((w->d + RB - 1) / RB)));
    memset(w->y, 0, sizeof(float) * w->t * w->d);
    parallel_for(sum_item, w, (int)((w->d + RC - 1) / RC));
}

/* The buffers of one call around run_work, the thread pool started on first use: 0, or an index
   into MOE_ERRORS. */
static const char *MOE_ERRORS[] = {"", "moe: out of memory", "moe: could not start the worker threads"};

static int moe_run(Work *w) {
    int64_t p = w->n_picks;
    w->order = malloc(sizeof(int64_t) * (p + 1));
    w->ustart = malloc(sizeof(int64_t) * (p + 2));
    w->act = malloc(sizeof(float) * (p * w->inter + 1));
    w->out = malloc(sizeof(float) * (p * w->d + 1));
    w->xp = w->mx ? malloc(sizeof(float) * (w->t * w->d + 1)) : NULL;
    int err = 0;
    if (!w->order || !w->ustart || !w->act || !w->out || (w->mx && !w->xp)) {
        err = 1;
    } else {
        pthread_mutex_lock(&call_mu);
        if (start_pool() != 0) err = 2;
        else run_work(w);
        pthread_mutex_unlock(&call_mu);
    }
    free(w->order), free(w->ustart), free(w->act), free(w->out), free(w->xp);
    return err;
}

/* ---- the host pools the XLA FFI handlers read (cpu_ffi.cc, cpu_kernel.h) ---------------------- */

#define TJ_MAX_POOLS 64 /* engines a process builds over its life */

struct tj_pool {
    int isa;
    int64_t n_rows, n_experts, d, inter;
    Mat gu, dn;
    int64_t picks; /* computed since registration (atomic) */
};

static tj_pool POOLS[TJ_MAX_POOLS];
static atomic_int n_pools;

tj_pool *tj_pool_get(int64_t handle) {
    return handle >= 0 && handle < atomic_load(&n_pools) ? &POOLS[handle] : NULL;
}

int tj_pool_moe(tj_pool *pool_, const float *x, int64_t t, int64_t d, const int32_t *ids,
                const float *weights, const uint8_t *miss, int64_t k, int64_t moe_index,
                float limit, float *y, char *err, size_t err_len) {
    if (d != pool_->d) {
        snprintf(err, err_len, "moe: x has %lld columns, the pool's experts take %lld",
                 (long long)d, (long long)pool_->d);
        return -1;
    }
    int64_t n_picks = 0;
    for (int64_t i = 0; i < t * k; i++) n_picks += miss[i] != 0;
    Work w = {.gu = pool_->gu, .dn = pool_->dn, .d = pool_->d, .inter = pool_->inter,
              .limit = limit, .mx = pool_->gu.kind == KIND_MXFP4,
              .dot = DOT_ROWS_BY_ISA[pool_->isa], .n_picks = (int)n_picks, .x = x, .y = y, .t = t};
    int64_t *picks = malloc(sizeof(int64_t) * (2 * n_picks + 1));
    float *pick_weights = malloc(sizeof(float) * (n_picks + 1));
    if (!picks || !pick_weights) {
        free(picks), free(pick_weights);
        snprintf(err, err_len, "%s", MOE_ERRORS[1]);
        return -1;
    }
    int64_t *rows = picks, *tokens = picks + n_picks, p = 0;
    for (int64_t i = 0; i < t * k; i++) { /* token-major, as numpy.nonzero orders them */
        if (!miss[i]) continue;
        rows[p] = moe_index * pool_->n_experts + ids[i];
        tokens[p] = i / k;
        pick_weights[p] = weights[i];
        if (ids[i] < 0 || ids[i] >= pool_->n_experts || rows[p] >= pool_->n_rows) {
            snprintf(err, err_len, "moe: pick of expert %d in MoE layer %lld is outside the pool",
                     ids[i], (long long)moe_index);
            free(picks), free(pick_weights);
            return -1;
        }
        p++;
    }
    w.rows = rows, w.tokens = tokens, w.weights = pick_weights;
    int status = n_picks ? moe_run(&w) : 0;
    if (!n_picks) memset(y, 0, sizeof(float) * t * pool_->d);
    free(picks), free(pick_weights);
    if (status) {
        snprintf(err, err_len, "%s", MOE_ERRORS[status]);
        return -1;
    }
    __atomic_fetch_add(&pool_->picks, n_picks, __ATOMIC_RELAXED);
    return 0;
}

/* ---- Python ------------------------------------------------------------------------------------ */

typedef struct {
    Py_buffer views[10];
    int n;
} Buffers;

static void release_all(Buffers *b) {
    for (int i = 0; i < b->n; i++) PyBuffer_Release(&b->views[i]);
    b->n = 0;
}

/* A C-contiguous buffer of exactly `want` bytes, or NULL with a ValueError naming the argument. */
static void *get(Buffers *b, PyObject *obj, const char *name, Py_ssize_t want, int writable) {
    Py_buffer *v = &b->views[b->n];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    b->n++;
    if (v->len != want) {
        PyErr_Format(PyExc_ValueError, "moe: %s has %zd bytes, expected %zd", name, v->len, want);
        return NULL;
    }
    return v->buf;
}

/* A pool's leaves (buffers of exactly their bytes) checked into `out`; -1 with an exception set.
   The views are released by the caller's release_all: the pool is read through raw pointers. */
static int pool_from_args(Buffers *b, tj_pool *out, const char *fn, int isa, int kind,
                          long long n_rows, long long n_experts, long long d, long long inter,
                          PyObject *gu, PyObject *gus, PyObject *dn, PyObject *dns) {
    if (isa < 0 || isa > 2 || !DOT_ROWS_BY_ISA[isa] || isa > best_isa()) {
        PyErr_Format(PyExc_ValueError, "%s: isa %d is not available on this CPU", fn, isa);
        return -1;
    }
    if (kind < 0 || kind > 2) {
        PyErr_Format(PyExc_ValueError, "%s: kind %d is unknown", fn, kind);
        return -1;
    }
    if (kind == KIND_MXFP4 && (d % 32 || inter % 32)) {
        PyErr_Format(PyExc_ValueError, "%s: MXFP4 needs D and I multiples of 32", fn);
        return -1;
    }
    if (d <= 0 || inter <= 0 || n_rows <= 0 || n_experts <= 0) {
        PyErr_Format(PyExc_ValueError, "%s: bad dimensions", fn);
        return -1;
    }
    Py_ssize_t esize = kind == KIND_F32 ? 4 : 2;
    Py_ssize_t gu_bytes = kind == KIND_MXFP4 ? n_rows * 2 * inter * d / 2 : n_rows * 2 * inter * d * esize;
    Py_ssize_t dn_bytes = kind == KIND_MXFP4 ? n_rows * d * inter / 2 : n_rows * d * inter * esize;
    *out = (tj_pool){.isa = isa, .n_rows = n_rows, .n_experts = n_experts, .d = d, .inter = inter};
    out->gu = (Mat){kind, get(b, gu, "gate_up", gu_bytes, 0), NULL, 2 * inter, d};
    if (!out->gu.data) return -1;
    out->dn = (Mat){kind, get(b, dn, "down", dn_bytes, 0), NULL, d, inter};
    if (!out->dn.data) return -1;
    if (kind == KIND_MXFP4) {
        if (!(out->gu.scales = get(b, gus, "gate_up_scales", n_rows * 2 * inter * d / 32, 0)))
            return -1;
        if (!(out->dn.scales = get(b, dns, "down_scales", n_rows * d * inter / 32, 0))) return -1;
    }
    return 0;
}

static PyObject *py_moe(PyObject *self, PyObject *args) {
    (void)self;
    int isa, kind;
    long long n_rows, d, inter, t, n_picks;
    float limit;
    PyObject *gu, *gus, *dn, *dns, *x, *rows, *tokens, *weights, *y;
    if (!PyArg_ParseTuple(args, "iiLLLLLOOOOOOOOfO", &isa, &kind, &n_rows, &d, &inter, &t,
                          &n_picks, &gu, &gus, &dn, &dns, &x, &rows, &tokens, &weights, &limit, &y))
        return NULL;
    if (t < 0 || n_picks < 0) return PyErr_Format(PyExc_ValueError, "moe: bad dimensions");
    Buffers b = {.n = 0};
    tj_pool pool_;
    /* rows are absolute here: the pool's experts a layer (1) is not used */
    if (pool_from_args(&b, &pool_, "moe", isa, kind, n_rows, 1, d, inter, gu, gus, dn, dns))
        goto fail;
    Work w = {.gu = pool_.gu, .dn = pool_.dn, .d = d, .inter = inter, .limit = limit,
              .mx = kind == KIND_MXFP4, .dot = DOT_ROWS_BY_ISA[isa], .n_picks = (int)n_picks,
              .t = t};
    if (!(w.x = get(&b, x, "x", t * d * 4, 0))) goto fail;
    if (!(w.rows = get(&b, rows, "rows", n_picks * 8, 0))) goto fail;
    if (!(w.tokens = get(&b, tokens, "tokens", n_picks * 8, 0))) goto fail;
    if (!(w.weights = get(&b, weights, "weights", n_picks * 4, 0))) goto fail;
    if (!(w.y = get(&b, y, "y", t * d * 4, 1))) goto fail;
    for (int64_t p = 0; p < n_picks; p++) {
        if (w.rows[p] < 0 || w.rows[p] >= n_rows || w.tokens[p] < 0 || w.tokens[p] >= t) {
            PyErr_Format(PyExc_ValueError, "moe: pick %lld (row %lld, token %lld) is out of range",
                         (long long)p, (long long)w.rows[p], (long long)w.tokens[p]);
            goto fail;
        }
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = moe_run(&w);
    Py_END_ALLOW_THREADS
    release_all(&b);
    if (err) {
        PyErr_SetString(PyExc_RuntimeError, MOE_ERRORS[err]);
        return NULL;
    }
    return PyLong_FromLong(w.n_experts);
fail:
    release_all(&b);
    return NULL;
}

/* set_pool: the pool's leaves registered for the FFI handlers, read in place (the caller keeps
   them alive and unmoved for as long as a compiled step names the handle). */
static PyObject *py_set_pool(PyObject *self, PyObject *args) {
    (void)self;
    int isa, kind;
    long long n_rows, n_experts, d, inter;
    PyObject *gu, *gus, *dn, *dns;
    if (!PyArg_ParseTuple(args, "iiLLLLOOOO", &isa, &kind, &n_rows, &n_experts, &d, &inter, &gu,
                          &gus, &dn, &dns))
        return NULL;
    int handle = atomic_load(&n_pools);
    if (handle >= TJ_MAX_POOLS)
        return PyErr_Format(PyExc_RuntimeError, "set_pool: more than %d pools", TJ_MAX_POOLS);
    Buffers b = {.n = 0};
    int bad = pool_from_args(&b, &POOLS[handle], "set_pool", isa, kind, n_rows, n_experts, d,
                             inter, gu, gus, dn, dns);
    release_all(&b);
    if (bad) return NULL;
    atomic_store(&n_pools, handle + 1);
    return PyLong_FromLong(handle);
}

static PyObject *py_pool_picks(PyObject *self, PyObject *args) {
    (void)self;
    long long handle;
    if (!PyArg_ParseTuple(args, "L", &handle)) return NULL;
    tj_pool *pool_ = tj_pool_get(handle);
    if (!pool_) return PyErr_Format(PyExc_ValueError, "pool_picks: no pool %lld", handle);
    return PyLong_FromLongLong(__atomic_load_n(&pool_->picks, __ATOMIC_RELAXED));
}

/* The CPU platform's XLA FFI handler as a capsule, or None where it is not built. */
static PyObject *py_ffi_handler(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    if (!TJ_FFI_CPU_HANDLER) Py_RETURN_NONE;
    return PyCapsule_New(TJ_FFI_CPU_HANDLER, NULL, NULL);
}

#ifdef TJ_NO_FFI /* built without XLA's FFI headers (setup.py): no handler */
void *const TJ_FFI_CPU_HANDLER = NULL;
#endif

static PyObject *py_best_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(ISA_NAMES[best_isa()]);
}

static PyObject *py_threads(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(pool.n ? pool.n : pool_size());
}

static PyMethodDef METHODS[] = {
    {"moe", py_moe, METH_VARARGS,
     "moe(isa, kind, n_rows, D, I, T, P, gate_up, gate_up_scales, down, down_scales, x, rows, "
     "tokens, weights, swiglu_limit, y) -> distinct experts computed; y [T, D] float32 is "
     "overwritten with the picks' weighted sum"},
    {"set_pool", py_set_pool, METH_VARARGS,
     "set_pool(isa, kind, n_rows, n_experts, D, I, gate_up, gate_up_scales, down, down_scales) "
     "-> the handle the FFI handlers take (the buffers are read in place, later)"},
    {"pool_picks", py_pool_picks, METH_VARARGS, "pool_picks(handle) -> picks computed from it"},
    {"ffi_handler", py_ffi_handler, METH_NOARGS,
     "the CPU platform's XLA FFI handler (a capsule), or None where built without XLA's headers"},
    {"best_isa", py_best_isa, METH_NOARGS, "the widest ISA this CPU runs: avx512, avx2 or scalar"},
    {"threads", py_threads, METH_NOARGS, "the threads moe() runs on (the process's CPUs but one)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_cpu_kernel",
                                    "The cpu miss policy's host kernel (see cpu_kernel.c).", -1,
                                    METHODS};

PyMODINIT_FUNC PyInit__cpu_kernel(void) {
    for (int s = 0; s < 255; s++) SCALE[s] = ldexpf(1.0f, s - 127);
    SCALE[255] = NAN;
    return PyModule_Create(&MODULE);
}
