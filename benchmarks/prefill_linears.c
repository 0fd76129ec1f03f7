/* A candidate for the CPU cell's prefill linears, measured by prefill_linears.py against oneDNN's packed GEMM; not
 * served. y [M, N] = x [M, K] @ W^T in fp32 with W in 16-column panels ([N / 16][K][16]): a 6 x 16 register tile of
 * FMAs walks k in order through 256-long blocks, each block's sum added to the row's running sum in block order, so
 * every row gets the bits of the same row multiplied alone, whatever the call's row count or thread count (the
 * property the cell's bitwise reuse needs of a prefill's linears, which oneDNN's kernel gives only as probed at
 * start). Threads split the panels (output columns), never a sum. AVX2 + FMA. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>

#define MR 6
#define NR 16
#define KC 256
#define MC 8 /* row tiles a panel's KC x 16 block serves while it stays in L1 */

int pl_pack(const float *w, float *wp, int N, int K) {
    if (N % NR != 0 || N <= 0 || K <= 0) return 1;
    for (int p = 0; p < N / NR; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) wp[((int64_t)p * K + k) * NR + j] = w[(int64_t)(p * NR + j) * K + k];
    return 0;
}

typedef struct {
    const float *x, *wp;
    float *y;
    int64_t M;
    int N, K, p0, p1;
} job;

static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, int rows, const float *bp, int kc,
                                                       float *y, int64_t ldy, int first) {
    const float *a[MR];
    for (int i = 0; i < MR; i++) a[i] = x + (i < rows ? i : 0) * ldx; /* missing rows read row 0, never stored */
    __m256 c[MR][2];
    for (int i = 0; i < MR; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(bp + k * NR), b1 = _mm256_loadu_ps(bp + k * NR + 8);
        for (int i = 0; i < MR; i++) {
            const __m256 ai = _mm256_broadcast_ss(a[i] + k);
            c[i][0] = _mm256_fmadd_ps(ai, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(ai, b1, c[i][1]);
        }
    }
    for (int i = 0; i < rows; i++) {
        float *yr = y + i * ldy;
        if (first) {
            _mm256_storeu_ps(yr, c[i][0]);
            _mm256_storeu_ps(yr + 8, c[i][1]);
        } else {
            _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), c[i][0]));
            _mm256_storeu_ps(yr + 8, _mm256_add_ps(_mm256_loadu_ps(yr + 8), c[i][1]));
        }
    }
}

static void *part(void *p) {
    const job *j = (const job *)p;
    const int64_t tiles = (j->M + MR - 1) / MR;
    for (int k0 = 0; k0 < j->K; k0 += KC) {
        const int kc = j->K - k0 < KC ? j->K - k0 : KC;
        for (int64_t t0 = 0; t0 < tiles; t0 += MC) {
            const int64_t t1 = t0 + MC < tiles ? t0 + MC : tiles;
            for (int pn = j->p0; pn < j->p1; pn++) {
                const float *bp = j->wp + ((int64_t)pn * j->K + k0) * NR;
                for (int64_t t = t0; t < t1; t++) {
                    const int64_t r0 = t * MR;
                    const int rows = (int)(j->M - r0 < MR ? j->M - r0 : MR);
                    tile(j->x + r0 * j->K + k0, j->K, rows, bp, kc, j->y + r0 * j->N + pn * NR, j->N, k0 == 0);
                }
            }
        }
    }
    return NULL;
}

/* threads: the panels split over that many (threads started per call: microseconds against a chunk's milliseconds) */
int pl_linear(const float *x, const float *wp, float *y, int64_t M, int N, int K, int threads) {
    if (N % NR != 0 || threads < 1 || threads > 16) return 1;
    job jobs[16];
    pthread_t th[16];
    const int panels = N / NR;
    for (int t = 0; t < threads; t++) jobs[t] = (job){x, wp, y, M, N, K, panels * t / threads, panels * (t + 1) / threads};
    for (int t = 1; t < threads; t++)
        if (pthread_create(&th[t], NULL, part, &jobs[t]) != 0) return 2;
    part(&jobs[0]);
    for (int t = 1; t < threads; t++) pthread_join(th[t], NULL);
    return 0;
}
