/* Paged GQA decode attention for one query row on the CPU, read in place from the worker's block cache.
 *
 * The CPU path of the paged_decode family (reference.py is its ground truth; cpu.py builds this file with the
 * machine's C compiler at start, checks it against the reference and loads it with ctypes). Layout as reference.py:
 *   k_cache, v_cache  [NB, BS, Hkv, D], bf16 or fp32, contiguous
 *   table             int32 block table of the row; its first ceil(n / BS) entries are used
 *   q, out            [Hq, D], bf16 or fp32 (out in q's dtype), Hq = G * Hkv; query head h reads kv head h / G
 * Math in fp32: scores q.k * scale, an exact (two-pass) softmax, then P.V. Two passes over each kv head's keys, then
 * its values, block by block through the table, so no gather or concatenation of the past is made.
 *
 * Why it exists (#18): a one-session decode step at 1k-8k cached tokens spent more in torch's CPU flash-attention
 * call (built for many query rows: small GEMMs per 512-key split, buffers per call) than in all its matmuls;
 * docs/cell-benchmarks.md has the figures. Served only by the recomputing decode step (MODELD_DECODED_KV), whose K/V
 * are computed again by the next prefill, so its rounding (another summation order than a prefill's) never reaches a
 * reused K/V.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_HD 4096 /* Hq * D */
#define MAX_G 8     /* query heads per kv head, AVX-512 path */

#if defined(__AVX2__) && defined(__FMA__)
/* 2^x for x <= 0, lane-wise: 2^n 2^f, n = round(x), |f| <= 1/2, Cephes exp2f's degree-6 polynomial (relative error
 * about 2e-7); below -126 it is 2^-126, never 0 (callers zero masked lanes themselves) */
static inline __m256 pa_exp2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(x, n);
    __m256 y = _mm256_set1_ps(1.535336188319500e-4f);
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.339887440266574e-3f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.618437357674640e-3f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.550332471162809e-2f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.402264791363012e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.931472028550421e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float pa_hmax(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

static inline float pa_hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

#endif

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* softmax numerators in place over s[0..n): their max in *m, their sum returned */
static float exp_range(float *s, int64_t n, float *m) {
    float mx = -FLT_MAX, a = 0.f;
    for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    for (int64_t t = 0; t < n; t++) {
        float e = expf(s[t] - mx);
        s[t] = e;
        a += e;
    }
    *m = mx;
    return a;
}

/* Portable C for any head shape (the compiler vectorizes what it can). s: [Hq, n] scratch. */
static void row_portable(const void *q, void *out, const void *kc, const void *vc, const int32_t *table, int64_t n,
                         int64_t bs, int hq, int hkv, int d, float scale, int kv_bf16, int q_bf16, float *s) {
    const int g = hq / hkv;
    const int64_t ts = (int64_t)hkv * d, nblk = (n + bs - 1) / bs;
    float qf[MAX_HD], row[MAX_HD], of[MAX_HD], inv[MAX_HD];
    for (int j = 0; j < hq * d; j++) qf[j] = load1(q, j, q_bf16) * scale;
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t t0 = b * bs, len = n - t0 < bs ? n - t0 : bs, base = (int64_t)table[b] * bs * ts;
        for (int64_t j = 0; j < len; j++) {
            for (int64_t i = 0; i < ts; i++) row[i] = load1(kc, base + j * ts + i, kv_bf16);
            for (int r = 0; r < hq; r++) {
                const float *kh = row + (r / g) * d, *qr = qf + r * d;
                float acc = 0.f;
                for (int i = 0; i < d; i++) acc += qr[i] * kh[i];
                s[(int64_t)r * n + t0 + j] = acc;
            }
        }
    }
    for (int r = 0; r < hq; r++) {
        float mx;
        inv[r] = 1.f / exp_range(s + (int64_t)r * n, n, &mx);
    }
    memset(of, 0, sizeof(float) * hq * d);
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t t0 = b * bs, len = n - t0 < bs ? n - t0 : bs, base = (int64_t)table[b] * bs * ts;
        for (int64_t j = 0; j < len; j++) {
            for (int64_t i = 0; i < ts; i++) row[i] = load1(vc, base + j * ts + i, kv_bf16);
            for (int r = 0; r < hq; r++) {
                const float p = s[(int64_t)r * n + t0 + j], *vh = row + (r / g) * d;
                float *o = of + r * d;
                for (int i = 0; i < d; i++) o[i] += p * vh[i];
            }
        }
    }
    for (int r = 0; r < hq; r++)
        for (int i = 0; i < d; i++) store1(out, (int64_t)r * d + i, of[r * d + i] * inv[r], q_bf16);
}

#if defined(__AVX512F__)
static inline __m512 load16(const void *p, int64_t off, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + off))), 16));
    return _mm512_loadu_ps((const float *)p + off);
}

/* AVX-512, D a multiple of 16 up to 256, G up to MAX_G: the blocks [b_lo, b_hi) of the row's table, one kv head at a
 * time, its G query rows in registers. Writes each query head's unnormalised P.V (o [Hq, D] fp32), the max of its
 * scores (m [Hq]) and the sum of its numerators (l [Hq]): a whole row is one range, normalised by l; a row split
 * over threads merges its ranges' (o, m, l) exactly as an LSE merge does. s: [Hq, n] scratch (columns of the range). */
static inline __attribute__((always_inline)) void
range_avx512(const void *q, const void *kc, const void *vc, const int32_t *table, int64_t n, int64_t bs,
             const int hq, const int hkv, const int d, float scale, int kv_bf16, int q_bf16, float *s, int64_t b_lo,
             int64_t b_hi, float *o_out, float *m_out, float *l_out) {
    const int g = hq / hkv, nv = d / 16;
    const int64_t ts = (int64_t)hkv * d, nblk = (n + bs - 1) / bs, esz = kv_bf16 ? 2 : 4;
    const int64_t t_lo = b_lo * bs, t_hi = (b_hi * bs < n ? b_hi * bs : n);
    for (int h = 0; h < hkv; h++) {
        __m512 qv[MAX_G][16], o[MAX_G][16];
        for (int r = 0; r < g; r++)
            for (int c = 0; c < nv; c++)
                qv[r][c] = _mm512_mul_ps(load16(q, (int64_t)(h * g + r) * d + c * 16, q_bf16), _mm512_set1_ps(scale));
        for (int64_t b = b_lo; b < b_hi; b++) {
            const int64_t t0 = b * bs, len = n - t0 < bs ? n - t0 : bs;
            const int64_t base = (int64_t)table[b] * bs * ts + (int64_t)h * d;
            if (b + 1 < nblk) /* the next block is elsewhere in the pool: start its first row early */
                _mm_prefetch((const char *)kc + ((int64_t)table[b + 1] * bs * ts + (int64_t)h * d) * esz, _MM_HINT_T0);
            for (int64_t j = 0; j < len; j++) {
                __m512 kr[16];
                for (int c = 0; c < nv; c++) kr[c] = load16(kc, base + j * ts + c * 16, kv_bf16);
                for (int r = 0; r < g; r++) {
                    __m512 acc = _mm512_mul_ps(qv[r][0], kr[0]);
                    for (int c = 1; c < nv; c++) acc = _mm512_fmadd_ps(qv[r][c], kr[c], acc);
                    s[(int64_t)r * n + t0 + j] = _mm512_reduce_add_ps(acc);
                }
            }
        }
        for (int r = 0; r < g; r++)
            l_out[h * g + r] = exp_range(s + (int64_t)r * n + t_lo, t_hi - t_lo, m_out + h * g + r);
        for (int r = 0; r < g; r++)
            for (int c = 0; c < nv; c++) o[r][c] = _mm512_setzero_ps();
        for (int64_t b = b_lo; b < b_hi; b++) {
            const int64_t t0 = b * bs, len = n - t0 < bs ? n - t0 : bs;
            const int64_t base = (int64_t)table[b] * bs * ts + (int64_t)h * d;
            if (b + 1 < nblk)
                _mm_prefetch((const char *)vc + ((int64_t)table[b + 1] * bs * ts + (int64_t)h * d) * esz, _MM_HINT_T0);
            for (int64_t j = 0; j < len; j++) {
                __m512 vr[16];
                for (int c = 0; c < nv; c++) vr[c] = load16(vc, base + j * ts + c * 16, kv_bf16);
                for (int r = 0; r < g; r++) {
                    const __m512 p = _mm512_set1_ps(s[(int64_t)r * n + t0 + j]);
                    for (int c = 0; c < nv; c++) o[r][c] = _mm512_fmadd_ps(p, vr[c], o[r][c]);
                }
            }
        }
        for (int r = 0; r < g; r++)
            for (int c = 0; c < nv; c++) _mm512_storeu_ps(o_out + (int64_t)(h * g + r) * d + c * 16, o[r][c]);
    }
}

static void range_any(const void *q, const void *kc, const void *vc, const int32_t *table, int64_t n, int64_t bs,
                      int hq, int hkv, int d, float scale, int kv_bf16, int q_bf16, float *s, int64_t b_lo,
                      int64_t b_hi, float *o, float *m, float *l) {
    if (d == 64) /* SmolLM2 and most small models: the loops unrolled */
        range_avx512(q, kc, vc, table, n, bs, hq, hkv, 64, scale, kv_bf16, q_bf16, s, b_lo, b_hi, o, m, l);
    else
        range_avx512(q, kc, vc, table, n, bs, hq, hkv, d, scale, kv_bf16, q_bf16, s, b_lo, b_hi, o, m, l);
}

static int range_takes(int hq, int hkv, int d) { return d % 16 == 0 && d <= 256 && hq / hkv <= MAX_G; }
#define HAVE_RANGE 1
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 + FMA (no AVX-512): range_avx512's contract, 8 lanes. Scores 8 keys at a time (one accumulator a key over D,
 * reduced by a transposing add), the probabilities' P.V over a slab of SW 8-lane chunks of D for the G rows at a time
 * (G * SW accumulators in registers). */
static inline __m256 load8(const void *p, int64_t off, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + off))), 16));
    return _mm256_loadu_ps((const float *)p + off);
}

/* lane i: the sum of a[i]'s 8 lanes */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* o[r][c0 .. c0 + SW) (8-lane chunks of D) = sum over the range's tokens of p[r][t] v[t], G rows */
static inline __attribute__((always_inline)) void pv_slab(const int G, const int SW, const void *vc,
                                                         const int32_t *table, int64_t bs, int64_t ts, int64_t hoff,
                                                         int64_t t_lo, int64_t t_hi, const float *s, int64_t n, int c0,
                                                         int kv_bf16, float *o, int d) {
    __m256 acc[8][12];
    for (int r = 0; r < G; r++)
        for (int c = 0; c < SW; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t t = t_lo; t < t_hi; t++) {
        const int64_t base = ((int64_t)table[t / bs] * bs + t % bs) * ts + hoff + 8 * c0;
        __m256 v[12];
        for (int c = 0; c < SW; c++) v[c] = load8(vc, base + 8 * c, kv_bf16);
        for (int r = 0; r < G; r++) {
            const __m256 p = _mm256_broadcast_ss(s + (int64_t)r * n + t);
            for (int c = 0; c < SW; c++) acc[r][c] = _mm256_fmadd_ps(p, v[c], acc[r][c]);
        }
    }
    for (int r = 0; r < G; r++)
        for (int c = 0; c < SW; c++) _mm256_storeu_ps(o + (int64_t)r * d + 8 * (c0 + c), acc[r][c]);
}

static void range_avx2(const void *q, const void *kc, const void *vc, const int32_t *table, int64_t n, int64_t bs,
                       int hq, int hkv, int d, float scale, int kv_bf16, int q_bf16, float *s, int64_t b_lo,
                       int64_t b_hi, float *o_out, float *m_out, float *l_out) {
    const int g = hq / hkv, nv = d / 8;
    const int64_t ts = (int64_t)hkv * d;
    const int64_t t_lo = b_lo * bs, t_hi = (b_hi * bs < n ? b_hi * bs : n);
    const int sw = g * 4 <= 12 && nv % 4 == 0 ? 4 : g * 2 <= 12 && nv % 2 == 0 ? 2 : 1;
    float qf[MAX_G * 256] __attribute__((aligned(32)));
    for (int h = 0; h < hkv; h++) {
        for (int r = 0; r < g; r++)
            for (int i = 0; i < d; i++) qf[r * d + i] = load1(q, (int64_t)(h * g + r) * d + i, q_bf16) * scale;
        for (int64_t t = t_lo; t < t_hi; t += 8) {
            const int nk = t_hi - t < 8 ? (int)(t_hi - t) : 8;
            int64_t base[8];
            for (int j = 0; j < nk; j++)
                base[j] = ((int64_t)table[(t + j) / bs] * bs + (t + j) % bs) * ts + (int64_t)h * d;
            for (int r = 0; r < g; r++) {
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int c = 0; c < nv; c++) {
                    const __m256 qv = _mm256_load_ps(qf + r * d + 8 * c);
                    for (int j = 0; j < nk; j++) acc[j] = _mm256_fmadd_ps(qv, load8(kc, base[j] + 8 * c, kv_bf16), acc[j]);
                }
                float sums[8] __attribute__((aligned(32)));
                _mm256_store_ps(sums, hsum8x8(acc));
                for (int j = 0; j < nk; j++) s[(int64_t)r * n + t + j] = sums[j];
            }
        }
        for (int r = 0; r < g; r++)
            l_out[h * g + r] = exp_range(s + (int64_t)r * n + t_lo, t_hi - t_lo, m_out + h * g + r);
        float *o = o_out + (int64_t)h * g * d;
        for (int c0 = 0; c0 < nv; c0 += sw) {
#define SLAB(G, SW) pv_slab(G, SW, vc, table, bs, ts, (int64_t)h * d, t_lo, t_hi, s, n, c0, kv_bf16, o, d)
            switch (g * 16 + sw) { /* the compiler unrolls each (rows, slab) pair */
            case 1 * 16 + 4: SLAB(1, 4); break;
            case 2 * 16 + 4: SLAB(2, 4); break;
            case 3 * 16 + 4: SLAB(3, 4); break;
            case 1 * 16 + 2: SLAB(1, 2); break;
            case 2 * 16 + 2: SLAB(2, 2); break;
            case 3 * 16 + 2: SLAB(3, 2); break;
            case 4 * 16 + 2: SLAB(4, 2); break;
            case 5 * 16 + 2: SLAB(5, 2); break;
            case 6 * 16 + 2: SLAB(6, 2); break;
            default: SLAB(g, 1); break;
            }
#undef SLAB
        }
    }
}

/* AVX2 + FMA, D a multiple of 16: range_avx2's contract, 2.7-3.1x faster here on a row of SmolLM2's shape after 1k-4k
 * bf16 keys (#18; docs/kernels.md: range_avx2 read each key once per query row, divided per key to find its block and
 * took a scalar expf per score). A block at a time, every kv head's keys of the block while they are in L1, the next
 * block's lines asked for a few at a time while this one is computed. A 16-element chunk of D is one 256-bit
 * load of bf16 (the even elements: the low halves shifted up; the odd: the high halves masked) or two of fp32, and the
 * query rows and output accumulators are kept in that element order. Scores in log2 units, exponentials by pa_exp2.
 * Its sums run in another order than range_avx2's: the recomputing step's rounding, never a reused K/V's. */
#define R16_MAX_HD 2048 /* Hq * D it takes */
static inline __attribute__((always_inline)) void r16_chunk(const void *p, int64_t off, int bf16, __m256 *lo,
                                                            __m256 *hi) {
    if (bf16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + off));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        *lo = _mm256_loadu_ps((const float *)p + off);
        *hi = _mm256_loadu_ps((const float *)p + off + 8);
    }
}

/* asks for the lines of ``keys`` keys' d elements (esz bytes each) at elements off, off + ts, ...: the next block's
 * keys (elsewhere in the pool) a block ahead, a few at a time (asking for a whole block at once stalled the loop) */
static inline void r16_prefetch(const void *p, int64_t off, int64_t keys, int64_t ts, int d, int64_t esz) {
    for (int64_t x = 0; x < keys; x++)
        for (int64_t y = 0; y < d * esz; y += 64) _mm_prefetch((const char *)p + (off + x * ts) * esz + y, _MM_HINT_T0);
}

/* where element i of a row lives in the chunked order: chunk i / 16, then the lo half (bf16: even; fp32: first 8) */
static inline int r16_slot(int i, int bf16) {
    const int c = i / 16, k = i % 16;
    return 16 * c + (bf16 ? (k % 2) * 8 + k / 2 : k);
}

/* s[r * n + j] = q[r] . k[j] for R rows (q chunked, stride d) and the nk <= 4 keys at off + j * ts */
static inline __attribute__((always_inline)) void r16_qk(const int R, const float *q, int d, const void *kc,
                                                         int64_t off, int64_t ts, int nk, int bf16, float *s,
                                                         int64_t n) {
    __m256 acc[3][4];
    int64_t at[4];
    for (int j = 0; j < 4; j++) at[j] = off + (int64_t)(j < nk ? j : nk - 1) * ts;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 16)
        for (int j = 0; j < 4; j++) {
            __m256 lo, hi;
            r16_chunk(kc, at[j] + c, bf16, &lo, &hi);
            for (int r = 0; r < R; r++) {
                acc[r][j] = _mm256_fmadd_ps(lo, _mm256_load_ps(q + r * d + c), acc[r][j]);
                acc[r][j] = _mm256_fmadd_ps(hi, _mm256_load_ps(q + r * d + c + 8), acc[r][j]);
            }
        }
    for (int r = 0; r < R; r++) {
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
        float four[4];
        _mm_storeu_ps(four, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
        for (int j = 0; j < nk; j++) s[(int64_t)r * n + j] = four[j];
    }
}

/* o[r][c .. c + 16) += sum_j s[r * n + j] v[j][c .. c + 16), R rows, the len keys at off + j * ts */
static inline __attribute__((always_inline)) void r16_pv(const int R, float *o, int d, const void *vc, int64_t off,
                                                         int64_t ts, int64_t len, int c, int bf16, const float *s,
                                                         int64_t n) {
    __m256 acc[3][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = _mm256_load_ps(o + r * d + c);
        acc[r][1] = _mm256_load_ps(o + r * d + c + 8);
    }
    for (int64_t j = 0; j < len; j++) {
        __m256 lo, hi;
        r16_chunk(vc, off + j * ts + c, bf16, &lo, &hi);
        for (int r = 0; r < R; r++) {
            const __m256 p = _mm256_broadcast_ss(s + (int64_t)r * n + j);
            acc[r][0] = _mm256_fmadd_ps(p, lo, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(p, hi, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_store_ps(o + r * d + c, acc[r][0]);
        _mm256_store_ps(o + r * d + c + 8, acc[r][1]);
    }
}

/* 2^(s - m) in place over s[0 .. len) (m: their max, found here), their sum returned */
static float r16_exp2(float *s, int64_t len, float *m) {
    __m256 mx = _mm256_set1_ps(-FLT_MAX);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
    float mm = pa_hmax(mx);
    for (int64_t u = t; u < len; u++) mm = s[u] > mm ? s[u] : mm;
    const __m256 mv = _mm256_set1_ps(mm);
    __m256 sum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
        const __m256 e = pa_exp2(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float a = pa_hsum(sum);
    if (t < len) { /* the tail through a padded copy */
        float tail[8] __attribute__((aligned(32)));
        for (int u = 0; u < 8; u++) tail[u] = t + u < len ? s[t + u] : mm;
        _mm256_store_ps(tail, pa_exp2(_mm256_sub_ps(_mm256_load_ps(tail), mv)));
        for (int64_t u = t; u < len; u++) {
            s[u] = tail[u - t];
            a += tail[u - t];
        }
    }
    *m = mm;
    return a;
}

static void range_avx2_16(const void *q, const void *kc, const void *vc, const int32_t *table, int64_t n, int64_t bs,
                          int hq, int hkv, int d, float scale, int kv_bf16, int q_bf16, float *s, int64_t b_lo,
                          int64_t b_hi, float *o_out, float *m_out, float *l_out) {
    const int g = hq / hkv;
    const int64_t ts = (int64_t)hkv * d, nblk = (n + bs - 1) / bs, esz = kv_bf16 ? 2 : 4;
    const int64_t t_lo = b_lo * bs, t_hi = (b_hi * bs < n ? b_hi * bs : n);
    const float qs = scale * 1.44269504088896341f; /* log2 units */
    float qf[R16_MAX_HD] __attribute__((aligned(32))), oa[R16_MAX_HD] __attribute__((aligned(32)));
    for (int r = 0; r < hq; r++)
        for (int i = 0; i < d; i++) {
            qf[r * d + r16_slot(i, kv_bf16)] = load1(q, (int64_t)r * d + i, q_bf16) * qs;
            oa[r * d + i] = 0.f;
        }
#define R16_GROUPS(BODY)                                                                                             \
    for (int h = 0; h < hkv; h++)                                                                                    \
        for (int r0 = 0; r0 < g; r0 += 3) {                                                                          \
            const int row = h * g + r0, nr = g - r0 < 3 ? g - r0 : 3;                                                \
            const int64_t hoff = base + (int64_t)h * d;                                                              \
            BODY                                                                                                     \
        }
    for (int64_t b = b_lo; b < b_hi; b++) {
        const int64_t t0 = b * bs, len = n - t0 < bs ? n - t0 : bs, base = (int64_t)table[b] * bs * ts;
        const int64_t next = b + 1 < nblk ? (int64_t)table[b + 1] * bs * ts : -1;
        R16_GROUPS(for (int64_t j = 0; j < len; j += 4) {
            const int nk = len - j < 4 ? (int)(len - j) : 4;
            if (next >= 0 && r0 == 0) r16_prefetch(kc, next + j * ts + (int64_t)h * d, nk, ts, d, esz);
            float *sr = s + (int64_t)row * n + t0 + j;
            const float *qr = qf + row * d;
            if (nr == 3) r16_qk(3, qr, d, kc, hoff + j * ts, ts, nk, kv_bf16, sr, n);
            else if (nr == 2) r16_qk(2, qr, d, kc, hoff + j * ts, ts, nk, kv_bf16, sr, n);
            else r16_qk(1, qr, d, kc, hoff + j * ts, ts, nk, kv_bf16, sr, n);
        })
    }
    for (int r = 0; r < hq; r++) {
        float m2;
        l_out[r] = r16_exp2(s + (int64_t)r * n + t_lo, t_hi - t_lo, &m2);
        m_out[r] = m2 * 0.69314718055994531f; /* the contract's natural units */
    }
    for (int64_t b = b_lo; b < b_hi; b++) {
        const int64_t t0 = b * bs, len = n - t0 < bs ? n - t0 : bs, base = (int64_t)table[b] * bs * ts;
        const int64_t next = b + 1 < nblk ? (int64_t)table[b + 1] * bs * ts : -1;
        R16_GROUPS(for (int c = 0; c < d; c += 16) {
            float *orow = oa + row * d;
            if (next >= 0 && r0 == 0 && c == 0) r16_prefetch(vc, next + (int64_t)h * d, len, ts, d, esz);
            const float *sr = s + (int64_t)row * n + t0;
            if (nr == 3) r16_pv(3, orow, d, vc, hoff, ts, len, c, kv_bf16, sr, n);
            else if (nr == 2) r16_pv(2, orow, d, vc, hoff, ts, len, c, kv_bf16, sr, n);
            else r16_pv(1, orow, d, vc, hoff, ts, len, c, kv_bf16, sr, n);
        })
    }
#undef R16_GROUPS
    for (int r = 0; r < hq; r++)
        for (int i = 0; i < d; i++) o_out[(int64_t)r * d + i] = oa[r * d + r16_slot(i, kv_bf16)];
}

static void range_any(const void *q, const void *kc, const void *vc, const int32_t *table, int64_t n, int64_t bs,
                      int hq, int hkv, int d, float scale, int kv_bf16, int q_bf16, float *s, int64_t b_lo,
                      int64_t b_hi, float *o, float *m, float *l) {
    if (d % 16 == 0 && (int64_t)hq * d <= R16_MAX_HD)
        range_avx2_16(q, kc, vc, table, n, bs, hq, hkv, d, scale, kv_bf16, q_bf16, s, b_lo, b_hi, o, m, l);
    else
        range_avx2(q, kc, vc, table, n, bs, hq, hkv, d, scale, kv_bf16, q_bf16, s, b_lo, b_hi, o, m, l);
}

static int range_takes(int hq, int hkv, int d) { return d % 8 == 0 && d <= 256 && hq / hkv <= MAX_G; }
#define HAVE_RANGE 1
#endif

/* 1 where this build has the AVX-512 path, 2 the AVX2 one, else 0 (the capability report names which path serves) */
int modeld_paged_decode_isa(void) {
#if defined(__AVX512F__)
    return 1;
#elif defined(HAVE_RANGE)
    return 2;
#else
    return 0;
#endif
}

/* One decode row: 0 done; 1 a shape this build does not take; 2 out of memory. */
int modeld_paged_decode(const void *q, void *out, const void *k_cache, const void *v_cache, const int32_t *table,
                        int64_t n, int64_t bs, int hq, int hkv, int d, float scale, int kv_bf16, int q_bf16) {
    if (n < 1 || bs < 1 || hkv < 1 || d < 1 || hq % hkv != 0 || (int64_t)hq * d > MAX_HD) return 1;
    static __thread float *scratch = NULL; /* [Hq, n] scores, kept per thread between calls */
    static __thread int64_t cap = 0;
    const int64_t need = (int64_t)hq * n;
    if (need > cap) {
        float *p = (float *)realloc(scratch, sizeof(float) * (size_t)need);
        if (p == NULL) return 2;
        scratch = p;
        cap = need;
    }
#if defined(HAVE_RANGE)
    if (range_takes(hq, hkv, d)) {
        float o[MAX_HD], m[MAX_HD], l[MAX_HD];
        range_any(q, k_cache, v_cache, table, n, bs, hq, hkv, d, scale, kv_bf16, q_bf16, scratch, 0, (n + bs - 1) / bs,
                  o, m, l);
        for (int r = 0; r < hq; r++)
            for (int i = 0; i < d; i++) store1(out, (int64_t)r * d + i, o[(int64_t)r * d + i] * (1.f / l[r]), q_bf16);
        return 0;
    }
#endif
    row_portable(q, out, k_cache, v_cache, table, n, bs, hq, hkv, d, scale, kv_bf16, q_bf16, scratch);
    return 0;
}

/* ---- The recomputing decode step's layers, whole (#18) ----
 *
 * modeld_decode_layers runs every transformer layer of one session's decode row in one call: what decode_step.py's
 * decode_layers computes with exact=False and the kernel (RMSNorm, the fused q|k|v linear, RoPE, the K/V write, the
 * attention above, wo and the residual, RMSNorm, the fused gate|up linear, SwiGLU, w2 and the residual), with the
 * activations rounded to the compute dtype wherever the torch step rounds them. Why: the torch step is some 150 op
 * calls a layer, each a few microseconds of dispatch and allocation, and its one-row linears run oneDNN's GEMV,
 * which read bf16 weights at about half this CPU's single-thread memory bandwidth (docs/kernels.md). Here a row's
 * linears stream the plain [out, in] weights with prefetch, in fp32 sums (AVX512_BF16's dot products where the
 * build has them). Like the attention above, it serves only the recomputing step, whose K/V the next prefill
 * computes again: nothing reused ever holds its rounding.
 */

static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* y[o] = sum_k W[o, k] x[k] for o < N, fp32 sums. W row-major [N, K] and x [K] in one dtype (bf16 or fp32). */
static void gemv_portable(const void *W, const void *x, float *y, int N, int K, int bf16) {
    for (int o = 0; o < N; o++) {
        float acc = 0.f;
        for (int k = 0; k < K; k++) acc += load1(W, (int64_t)o * K + k, bf16) * load1(x, k, bf16);
        y[o] = acc;
    }
}

#if defined(__AVX512F__)
/* lane j of the result: the sum of v[j]'s 16 lanes (a transposing add tree) */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

/* bytes ahead of each weight load that the loop asks the memory for, one line per load, interleaved with the loads
 * (a burst of a group's lines at its start overran the CPU's queue of misses; measured: docs/kernels.md) */
#define GEMV_PREFETCH_BYTES 2048

/* One row's dot product with x, 16 or 32 elements a step (masked tail). */
static inline __attribute__((always_inline)) __m512 dot_row(const void *w, const void *x, int K, int bf16) {
    __m512 a = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (bf16) {
        int k = 0;
        for (; k + 32 <= K; k += 32) {
            _mm_prefetch((const char *)((const uint16_t *)w + k) + GEMV_PREFETCH_BYTES, _MM_HINT_T0);
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const uint16_t *)x + k),
                                 (__m512bh)_mm512_loadu_si512((const uint16_t *)w + k));
        }
        if (k < K) {
            const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1ull);
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)x + k),
                                 (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)w + k));
        }
        return a;
    }
#endif
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        _mm_prefetch((const char *)w + (int64_t)k * (bf16 ? 2 : 4) + GEMV_PREFETCH_BYTES, _MM_HINT_T0);
        a = _mm512_fmadd_ps(load16(w, k, bf16), load16(x, k, bf16), a);
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv, xv;
        if (bf16) {
            wv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k)), 16));
            xv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k)), 16));
        } else {
            wv = _mm512_maskz_loadu_ps(m, (const float *)w + k);
            xv = _mm512_maskz_loadu_ps(m, (const float *)x + k);
        }
        a = _mm512_fmadd_ps(wv, xv, a);
    }
    return a;
}

static void gemv_avx512(const void *W, const void *x, float *y, int N, int K, int bf16) {
    const int64_t esz = bf16 ? 2 : 4, row = (int64_t)K * esz;
    int o = 0;
    for (; o + 16 <= N; o += 16) {
        __m512 acc[16];
        const char *w0 = (const char *)W + (int64_t)o * row;
        for (int r = 0; r < 16; r++) acc[r] = dot_row(w0 + r * row, x, K, bf16);
        _mm512_storeu_ps(y + o, hsum16(acc));
    }
    for (; o < N; o++) y[o] = _mm512_reduce_add_ps(dot_row((const char *)W + (int64_t)o * row, x, K, bf16));
}
#endif

static void gemv(const void *W, const void *x, float *y, int N, int K, int bf16) {
#if defined(__AVX512F__)
    gemv_avx512(W, x, y, N, K, bf16);
#else
    gemv_portable(W, x, y, N, K, bf16);
#endif
}


/* ---- A pool of helper threads for the layer step's linears ----
 * A one-session decode step runs torch at one intra-op thread (runner.choose_decode_threads), so the other cores
 * idle while a row's linears stream their weights. The pool's helpers take a share of each linear's rows: they spin
 * between the calls of a step (microseconds apart) and sleep on a condition variable after SPIN_NS without work, so
 * a prefill's own threads have the cores to themselves. Started on first use in the calling process (a forked child
 * starts its own); one caller at a time (a second concurrent caller runs alone).
 */
#define MAX_THREADS 8
#define SPIN_NS 200000L

typedef void (*task_fn)(void *arg, int part, int parts);
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static atomic_uint pool_gen;
static atomic_int pool_pending;
static atomic_flag pool_busy = ATOMIC_FLAG_INIT;
static task_fn pool_fn;
static void *pool_arg;
static int pool_parts, pool_started; /* helpers running: made as callers ask for them, never more */
static pid_t pool_pid;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static unsigned pool_gen_at_start[MAX_THREADS]; /* the generation a helper was made in: it waits for the next */

static void *helper(void *p) {
    const int part = (int)(intptr_t)p;
    unsigned seen = pool_gen_at_start[part];
    for (;;) {
        const long t0 = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&pool_gen, memory_order_acquire) == seen) {
            if ((++spins & 63) == 0 && now_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&pool_mu);
                while (atomic_load(&pool_gen) == seen) pthread_cond_wait(&pool_cv, &pool_mu);
                pthread_mutex_unlock(&pool_mu);
                break;
            }
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        }
        seen = atomic_load(&pool_gen);
        if (part < pool_parts) pool_fn(pool_arg, part, pool_parts);
        atomic_fetch_sub_explicit(&pool_pending, 1, memory_order_release);
    }
    return NULL;
}

static int pool_start(int helpers) { /* at least this many helpers in this process; 0 when they run */
    if (pool_pid != getpid()) pool_started = 0; /* a forked child has none of its parent's threads */
    pool_pid = getpid();
    while (pool_started < helpers) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pool_gen_at_start[pool_started + 1] = atomic_load(&pool_gen);
        const int rc = pthread_create(&t, &at, helper, (void *)(intptr_t)(pool_started + 1));
        pthread_attr_destroy(&at);
        if (rc != 0) return 1;
        pool_started++;
    }
    return 0;
}

/* fn(arg, part, parts) for every part < parts, part 0 on the caller; parts 1 runs it inline. */
static void pool_run(task_fn fn, void *arg, int parts) {
    if (parts > MAX_THREADS) parts = MAX_THREADS; /* the helpers are parts 1 .. MAX_THREADS - 1 */
    if (parts <= 1 || atomic_flag_test_and_set(&pool_busy)) {
        for (int i = 0; i < (parts < 1 ? 1 : parts); i++) fn(arg, i, parts < 1 ? 1 : parts);
        return;
    }
    if (pool_start(parts - 1) != 0) {
        for (int i = 0; i < parts; i++) fn(arg, i, parts);
        atomic_flag_clear(&pool_busy);
        return;
    }
    pool_fn = fn;
    pool_arg = arg;
    pool_parts = parts;
    atomic_store(&pool_pending, pool_started);
    pthread_mutex_lock(&pool_mu);
    atomic_fetch_add_explicit(&pool_gen, 1, memory_order_release);
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    fn(arg, 0, parts);
    while (atomic_load_explicit(&pool_pending, memory_order_acquire) > 0) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
    atomic_flag_clear(&pool_busy);
}

typedef struct {
    const void *W, *x;
    float *y;
    int N, K, bf16;
} gemv_job;

static void gemv_part(void *p, int part, int parts) { /* rows in 16-row groups, split as evenly as groups allow */
    const gemv_job *j = (const gemv_job *)p;
    const int groups = (j->N + 15) / 16, lo = groups * part / parts * 16, hi0 = groups * (part + 1) / parts * 16;
    const int hi = hi0 < j->N ? hi0 : j->N;
    if (hi <= lo) return;
    const int64_t esz = j->bf16 ? 2 : 4;
    gemv((const char *)j->W + (int64_t)lo * j->K * esz, j->x, j->y + lo, hi - lo, j->K, j->bf16);
}

static void gemv_threads(const void *W, const void *x, float *y, int N, int K, int bf16, int threads) {
    gemv_job j = {W, x, y, N, K, bf16};
    pool_run(gemv_part, &j, threads);
}

typedef struct {
    const void *q, *kc, *vc;
    const int32_t *table;
    int64_t n, bs;
    int hq, hkv, d, kv_bf16, q_bf16;
    float scale, *s, *o, *m, *l; /* o [parts, Hq, D], m and l [parts, Hq] */
} attend_job;

#if defined(HAVE_RANGE)
static void attend_part(void *p, int part, int parts) { /* the row's blocks split in parts */
    const attend_job *j = (const attend_job *)p;
    const int64_t nblk = (j->n + j->bs - 1) / j->bs, lo = nblk * part / parts, hi = nblk * (part + 1) / parts;
    const int64_t hd = (int64_t)j->hq * j->d;
    range_any(j->q, j->kc, j->vc, j->table, j->n, j->bs, j->hq, j->hkv, j->d, j->scale, j->kv_bf16, j->q_bf16, j->s,
              lo, hi, j->o + part * hd, j->m + part * j->hq, j->l + part * j->hq);
}
#endif

#define ATTEND_MIN_BLOCKS 16 /* blocks a thread's share of a row must reach for the row to be split */

/* One decode row's attention with its keys split over up to ``threads`` threads, merged exactly (max, rescaled sums).
 * work: fp32 scratch of (Hq * n) + threads * Hq * (D + 2). Falls back to modeld_paged_decode where the AVX-512 loop
 * does not take the shape. */
static int attend_threads(const void *q, void *out, const void *kc, const void *vc, const int32_t *table, int64_t n,
                          int64_t bs, int hq, int hkv, int d, float scale, int kv_bf16, int q_bf16, int threads,
                          float *work) {
#if defined(HAVE_RANGE)
    const int64_t nblk = (n + bs - 1) / bs;
    int parts = threads;
    while (parts > 1 && nblk / parts < ATTEND_MIN_BLOCKS) parts--;
    if (range_takes(hq, hkv, d) && parts > 1) {
        const int64_t hd = (int64_t)hq * d;
        float *o = work + (int64_t)hq * n, *m = o + parts * hd, *l = m + (int64_t)parts * hq;
        attend_job j = {q, kc, vc, table, n, bs, hq, hkv, d, kv_bf16, q_bf16, scale, work, o, m, l};
        pool_run(attend_part, &j, parts);
        for (int r = 0; r < hq; r++) {
            float mx = -FLT_MAX, sum = 0.f;
            for (int p = 0; p < parts; p++) mx = m[p * hq + r] > mx ? m[p * hq + r] : mx;
            float f[MAX_THREADS];
            for (int p = 0; p < parts; p++) {
                f[p] = expf(m[p * hq + r] - mx);
                sum += l[p * hq + r] * f[p];
            }
            for (int i = 0; i < d; i++) {
                float acc = 0.f;
                for (int p = 0; p < parts; p++) acc += o[p * hd + (int64_t)r * d + i] * f[p];
                store1(out, (int64_t)r * d + i, acc * (1.f / sum), q_bf16);
            }
        }
        return 0;
    }
#endif
    (void)threads;
    (void)work;
    return modeld_paged_decode(q, out, kc, vc, table, n, bs, hq, hkv, d, scale, kv_bf16, q_bf16);
}

/* Exported for the self-check: y = W x as the layers' linears compute it (portable: the portable loop; threads as
 * modeld_decode_layers). */
void modeld_gemv(const void *W, const void *x, float *y, int N, int K, int bf16, int portable, int threads) {
    if (portable) gemv_portable(W, x, y, N, K, bf16);
    else gemv_threads(W, x, y, N, K, bf16, threads);
}

/* ---- Q4_1 blocks for the layer step's linears (#18) ----
 * A one-session decode step reads every weight once, so its time is the weights' bytes over the memory bandwidth:
 * dense fp32 SmolLM2 layers are 424 MB a token, their Q4_1 blocks 80 MB. Layout (a cell whose file stores its layers
 * in Q4_1, quantize.q4_1_blocks): qs [N, K/2] uint8, a 32-weight group's 16 bytes holding weight j in the low
 * nibble of byte j and weight j + 16 in its high nibble (GGUF's order); d, m [N, K/32] fp32; w = d * q + m. A row's
 * product is d . (q . x) + m . xs per group, xs the group's sum of x (computed once a call), in fp32 sums.
 */
#define Q4_GROUP 32

static void gemv_q4_portable(const uint8_t *qs, const float *dd, const float *mm, const float *x, const float *xs,
                             float *y, int N, int K) {
    const int ng = K / Q4_GROUP;
    for (int o = 0; o < N; o++) {
        const uint8_t *qr = qs + (int64_t)o * (K / 2);
        float acc = 0.f, macc = 0.f;
        for (int g = 0; g < ng; g++) {
            float t = 0.f;
            for (int j = 0; j < 16; j++) {
                const uint8_t b = qr[16 * g + j];
                t += (float)(b & 15) * x[32 * g + j] + (float)(b >> 4) * x[32 * g + 16 + j];
            }
            acc += dd[(int64_t)o * ng + g] * t;
            macc += mm[(int64_t)o * ng + g] * xs[g];
        }
        y[o] = acc + macc;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One 32-weight group's codes times x's group as 16-bit integers (xv: 2 x 16 int16), summed exactly in 8 int32
 * lanes: FMT 4, Q4_1's 16 bytes of nibbles (weight j low in byte j, weight j + 16 high); FMT 8, Q8_0's 32 signed
 * bytes. (|code x| <= 127 * 32767 and 4 of them a lane stay under 2^24: the lanes convert to fp32 exactly.) */
static inline __attribute__((always_inline)) __m256i group_dot16(const int FMT, const char *row, int g,
                                                                const __m256i xv[2]) {
    __m256i w0, w1;
    if (FMT == 4) {
        const __m128i low = _mm_set1_epi8(15), b = _mm_loadu_si128((const __m128i *)(row + 16 * g));
        w0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, low));
        w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low));
    } else {
        w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 32 * g)));
        w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 32 * g + 16)));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(w0, xv[0]), _mm256_madd_epi16(w1, xv[1]));
}

/* AVX2 + FMA (AVX-512 CPUs run it too), FMT as group_dot16, x as xrow16 gives it: y[o] = sum_g d[o,g] sx[g]
 * (codes . xq) (+ m[o,g] xs[g], Q4_1), two rows at a time sharing each group's x loads. */
static inline __attribute__((always_inline)) void gemv_blocks_avx2(const int FMT, const void *qs, const float *dd,
                                                                  const float *mm, const int16_t *xq,
                                                                  const float *sx, const float *xs, float *y, int N,
                                                                  int K) {
    const int ng = K / Q4_GROUP;
    const int64_t row = FMT == 4 ? K / 2 : K; /* bytes a row */
    for (int o = 0; o < N; o += 2) {
        const int two = o + 1 < N;
        const char *q0 = (const char *)qs + (int64_t)o * row, *q1 = two ? q0 + row : q0;
        const float *d0 = dd + (int64_t)o * ng, *d1 = two ? d0 + ng : d0;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int g = 0; g < ng; g++) {
            const __m256i xv[2] = {_mm256_loadu_si256((const __m256i *)(xq + Q4_GROUP * g)),
                                   _mm256_loadu_si256((const __m256i *)(xq + Q4_GROUP * g + 16))};
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_dot16(FMT, q0, g, xv)), _mm256_set1_ps(d0[g] * sx[g]), a0);
            if (two)
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_dot16(FMT, q1, g, xv)), _mm256_set1_ps(d1[g] * sx[g]),
                                     a1);
        }
        for (int r = 0; r <= two; r++) {
            float mt = 0.f;
            if (FMT == 4) {
                const float *mr = mm + (int64_t)(o + r) * ng;
                __m256 ma = _mm256_setzero_ps();
                int g = 0;
                for (; g + 8 <= ng; g += 8) ma = _mm256_fmadd_ps(_mm256_loadu_ps(mr + g), _mm256_loadu_ps(xs + g), ma);
                mt = hsum8(ma);
                for (; g < ng; g++) mt += mr[g] * xs[g];
            }
            y[o + r] = hsum8(r ? a1 : a0) + mt;
        }
    }
}

#endif

/* rows [lo, hi) of N for one part of parts: in pairs (the quantized loops' step), split as evenly as pairs allow */
static int pair_share(int N, int part, int parts, int *lo, int *hi) {
    const int pairs = (N + 1) / 2, h = pairs * (part + 1) / parts * 2;
    *lo = pairs * part / parts * 2;
    *hi = h < N ? h : N;
    return *hi > *lo;
}

/* ---- Q8_0 blocks for the head (#18) ----
 * A file that keeps its output head (SmolLM2: the tied embedding table) in Q8_0 serves the layer step's head from its
 * blocks: qs [N, K] int8, d [N, K/32] fp32, w = d * q (quantize.q8_0_blocks); 28 MB for SmolLM2 against 113 MB of
 * fp32. A row's product is the sum over groups of d . (q . x), fp32 sums.
 */
static void gemv_q8_portable(const int8_t *qs, const float *dd, const float *x, float *y, int N, int K) {
    const int ng = K / Q4_GROUP;
    for (int o = 0; o < N; o++) {
        const int8_t *qr = qs + (int64_t)o * K;
        float acc = 0.f;
        for (int g = 0; g < ng; g++) {
            float t = 0.f;
            for (int j = 0; j < Q4_GROUP; j++) t += (float)qr[Q4_GROUP * g + j] * x[Q4_GROUP * g + j];
            acc += dd[(int64_t)o * ng + g] * t;
        }
        y[o] = acc;
    }
}

/* A row as the quantized loops read it: x [K] fp32, each 32-group's sum xs (the Q4_1 m term) and, for the AVX2 loops,
 * the group in 16-bit fixed point: sx = max |x| / 32767 (1 for a zero group), xq = round(x / sx), so x is held to
 * within sx / 2, 2^-16 of the group's largest |x| (bf16 rounds to 2^-9 of each value). */
typedef struct {
    const float *x, *xs, *sx;
    const int16_t *xq;
} xrow;

/* floats of scratch xrow_prep needs for a K-row */
#define XROW_FLOATS(K) ((int64_t)(K) / 2 + 2 * ((int64_t)(K) / Q4_GROUP) + 16)

static xrow xrow_prep(const float *x, int K, float *scratch) {
    const int ng = K / Q4_GROUP;
    float *xs = scratch, *sx = xs + ng;
    int16_t *xq = (int16_t *)(sx + ng);
    for (int g = 0; g < ng; g++) {
        float sum = 0.f, mx = 0.f;
        for (int i = 0; i < Q4_GROUP; i++) {
            const float v = x[Q4_GROUP * g + i];
            sum += v;
            mx = fabsf(v) > mx ? fabsf(v) : mx;
        }
        xs[g] = sum;
        sx[g] = mx > 0.f ? mx / 32767.f : 1.f;
        const float inv = 1.f / sx[g];
        for (int i = 0; i < Q4_GROUP; i++) {
            const long c = lrintf(x[Q4_GROUP * g + i] * inv);
            xq[Q4_GROUP * g + i] = (int16_t)(c > 32767 ? 32767 : c < -32767 ? -32767 : c);
        }
    }
    return (xrow){x, xs, sx, xq};
}

typedef struct {
    const void *qs; /* Q4_1 (fmt 4) or Q8_0 (fmt 8) codes */
    const float *d, *m;
    xrow x;
    float *y;
    int N, K, fmt, portable;
} blocks_job;

static void blocks_part(void *p, int part, int parts) {
    const blocks_job *j = (const blocks_job *)p;
    int lo, hi;
    if (!pair_share(j->N, part, parts, &lo, &hi)) return;
    const int ng = j->K / Q4_GROUP;
    const char *qs = (const char *)j->qs + (int64_t)lo * (j->fmt == 4 ? j->K / 2 : j->K);
    const float *d = j->d + (int64_t)lo * ng, *m = j->m ? j->m + (int64_t)lo * ng : NULL;
#if defined(__AVX2__) && defined(__FMA__)
    if (!j->portable) {
        if (j->fmt == 4) gemv_blocks_avx2(4, qs, d, m, j->x.xq, j->x.sx, j->x.xs, j->y + lo, hi - lo, j->K);
        else gemv_blocks_avx2(8, qs, d, NULL, j->x.xq, j->x.sx, NULL, j->y + lo, hi - lo, j->K);
        return;
    }
#endif
    if (j->fmt == 4) gemv_q4_portable((const uint8_t *)qs, d, m, j->x.x, j->x.xs, j->y + lo, hi - lo, j->K);
    else gemv_q8_portable((const int8_t *)qs, d, j->x.x, j->y + lo, hi - lo, j->K);
}

/* y [N] = blocks of fmt (4: Q4_1 with m, 8: Q8_0) times x [K] fp32 (K a multiple of 32); scratch: XROW_FLOATS(K)
 * floats. */
static void gemv_blocks_threads(int fmt, const void *qs, const float *d, const float *m, const float *x,
                                float *scratch, float *y, int N, int K, int threads, int portable) {
    blocks_job j = {qs, d, m, xrow_prep(x, K, scratch), y, N, K, fmt, portable};
    pool_run(blocks_part, &j, threads);
}

/* Exported for the self-check: y = the blocks times x as the layer step computes them. 0 done, 1 K not a multiple of
 * 32, 2 out of memory. */
static int gemv_blocks_call(int fmt, const void *qs, const float *d, const float *m, const float *x, float *y, int N,
                            int K, int portable, int threads) {
    if (K % Q4_GROUP || N < 1) return 1;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)XROW_FLOATS(K));
    if (scratch == NULL) return 2;
    gemv_blocks_threads(fmt, qs, d, m, x, scratch, y, N, K, threads, portable);
    free(scratch);
    return 0;
}

int modeld_gemv_q8(const int8_t *qs, const float *d, const float *x, float *y, int N, int K, int portable,
                   int threads) {
    return gemv_blocks_call(8, qs, d, NULL, x, y, N, K, portable, threads);
}

/* 1 where this build has the AVX2 + FMA Q4_1 loop, else 0 */
int modeld_gemv_q4_isa(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

int modeld_gemv_q4(const uint8_t *qs, const float *d, const float *m, const float *x, float *y, int N, int K,
                   int portable, int threads) {
    return gemv_blocks_call(4, qs, d, m, x, y, N, K, portable, threads);
}

/* out[i] (compute dtype) = round(round(x[i] * rsqrt(mean(x^2) + eps)) * w[i]), as model.rms_norm */
static void rms_norm_row(const float *x, const void *w, void *out, int dim, float eps, int bf16) {
    float ss = 0.f;
    for (int i = 0; i < dim; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)dim + eps);
    for (int i = 0; i < dim; i++) store1(out, i, rnd(x[i] * r, bf16) * load1(w, i, bf16), bf16);
}

enum { L_ATTN_NORM, L_FFN_NORM, L_WQKV, L_WO, L_W13, L_W2, L_KC, L_VC, L_PTRS };
/* the same with Q4_1 linears: three pointers each (qs, d, m) */
enum { Q_ATTN_NORM, Q_FFN_NORM, Q_WQKV, Q_WO = Q_WQKV + 3, Q_W13 = Q_WO + 3, Q_W2 = Q_W13 + 3, Q_KC = Q_W2 + 3, Q_VC,
       Q_PTRS };

/* One of a layer's linears on the row act (compute dtype): dense (wfmt 0: P[dense], gemv) or Q4_1 (wfmt 1:
 * P[q4 .. q4 + 2], the row first widened to fp32 in xf, K + XROW_FLOATS(K) floats of scratch). */
static void layer_linear(void *const *P, int dense, int q4, int wfmt, const void *act, float *y, int N, int K, int bf16,
                         int threads, float *xf) {
    if (wfmt == 0) {
        gemv_threads(P[dense], act, y, N, K, bf16, threads);
        return;
    }
    for (int i = 0; i < K; i++) xf[i] = load1(act, i, bf16);
    gemv_blocks_threads(4, P[q4], (const float *)P[q4 + 1], (const float *)P[q4 + 2], xf, xf + K, y, N, K, threads,
                        0);
}

/* Every layer of one decode row. x [dim] fp32 in and out (values rounded to the compute dtype); ptrs: L_PTRS per
 * layer (norm weights and plain linear weights in the compute dtype, bf16 or fp32; each layer's K and V cache);
 * cos, ssin [D] fp32 (model.rope_rows of the position); slot: the token's flat slot in the caches; table, n, bs as
 * modeld_paged_decode; threads: the linears' rows split over this many threads (the pool's helpers; 1: this one);
 * wfmt 1: the linears are Q4_1 blocks (Q_PTRS a layer, each linear's qs, d, m; every input size a multiple of 32),
 * their input rows widened to fp32. Returns 0 done, 1 a shape it does not take, 2 out of memory. */
int modeld_decode_layers(float *x, void *const *ptrs, int n_layers, const float *cos, const float *ssin, int64_t slot,
                         const int32_t *table, int64_t n, int64_t bs, int dim, int hq, int hkv, int d, int inter,
                         float eps, float scale, int bf16, int kv_bf16, int threads, int wfmt) {
    if (n_layers < 1 || dim < 1 || inter < 1 || d < 2 || d % 2 || d > 1024 || hkv < 1 || hq % hkv ||
        (int64_t)hq * d > MAX_HD || wfmt < 0 || wfmt > 1 ||
        (wfmt == 1 && (dim % Q4_GROUP || inter % Q4_GROUP || (hq * d) % Q4_GROUP)))
        return 1;
    const int nqkv = (hq + 2 * hkv) * d, esz = bf16 ? 2 : 4, np = wfmt ? Q_PTRS : L_PTRS;
    const int kmax = dim > inter ? (dim > hq * d ? dim : hq * d) : (inter > hq * d ? inter : hq * d);
    const int64_t need = (int64_t)dim * 2 + nqkv + 2 * (int64_t)inter + (int64_t)hq * d + kmax + XROW_FLOATS(kmax);
    static __thread float *buf = NULL; /* fp32 scratch: h, y, qkv, gate|up */
    static __thread void *act = NULL;  /* one compute-dtype row, the linears' input */
    static __thread int64_t cap = 0;
    static __thread float *work = NULL; /* the attention's scratch (attend_threads) */
    static __thread int64_t work_cap = 0;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t work_need = (int64_t)hq * n + (int64_t)threads * hq * (d + 2);
    if (work_need > work_cap) {
        float *p = (float *)realloc(work, sizeof(float) * (size_t)work_need);
        if (p == NULL) return 2;
        work = p;
        work_cap = work_need;
    }
    if (need > cap) {
        float *p = (float *)realloc(buf, sizeof(float) * (size_t)need);
        if (p == NULL) return 2;
        buf = p;
        void *a = realloc(act, sizeof(float) * (size_t)need);
        if (a == NULL) return 2;
        act = a;
        cap = need;
    }
    float *h = buf, *y = h + dim, *qkv = y + dim, *gu = qkv + nqkv, *xf = gu + 2 * (int64_t)inter;
    for (int l = 0; l < n_layers; l++) {
        void *const *P = ptrs + (int64_t)l * np;
        rms_norm_row(x, P[L_ATTN_NORM], act, dim, eps, bf16); /* Q_ norms sit where L_ ones do */
        layer_linear(P, L_WQKV, Q_WQKV, wfmt, act, qkv, nqkv, dim, bf16, threads, xf);
        for (int i = 0; i < nqkv; i++) qkv[i] = rnd(qkv[i], bf16);
        for (int r = 0; r < hq + hkv; r++) { /* model.rope_rotate: x * cos + roll(x, D/2) * ssin, q and k heads */
            float *v = qkv + (int64_t)r * d, t[1024];
            for (int i = 0; i < d; i++) t[i] = v[i];
            for (int i = 0; i < d; i++) v[i] = rnd(t[i] * cos[i] + t[(i + d / 2) % d] * ssin[i], bf16);
        }
        char *kc = (char *)P[wfmt ? Q_KC : L_KC], *vc = (char *)P[wfmt ? Q_VC : L_VC];
        for (int i = 0; i < hkv * d; i++) { /* PagedKVCache.write of the row's k and v */
            store1(kc, slot * hkv * d + i, qkv[(int64_t)hq * d + i], kv_bf16);
            store1(vc, slot * hkv * d + i, qkv[(int64_t)(hq + hkv) * d + i], kv_bf16);
        }
        for (int i = 0; i < hq * d; i++) store1(act, i, qkv[i], bf16); /* q in the compute dtype */
        void *o = (char *)act + (int64_t)hq * d * esz;
        int rc = attend_threads(act, o, kc, vc, table, n, bs, hq, hkv, d, scale, kv_bf16, bf16, threads, work);
        if (rc) return rc;
        layer_linear(P, L_WO, Q_WO, wfmt, o, y, dim, hq * d, bf16, threads, xf);
        for (int i = 0; i < dim; i++) h[i] = rnd(x[i] + rnd(y[i], bf16), bf16);
        rms_norm_row(h, P[L_FFN_NORM], act, dim, eps, bf16);
        layer_linear(P, L_W13, Q_W13, wfmt, act, gu, 2 * inter, dim, bf16, threads, xf);
        for (int i = 0; i < inter; i++) { /* F.silu(gate) * up, each rounded as torch rounds it */
            const float g = rnd(gu[i], bf16), u = rnd(gu[inter + i], bf16);
            store1(act, i, rnd(g / (1.f + expf(-g)), bf16) * u, bf16);
        }
        layer_linear(P, L_W2, Q_W2, wfmt, act, y, dim, inter, bf16, threads, xf);
        for (int i = 0; i < dim; i++) x[i] = rnd(h[i] + rnd(y[i], bf16), bf16);
    }
    return 0;
}

/* ---- Causal prefill attention, each query row on its own (#18) ----
 *
 * T query rows at positions q0 .. q0 + T - 1 attend keys 0 .. their own position, read in place from the paged
 * cache (which already holds the new rows' keys). Row p's result is a function of p, its query and keys 0..p only:
 * keys go in blocks cut at absolute multiples of PA_KB; in each block the row's scores are fp32 FMA chains over D
 * (one lane a key), its keys past p are masked, and an online softmax (max, rescale, exp, sum in lane order) and a
 * P.V over exactly its own keys in key order update its state. Which other rows share a call, a tile or a thread
 * never enters a row's arithmetic, so a prompt prefilled in one call, in chunks cut anywhere or row by row gets the
 * same bits: chunking invariance by construction, where model._segmented_attention gets it from 512-key flash calls
 * and an LSE merge. AVX2 + FMA only (AVX-512 machines run the same loop); modeld_prefill_attention returns 1 where
 * the build or the shape is not taken and the caller keeps the segmented path.
 *
 * Work: (kv head, PA_TT-token tile) units, taken by the pool's threads from a shared counter, latest tiles first. A unit keeps its rows' query (scaled),
 * output, max and sum in scratch; for each key block it transposes the keys ([D][PA_KB]) and widens the values to
 * fp32 once, scores PA_ROWS rows at a time (2 x 8-key vectors x 6 rows of FMAs), then updates each row and
 * accumulates P.V for the G rows of one token (their keys are the same) three at a time over 32-float slabs of D.
 */
#define PA_KB 64
#define PA_TT 64
#define PA_ROWS 6
#define PA_MAXG 16

#if defined(__AVX2__) && defined(__FMA__)
/* s[slot][0 .. ng * 16) = qf[rows[slot]] . Kt[:, key]: PA_ROWS rows (a short tile repeats its last row) */
static void pa_scores(const float *const rows[PA_ROWS], const float *kt, int d, int ng, float *s) {
    for (int kg = 0; kg < ng; kg++) {
        __m256 acc[PA_ROWS][2];
        for (int r = 0; r < PA_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float *k = kt + kg * 16;
        for (int i = 0; i < d; i++) {
            const __m256 k0 = _mm256_load_ps(k + (int64_t)i * PA_KB), k1 = _mm256_load_ps(k + (int64_t)i * PA_KB + 8);
            for (int r = 0; r < PA_ROWS; r++) {
                const __m256 qb = _mm256_broadcast_ss(rows[r] + i);
                acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < PA_ROWS; r++) {
            _mm256_store_ps(s + r * PA_KB + kg * 16, acc[r][0]);
            _mm256_store_ps(s + r * PA_KB + kg * 16 + 8, acc[r][1]);
        }
    }
}

/* One row's online-softmax step over a block: s[0 .. valid) its scores (lanes past valid ignored), replaced by their
 * exponentials; *m, *l its running max and sum; returns the factor its output is rescaled by. */
/* One online-softmax step over a key block for NR rows of one token (the same keys; interleaved for the ILP, each
 * row's arithmetic its own): s[r][0 .. valid) the row's scores (lanes past valid ignored), replaced by their
 * exponentials; m[r], l[r] its running max and sum; a[r] the factor its output is rescaled by. */
static inline __attribute__((always_inline)) void pa_softmax(const int NR, float *const s[3], int valid, float *m,
                                                            float *l, float *a) {
    const __m256 low = _mm256_set1_ps(-FLT_MAX);
    __m256 acc[3], mv[3], keep[PA_KB / 8];
    const int nv = (valid + 7) / 8;
    if (valid < PA_KB) { /* a row's last block: lanes at and past valid masked (no infinities: built -ffinite-math-only) */
        const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
        for (int c = 0; c < nv; c++)
            keep[c] = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)(8 * c))),
                                    _mm256_set1_ps((float)valid), _CMP_LT_OQ);
    }
    for (int r = 0; r < NR; r++) {
        __m256 mx = low;
        if (valid == PA_KB)
            for (int c = 0; c < PA_KB / 8; c++) mx = _mm256_max_ps(mx, _mm256_load_ps(s[r] + 8 * c));
        else
            for (int c = 0; c < nv; c++)
                mx = _mm256_max_ps(mx, _mm256_blendv_ps(low, _mm256_load_ps(s[r] + 8 * c), keep[c]));
        const float bm = pa_hmax(mx);
        mv[r] = _mm256_set1_ps(bm > m[r] ? bm : m[r]);
        acc[r] = _mm256_setzero_ps();
    }
    for (int c = 0; c < nv; c++)
        for (int r = 0; r < NR; r++) {
            __m256 e = pa_exp2(_mm256_sub_ps(_mm256_load_ps(s[r] + 8 * c), mv[r]));
            if (valid < PA_KB) e = _mm256_and_ps(e, keep[c]); /* a masked lane is 0 whatever it held */
            _mm256_store_ps(s[r] + 8 * c, e);
            acc[r] = _mm256_add_ps(acc[r], e);
        }
    for (int r = 0; r < NR; r++) {
        const float mnew = _mm256_cvtss_f32(mv[r]);
        /* a row's first block (its sum still 0) has no earlier state to rescale */
        a[r] = l[r] > 0.f ? _mm256_cvtss_f32(pa_exp2(_mm256_set1_ps(m[r] - mnew))) : 0.f;
        l[r] = l[r] * a[r] + pa_hsum(acc[r]);
        m[r] = mnew;
    }
}

/* o[r] = o[r] * a[r] + sum_{j < nk} p[r][j] vf[j], NR rows of one token, 32-float slabs of D */
static inline __attribute__((always_inline)) void pa_pv(const int NR, float *const o[3], const float *const p[3],
                                                        const float a[3], const float *vf, int nk, int d) {
    for (int c0 = 0; c0 < d; c0 += 32) {
        __m256 acc[3][4];
        for (int r = 0; r < NR; r++) {
            const __m256 av = _mm256_set1_ps(a[r]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_mul_ps(_mm256_load_ps(o[r] + c0 + 8 * c), av);
        }
        for (int j = 0; j < nk; j++) { /* NR broadcasts held, one slab vector loaded at a time: 4 NR + NR + 1 registers */
            const float *v = vf + (int64_t)j * d + c0;
            __m256 pb[3];
            for (int r = 0; r < NR; r++) pb[r] = _mm256_broadcast_ss(p[r] + j);
            for (int c = 0; c < 4; c++) {
                __m256 vv = _mm256_load_ps(v + 8 * c);
                __asm__("" : "+x"(vv)); /* one load for NR FMAs: folded into each, the loads bound the loop */
                for (int r = 0; r < NR; r++) acc[r][c] = _mm256_fmadd_ps(pb[r], vv, acc[r][c]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < 4; c++) _mm256_store_ps(o[r] + c0 + 8 * c, acc[r][c]);
    }
}

/* a token's NR rows' softmax step and P.V over one key block */
static void pa_rows(int nr, float *const o[3], float *const s[3], float *m, float *l, float *a, const float *vf,
                    int nk, int d) {
    if (nr == 3) {
        pa_softmax(3, s, nk, m, l, a);
        pa_pv(3, o, (const float *const *)s, a, vf, nk, d);
    } else if (nr == 2) {
        pa_softmax(2, s, nk, m, l, a);
        pa_pv(2, o, (const float *const *)s, a, vf, nk, d);
    } else {
        pa_softmax(1, s, nk, m, l, a);
        pa_pv(1, o, (const float *const *)s, a, vf, nk, d);
    }
}

typedef struct {
    const void *q, *kc, *vc;
    void *out;
    const int32_t *table;
    int64_t q0, t, bs;
    int hq, hkv, d, kv_bf16, q_bf16, tiles, units;
    float scale;
    float *work;
    int64_t per_part; /* floats of work a part */
    atomic_int next;  /* the next unit to take */
} pa_job;

/* per part: qf, o [PA_TT * G, D], s [PA_TT * G + PA_ROWS, PA_KB] (a tile's last score rows may run past its rows),
 * m, l [PA_TT * G], kt [D, PA_KB], vf [PA_KB, D]; 32-byte aligned rows */
static int64_t pa_part_floats(int g, int d) {
    const int64_t rows = (int64_t)PA_TT * g;
    return rows * d * 2 + (rows + PA_ROWS) * PA_KB + rows * 2 + (int64_t)d * PA_KB * 2 + 64;
}

/* lane i of out[x] = lane x of in[i] (an 8 x 8 transpose) */
static inline void pa_transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* kv head h's keys k0 .. k0 + kn of the block, read through the table: kt [D][PA_KB] transposed, vf [PA_KB][D], in
 * fp32; keys kn .. width zero */
static void pa_prep(const pa_job *j, int h, int64_t k0, int kn, int width, float *kt, float *vf) {
    const int d = j->d;
    const int64_t ts = (int64_t)j->hkv * d;
    for (int j8 = 0; j8 < width; j8 += 8) {
        int64_t base[8];
        for (int x = 0; x < 8; x++) {
            const int64_t key = k0 + j8 + x;
            base[x] = j8 + x < kn ? ((int64_t)j->table[key / j->bs] * j->bs + key % j->bs) * ts + (int64_t)h * d : -1;
        }
        for (int i = 0; i < d; i += 8) {
            __m256 r[8];
            for (int x = 0; x < 8; x++) {
                r[x] = base[x] >= 0 ? load8(j->kc, base[x] + i, j->kv_bf16) : _mm256_setzero_ps();
                _mm256_store_ps(vf + (int64_t)(j8 + x) * d + i,
                                base[x] >= 0 ? load8(j->vc, base[x] + i, j->kv_bf16) : _mm256_setzero_ps());
            }
            pa_transpose8(r);
            for (int x = 0; x < 8; x++) _mm256_store_ps(kt + (int64_t)(i + x) * PA_KB + j8, r[x]);
        }
    }
}

static void pa_unit(const pa_job *j, int h, int tile, float *w) {
    const int g = j->hq / j->hkv, d = j->d;
    const int64_t t_lo = (int64_t)tile * PA_TT, t_hi = t_lo + PA_TT < j->t ? t_lo + PA_TT : j->t;
    const int nrows = (int)(t_hi - t_lo) * g;
    const float qscale = j->scale * 1.44269504088896341f; /* scores in log2 units: softmax by exp2 */
    float *qf = (float *)(((uintptr_t)w + 31) & ~(uintptr_t)31);
    float *o = qf + (int64_t)PA_TT * g * d, *s = o + (int64_t)PA_TT * g * d, *m = s + (int64_t)(PA_TT * g + PA_ROWS) * PA_KB;
    float *l = m + PA_TT * g, *kt = l + PA_TT * g, *vf = kt + (int64_t)d * PA_KB;
    kt = (float *)(((uintptr_t)kt + 31) & ~(uintptr_t)31);
    vf = kt + (int64_t)d * PA_KB;
    for (int r = 0; r < nrows; r++) {
        const int64_t t = t_lo + r / g, head = (int64_t)h * g + r % g;
        for (int i = 0; i < d; i++) {
            qf[(int64_t)r * d + i] = load1(j->q, (t * j->hq + head) * d + i, j->q_bf16) * qscale;
            o[(int64_t)r * d + i] = 0.f;
        }
        m[r] = -FLT_MAX;
        l[r] = 0.f;
    }
    const int64_t ts = (int64_t)j->hkv * d, pmax = j->q0 + t_hi - 1, nblk = pmax / PA_KB + 1;
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t k0 = b * PA_KB;
        const int kn = (int)(pmax + 1 - k0 < PA_KB ? pmax + 1 - k0 : PA_KB), ng = (kn + 15) / 16;
        pa_prep(j, h, k0, kn, ng * 16, kt, vf);
        const int64_t tf = k0 - j->q0 > t_lo ? k0 - j->q0 : t_lo; /* the first token that sees this block */
        const int r0 = (int)(tf - t_lo) * g;
        for (int r = r0; r < nrows; r += PA_ROWS) {
            const float *rows[PA_ROWS];
            for (int k = 0; k < PA_ROWS; k++) rows[k] = qf + (int64_t)(r + k < nrows ? r + k : nrows - 1) * d;
            pa_scores(rows, kt, d, ng, s + (int64_t)r * PA_KB);
        }
        for (int64_t t = tf; t < t_hi; t++) {
            const int64_t p = j->q0 + t;
            const int valid = (int)(p + 1 - k0 < PA_KB ? p + 1 - k0 : PA_KB);
            const int rb = (int)(t - t_lo) * g;
            for (int k = 0; k < g; k += 3) { /* the token's G rows, three at a time */
                const int nr = g - k < 3 ? g - k : 3;
                float *op[3], *sp[3], a[3];
                for (int x = 0; x < nr; x++) {
                    op[x] = o + (int64_t)(rb + k + x) * d;
                    sp[x] = s + (int64_t)(rb + k + x) * PA_KB;
                }
                pa_rows(nr, op, sp, m + rb + k, l + rb + k, a, vf, valid, d);
            }
        }
    }
    for (int r = 0; r < nrows; r++) {
        const int64_t t = t_lo + r / g, head = (int64_t)h * g + r % g;
        const float inv = 1.f / l[r];
        for (int i = 0; i < d; i++) store1(j->out, (t * j->hq + head) * d + i, o[(int64_t)r * d + i] * inv, j->q_bf16);
    }
}

/* Units are taken from a shared counter, the latest tiles (the most keys) first, so a thread slowed by anything
 * else on the machine takes fewer; which thread computes a row never enters its arithmetic. */
static void pa_part(void *p, int part, int parts) {
    pa_job *j = (pa_job *)p;
    (void)parts;
    float *w = j->work + (int64_t)part * j->per_part;
    for (int u; (u = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < j->units;)
        pa_unit(j, u % j->hkv, j->tiles - 1 - u / j->hkv, w);
}

static int pa_takes(int hq, int hkv, int d) {
    return hkv >= 1 && hq % hkv == 0 && hq / hkv <= PA_MAXG && d % 32 == 0 && d <= 256;
}
#else
static int pa_takes(int hq, int hkv, int d) {
    (void)hq, (void)hkv, (void)d;
    return 0;
}
#endif

/* 1 where this build has the prefill attention loop (AVX2 + FMA), else 0 */
int modeld_prefill_attention_isa(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* Causal attention of T rows at positions q0 .. q0 + T - 1. q, out [T, Hq, D] (bf16 or fp32, out in q's dtype);
 * k_cache, v_cache [NB, BS, Hkv, D] (bf16 or fp32) holding keys 0 .. q0 + T - 1 through table (int32, the session's
 * block table). threads: the pool's helpers. Returns 0 done; 1 a shape or build it does not take; 2 out of memory. */
int modeld_prefill_attention(const void *q, void *out, const void *k_cache, const void *v_cache, const int32_t *table,
                             int64_t q0, int64_t t, int64_t bs, int hq, int hkv, int d, float scale, int kv_bf16,
                             int q_bf16, int threads) {
    if (t < 1 || q0 < 0 || bs < 1 || !pa_takes(hq, hkv, d)) return 1;
#if defined(__AVX2__) && defined(__FMA__)
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int tiles = (int)((t + PA_TT - 1) / PA_TT), units = tiles * hkv;
    if (threads > units) threads = units;
    const int64_t per = pa_part_floats(hq / hkv, d);
    static __thread float *work = NULL;
    static __thread int64_t cap = 0;
    if (per * threads > cap) {
        float *p = (float *)realloc(work, sizeof(float) * (size_t)(per * threads));
        if (p == NULL) return 2;
        work = p;
        cap = per * threads;
    }
    pa_job j = {q, k_cache, v_cache, out, table, q0, t, bs, hq, hkv, d, kv_bf16, q_bf16, tiles, units, scale, work,
                per, 0};
    pool_run(pa_part, &j, threads);
    return 0;
#else
    (void)q, (void)out, (void)k_cache, (void)v_cache, (void)table, (void)scale, (void)kv_bf16, (void)q_bf16,
        (void)threads;
    return 1;
#endif
}
