/* The quantized matmuls of cpu_dot.c that cpu_layer.c builds on (see cpu_dot.c for the layouts). */
#ifndef DFA_CPU_DOT_H
#define DFA_CPU_DOT_H
#include <stdint.h>

/* Bumped with any change to an entry point or a struct the Python side mirrors (see dfa_abi). */
#define DFA_ABI_VERSION 3

void dfa_quantize(const float *x, int64_t M, int64_t K, int16_t *xq, float *xs, float *xsum, int threads);
void dfa_matmul_u4(const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                   const uint8_t *q, const float *d, const float *m, int64_t N, float *y, int threads);
void dfa_matmul_s8(const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                   const int8_t *q, const float *d, const float *m, int64_t group, int64_t N, float *y,
                   int threads);
void dfa_matmul_u5(const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                   const uint8_t *q, const uint32_t *qh, int offset, const float *d, const float *m, int64_t N,
                   float *y, int threads);
/* one of the three by bits (4, 5, 8); qh and offset for 5 only */
void dfa_matmul(const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K, const void *q, int bits,
                const uint32_t *qh, int offset, const float *d, const float *m, int64_t group, int64_t N, float *y,
                int threads);

/* x [M, K] float32 quantized and multiplied in one call; 0, or -1 when its scratch could not be had */
int dfa_linear(const float *x, int64_t M, int64_t K, const void *q, int bits, const uint32_t *qh, int offset,
               const float *d, const float *m, int64_t group, int64_t N, float *y, int threads);

/* Four partial sums: a single chain of float additions would cost a few cycles per element. */
static inline float dotf(const float *a, const float *b, int64_t n) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += a[i + j] * b[i + j];
    for (; i < n; i++) s[0] += a[i] * b[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}
#endif
