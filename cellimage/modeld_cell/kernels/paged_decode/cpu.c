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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HD 4096 /* Hq * D */
#define MAX_G 8     /* query heads per kv head, AVX-512 path */

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

/* softmax numerators in place over s[0..n), returns 1 / their sum */
static float exp_rows(float *s, int64_t n) {
    float m = -FLT_MAX, a = 0.f;
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    for (int64_t t = 0; t < n; t++) {
        float e = expf(s[t] - m);
        s[t] = e;
        a += e;
    }
    return 1.f / a;
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
    for (int r = 0; r < hq; r++) inv[r] = exp_rows(s + (int64_t)r * n, n);
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
#include <immintrin.h>

static inline __m512 load16(const void *p, int64_t off, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + off))), 16));
    return _mm512_loadu_ps((const float *)p + off);
}

/* AVX-512, D a multiple of 16 up to 256, G up to MAX_G: one kv head at a time, its G query rows in registers. */
static inline __attribute__((always_inline)) void
row_avx512(const void *q, void *out, const void *kc, const void *vc, const int32_t *table, int64_t n, int64_t bs,
           const int hq, const int hkv, const int d, float scale, int kv_bf16, int q_bf16, float *s) {
    const int g = hq / hkv, nv = d / 16;
    const int64_t ts = (int64_t)hkv * d, nblk = (n + bs - 1) / bs, esz = kv_bf16 ? 2 : 4;
    for (int h = 0; h < hkv; h++) {
        __m512 qv[MAX_G][16], o[MAX_G][16];
        float inv[MAX_G];
        for (int r = 0; r < g; r++)
            for (int c = 0; c < nv; c++)
                qv[r][c] = _mm512_mul_ps(load16(q, (int64_t)(h * g + r) * d + c * 16, q_bf16), _mm512_set1_ps(scale));
        for (int64_t b = 0; b < nblk; b++) {
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
        for (int r = 0; r < g; r++) inv[r] = exp_rows(s + (int64_t)r * n, n);
        for (int r = 0; r < g; r++)
            for (int c = 0; c < nv; c++) o[r][c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nblk; b++) {
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
        for (int r = 0; r < g; r++) {
            float tmp[16];
            for (int c = 0; c < nv; c++) {
                _mm512_storeu_ps(tmp, _mm512_mul_ps(o[r][c], _mm512_set1_ps(inv[r])));
                for (int i = 0; i < 16; i++) store1(out, (int64_t)(h * g + r) * d + c * 16 + i, tmp[i], q_bf16);
            }
        }
    }
}
#endif

/* 1 where this build has the AVX-512 path, else 0 (the capability report names which path serves) */
int modeld_paged_decode_isa(void) {
#if defined(__AVX512F__)
    return 1;
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
#if defined(__AVX512F__)
    if (d % 16 == 0 && d <= 256 && hq / hkv <= MAX_G) {
        if (d == 64) /* SmolLM2 and most small models: the loops unrolled */
            row_avx512(q, out, k_cache, v_cache, table, n, bs, hq, hkv, 64, scale, kv_bf16, q_bf16, scratch);
        else
            row_avx512(q, out, k_cache, v_cache, table, n, bs, hq, hkv, d, scale, kv_bf16, q_bf16, scratch);
        return 0;
    }
#endif
    row_portable(q, out, k_cache, v_cache, table, n, bs, hq, hkv, d, scale, kv_bf16, q_bf16, scratch);
    return 0;
}
