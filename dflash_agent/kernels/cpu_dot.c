/* Weight-only quantized matmuls for the CPU: y[m, n] = sum_k x[m, k] w[n, k], with w kept as small
 * integers per group of inputs and x quantized to int8 per block of 32 (the integer dot is what makes
 * a CPU fast here: AVX2 multiplies 32 pairs of bytes per instruction, where float32 does 8).
 *
 * Weights (kernels.cpu_dot repacks GGUF blocks into these, exactly):
 *   u4: w = d q + m, q in 0..15, groups of 32; a row is K/2 bytes, byte j of a group holding q[j] in its
 *       low nibble and q[j + 16] in its high one; d, m float [N, K/32].
 *   s8: w = d q (+ m), q int8, groups of G = 32 or 16; d (and m, or NULL) float [N, K/G].
 * Activations: xq int16 [M, K], xs float [M, K/32] (x ~ xs xq per block), xsum float [M, K/16]
 * (xs times the sum of xq over each run of 16: the m terms need only these).
 * Rows of w are split across `threads` OpenMP threads (the runtime torch already loaded).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DFA_AVX2 1
#endif


int dfa_simd(void) {
#ifdef DFA_AVX2
    return 2;
#else
    return 0;
#endif
}

void dfa_quantize(const float *x, int64_t M, int64_t K, int16_t *xq, float *xs, float *xsum, int threads) {
    const int64_t B = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 4)
    for (int64_t r = 0; r < M * B; r++) {
        const float *v = x + r * 32;
        int16_t *q = xq + r * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 32; i++) {
            int qi = (int)nearbyintf(v[i] * inv);
            q[i] = (int16_t)qi;
            if (i < 16) s0 += qi; else s1 += qi;
        }
        xs[r] = d;
        xsum[2 * r] = d * (float)s0;
        xsum[2 * r + 1] = d * (float)s1;
    }
}

#ifdef DFA_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Dot products of 16 weights, widened to int16, with 16 int16 activations: 8 int32 lanes of pair sums. */
static inline __m256i dot16(__m256i w16, const int16_t *x) {
    return _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)x));
}
#endif

void dfa_matmul_u4(const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                   const uint8_t *q, const float *d, const float *m, int64_t N, float *y, int threads) {
    const int64_t B = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = q + n * (K / 2);
        const float *dn = d + n * B, *mn = m + n * B;
        for (int64_t r = 0; r < M; r++) {
            const int16_t *xr = xq + r * K;
            const float *sr = xs + r * B, *tr = xsum + r * 2 * B;
            float bias = 0.0f;
            for (int64_t b = 0; b < B; b++) bias += mn[b] * (tr[2 * b] + tr[2 * b + 1]);
#ifdef DFA_AVX2
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            const __m128i low = _mm_set1_epi8(0x0F);
            for (int64_t b = 0; b < B; b++) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(qn + b * 16));
                __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low));
                __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
                __m256i p = _mm256_add_epi32(dot16(lo, xr + b * 32), dot16(hi, xr + b * 32 + 16));
                __m256 scale = _mm256_set1_ps(dn[b] * sr[b]);
                if (b & 1)
                    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc1);
                else
                    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc0);
            }
            y[r * N + n] = hsum(_mm256_add_ps(acc0, acc1)) + bias;
#else
            float acc = 0.0f;
            for (int64_t b = 0; b < B; b++) {
                const uint8_t *g = qn + b * 16;
                const int16_t *xb = xr + b * 32;
                int32_t s = 0;
                for (int j = 0; j < 16; j++) s += (g[j] & 0x0F) * xb[j] + (g[j] >> 4) * xb[j + 16];
                acc += dn[b] * sr[b] * (float)s;
            }
            y[r * N + n] = acc + bias;
#endif
        }
    }
}

void dfa_matmul_s8(const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                   const int8_t *q, const float *d, const float *m, int64_t group, int64_t N, float *y,
                   int threads) {
    const int64_t B = K / 32, G = K / group; /* group is 32 or 16 */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qn = q + n * K;
        const float *dn = d + n * G, *mn = m ? m + n * G : NULL;
        for (int64_t r = 0; r < M; r++) {
            const int16_t *xr = xq + r * K;
            const float *sr = xs + r * B, *tr = xsum + r * 2 * B;
            float bias = 0.0f;
            if (mn) {
                if (group == 32)
                    for (int64_t b = 0; b < B; b++) bias += mn[b] * (tr[2 * b] + tr[2 * b + 1]);
                else
                    for (int64_t g = 0; g < G; g++) bias += mn[g] * tr[g];
            }
#ifdef DFA_AVX2
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            for (int64_t b = 0; b < B; b++) {
                const int8_t *qb = qn + b * 32;
                __m256i p0 = dot16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qb)), xr + b * 32);
                __m256i p1 = dot16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qb + 16))), xr + b * 32 + 16);
                if (group == 32) {
                    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),
                                           _mm256_set1_ps(dn[b] * sr[b]), acc0);
                } else {
                    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(dn[2 * b] * sr[b]), acc0);
                    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(dn[2 * b + 1] * sr[b]), acc1);
                }
            }
            y[r * N + n] = hsum(_mm256_add_ps(acc0, acc1)) + bias;
#else
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t s = 0;
                for (int64_t j = 0; j < group; j++) s += qn[g * group + j] * xr[g * group + j];
                acc += dn[g] * sr[g * group / 32] * (float)s;
            }
            y[r * N + n] = acc + bias;
#endif
        }
    }
}
