/* Every entry point of the CPU kernels library on fixed pseudo-random inputs, for test_cpu_kernels_isa.py: built
 * once per ISA (AVX2, NEON under qemu, the scalar reference with -DDFA_SCALAR, and under ASan + UBSan), each build's
 * results are compared with the scalar build's. Within one build it checks what must hold exactly: a row's result
 * does not depend on the rows computed with it, a NaN activation makes its row NaN, an infinite one leaves no
 * finite output, and bad slots are refused before anything is written. Writes records (name [32 bytes], count
 * [int64], float32[count]) to argv[1]; prints "FAIL ..." lines and exits 1 when a check fails. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dot.h"

#define THREADS 2

static FILE *out;
static int failures;
static uint64_t state = 0x9E3779B97F4A7C15ULL;

static void fail(const char *what, const char *detail) {
    printf("FAIL %s: %s\n", what, detail);
    failures++;
}

static void record(const char *name, const float *v, int64_t n) {
    char padded[32] = {0};
    const size_t len = strlen(name);
    memcpy(padded, name, len < sizeof padded ? len : sizeof padded - 1);
    fwrite(padded, 1, sizeof padded, out);
    fwrite(&n, sizeof n, 1, out);
    fwrite(v, sizeof(float), (size_t)n, out);
}

static uint32_t next(void) { /* xorshift64* */
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return (uint32_t)((state * 0x2545F4914F6CDD1DULL) >> 32);
}

static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next() >> 8) / 16777216.0f; }

static float *floats(int64_t n, float lo, float hi) {
    float *v = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) v[i] = uniform(lo, hi);
    return v;
}

/* Activations with blocks of very different sizes, as a model's are. */
static float *activations(int64_t M, int64_t K) {
    float *x = malloc((size_t)(M * K) * sizeof(float));
    for (int64_t i = 0; i < M * K; i++) x[i] = uniform(-1.0f, 1.0f) * (i / 32 % 3 == 0 ? 40.0f : 1.0f);
    return x;
}

typedef struct {
    const char *name;
    int bits, offset, with_m, scales;
    int64_t group;
} layout;

enum { Q4_K_F32, Q4_0, Q5_0, Q5_K_F32, Q8_0, S8_M, S8_G16, Q4_K, Q5_K, Q6_K, N_LAYOUTS };
static const layout LAYOUTS[N_LAYOUTS] = {
    [Q4_K_F32] = {"u4_m", 4, 0, 1, DFA_SCALES_F32, 32},  [Q4_0] = {"u4_q4_0", 4, 8, 0, DFA_SCALES_F16, 32},
    [Q5_0] = {"u5_q5_0", 5, 16, 0, DFA_SCALES_F16, 32}, [Q5_K_F32] = {"u5_m", 5, 0, 1, DFA_SCALES_F32, 32},
    [Q8_0] = {"s8_q8_0", 8, 0, 0, DFA_SCALES_F16, 32},  [S8_M] = {"s8_m", 8, 0, 1, DFA_SCALES_F32, 32},
    [S8_G16] = {"s8_g16", 8, 0, 0, DFA_SCALES_F32, 16}, [Q4_K] = {"u4_q4_k", 4, 0, 0, DFA_SCALES_K, 32},
    [Q5_K] = {"u5_q5_k", 5, 0, 0, DFA_SCALES_K, 32},    [Q6_K] = {"u6_q6_k", 6, 32, 0, DFA_SCALES_Q6K, 16},
};

/* A float as float16 bits (round to nearest even; tiny values become subnormals), for float16 scales. */
static uint16_t to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)(x >> 16 & 0x8000);
    const float a = fabsf(f);
    if (a < 6.103515625e-05f) return sign | (uint16_t)lrintf(a * 16777216.0f); /* subnormal: units of 2^-24 */
    int e;
    const float m = frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
    uint32_t mant = (uint32_t)lrintf((m * 2.0f - 1.0f) * 1024.0f), exp = (uint32_t)(e - 1 + 15);
    if (mant == 1024) mant = 0, exp++;
    return sign | (uint16_t)(exp << 10 | mant);
}

/* A random [N, K] weight in layout l: its tensors in one struct (freed with free_matrix). */
static dfa_matrix matrix(const layout *l, int64_t N, int64_t K) {
    const int64_t G = K / l->group;
    dfa_matrix w = {0};
    w.bits = l->bits, w.group = l->group, w.offset = l->offset, w.n = N, w.k = K;
    if (l->bits == 8) {
        int8_t *q = malloc((size_t)(N * K));
        for (int64_t i = 0; i < N * K; i++) q[i] = (int8_t)(next() % 255 - 127);
        w.q = q;
    } else {
        uint8_t *q = malloc((size_t)(N * K / 2));
        for (int64_t i = 0; i < N * K / 2; i++) q[i] = (uint8_t)next();
        w.q = q;
        if (l->bits > 4) { /* one word of fifth bits per group; u6 a second, of sixth bits */
            const int64_t words = N * K / 32 * (l->bits - 4);
            uint32_t *qh = malloc((size_t)words * sizeof(uint32_t));
            for (int64_t i = 0; i < words; i++) qh[i] = next();
            w.qh = qh;
        }
    }
    float *d = floats(N * G, 0.001f, 0.02f);
    w.scales = l->scales;
    if (l->scales == DFA_SCALES_K) { /* each super-block's header: float16 d and dmin, 12 bytes of 6-bit scales */
        uint8_t *h = malloc((size_t)(N * K / 256 * 16));
        for (int64_t s = 0; s < N * K / 256; s++) {
            const uint16_t super = to_half(uniform(1e-4f, 1e-3f)), super_min = to_half(uniform(1e-4f, 2e-3f));
            memcpy(h + s * 16, &super, 2);
            memcpy(h + s * 16 + 2, &super_min, 2);
            for (int j = 4; j < 16; j++) h[s * 16 + j] = (uint8_t)next();
        }
        free(d);
        w.d = h;
    } else if (l->scales == DFA_SCALES_Q6K) { /* each super-block's tail: 16 int8 scales, then float16 d */
        uint8_t *t = malloc((size_t)(N * K / 256 * 18));
        for (int64_t s = 0; s < N * K / 256; s++) {
            for (int j = 0; j < 16; j++) t[s * 18 + j] = (uint8_t)next();
            const uint16_t super = to_half(uniform(1e-4f, 1e-3f));
            memcpy(t + s * 18 + 16, &super, 2);
        }
        free(d);
        w.d = t;
    } else if (l->scales == DFA_SCALES_F16) { /* a negative scale and a subnormal one among them */
        uint16_t *h = malloc((size_t)(N * G) * sizeof(uint16_t));
        d[0] = -d[0];
        d[1] = 3e-6f;
        for (int64_t i = 0; i < N * G; i++) h[i] = to_half(d[i]);
        free(d);
        w.d = h;
    } else {
        w.d = d;
    }
    w.m = l->with_m ? floats(N * G, -0.1f, 0.1f) : NULL;
    return w;
}

static void free_matrix(dfa_matrix *w) {
    free((void *)w->q);
    free((void *)w->qh);
    free((void *)w->d);
    free((void *)w->m);
}

static int linear(const dfa_matrix *w, const float *x, int64_t M, float *y) {
    return dfa_linear(x, M, w->k, w->q, (int)w->bits, w->qh, (int)w->offset, w->d, (int)w->scales, w->m, w->group,
                      w->n, y, THREADS);
}

static void check_quantize(void) {
    const int64_t M = 5, K = 96;
    float *x = activations(M, K), *xs = malloc((size_t)(2 * M * K / 32) * sizeof(float));
    x[7] = 0.0f;
    for (int i = 32; i < 64; i++) x[i] = 1e-30f * (float)(i - 40); /* a block too small for a float scale */
    int16_t *xq = malloc((size_t)(M * K) * sizeof(int16_t));
    dfa_quantize(x, M, K, xq, xs, xs + M * K / 32, THREADS);
    float *values = malloc((size_t)(M * K) * sizeof(float));
    for (int64_t i = 0; i < M * K; i++) values[i] = (float)xq[i];
    record("quantize.q", values, M * K);
    record("quantize.scales", xs, 2 * M * K / 32);
    free(x), free(xs), free(xq), free(values);
}

static void check_linear(const layout *l, int64_t K) {
    const int64_t N = 9, M = 11; /* tiles (of 4 rows, of 8 with AVX-512) and 3 rows alone */
    char name[32];
    dfa_matrix w = matrix(l, N, K);
    float *x = activations(M, K), *y = malloc((size_t)(M * N) * sizeof(float)), row[9];
    if (linear(&w, x, M, y)) fail(l->name, "dfa_linear failed");
    for (int64_t r = 0; r < M; r++) {
        linear(&w, x + r * K, 1, row);
        if (memcmp(row, y + r * N, sizeof row)) fail(l->name, "a row alone differs from the row in a block");
    }
    snprintf(name, sizeof name, "linear.%s.%lld", l->name, (long long)K);
    record(name, y, M * N);

    /* row 0 holds a NaN, row 1 +inf, row 2 -inf (each in its own block of normal values) */
    x[5] = NAN;
    x[K + 40] = INFINITY;
    x[2 * K + 70] = -INFINITY;
    linear(&w, x, M, y);
    for (int64_t n = 0; n < N; n++) {
        if (!isnan(y[n])) fail(l->name, "a NaN activation gave a number");
        if (isfinite(y[N + n]) || isfinite(y[2 * N + n])) fail(l->name, "an infinite activation gave a finite output");
        for (int64_t r = 3; r < M; r++)
            if (!isfinite(y[r * N + n])) fail(l->name, "a finite row beside a NaN one is not finite");
    }
    free_matrix(&w), free(x), free(y);
}

/* The int8 prompt GEMM: every build the same bits (the test holds them equal); a NaN makes its row NaN only. */
static void check_gemm_i8(const layout *l, int64_t K) {
    const int64_t N = 21, M = 11; /* a panel of 16 and 5 columns; a tile of 8 rows and 3 */
    char name[40];
    dfa_matrix w = matrix(l, N, K);
    float *x = activations(M, K), *y = malloc((size_t)(M * N) * sizeof(float));
    for (int64_t r = 0; r < M; r++) x[r * K + 3] *= 50.0f; /* an outlier channel */
    if (dfa_gemm_i8(x, M, K, &w, y, THREADS)) fail(l->name, "dfa_gemm_i8 failed");
    snprintf(name, sizeof name, "gemm_i8.%s.%lld", l->name, (long long)K);
    record(name, y, M * N);
    x[4 * K + 40] = NAN;
    dfa_gemm_i8(x, M, K, &w, y, THREADS);
    for (int64_t r = 0; r < M; r++)
        for (int64_t n = 0; n < N; n++)
            if ((r == 4) != isnan(y[r * N + n])) fail(l->name, "a NaN activation's row is not NaN, or another is");
    free_matrix(&w), free(x), free(y);
}

static void check_dequantize(void) {
    const int64_t N = 6, K = 256, ids[3] = {4, 0, 5};
    float *w = malloc((size_t)(N * K) * sizeof(float));
    for (int i = 0; i < N_LAYOUTS; i++) {
        const layout *l = &LAYOUTS[i];
        dfa_matrix m = matrix(l, N, K);
        char name[32];
        dfa_dequantize(m.q, (int)m.bits, m.qh, (int)m.offset, m.d, (int)m.scales, m.m, m.group, 3, K, ids, w,
                       THREADS);
        snprintf(name, sizeof name, "dequantize.%s", l->name);
        record(name, w, 3 * K);
        free_matrix(&m);
    }
    free(w);
}

static void check_argmax(void) {
    const int64_t n = 100003;
    float *x = floats(n, -5.0f, 5.0f), found[3];
    x[77777] = 6.0f;
    found[0] = (float)dfa_argmax(x, n, THREADS);
    x[99999] = 6.0f; /* a tie: the first one */
    found[1] = (float)dfa_argmax(x, n, THREADS);
    x[12345] = NAN;
    found[2] = (float)dfa_argmax(x, n, THREADS);
    if (found[0] != 77777.0f || found[1] != 77777.0f || found[2] != 12345.0f) fail("argmax", "wrong index");
    record("argmax", found, 3);
    free(x);
}

static void check_norm_linear(void) {
    const int64_t T = 3, K = 128, N = 10;
    dfa_matrix w = matrix(&LAYOUTS[Q8_0], N, K);
    float *x = activations(T, K), *norm = floats(K, 0.5f, 1.5f), y[30];
    if (dfa_norm_linear(x, T, norm, 1e-6f, &w, y, THREADS)) fail("norm_linear", "failed");
    record("norm_linear", y, T * N);
    free_matrix(&w), free(x), free(norm);
}

static float from_half(uint16_t h) {
    const int e = h >> 10 & 0x1F, m = h & 0x3FF;
    const float v = e ? ldexpf((float)(m | 0x400), e - 25) : ldexpf((float)m, -24);
    return h & 0x8000 ? -v : v;
}

/* A Q8_0 head's screen as kernels.cpu.cpu_dot.HeadScreen.of builds it: its own integers + 128 in panels of 16 rows, its
 * scales, each block's sum of |w| rounded up; err NULL. */
static dfa_screen screen_of(const dfa_matrix *w) {
    const int64_t N = w->n, K = w->k, B = K / 32, padded = (N + 31) / 32 * 32;
    uint8_t *q = malloc((size_t)(padded * K));
    float *d = calloc((size_t)(padded * B), sizeof(float)), *l1 = calloc((size_t)(padded * B), sizeof(float));
    memset(q, 128, (size_t)(padded * K));
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < B; b++) {
            const float scale = from_half(((const uint16_t *)w->d)[n * B + b]);
            double total = 0.0;
            for (int64_t i = b * 32; i < b * 32 + 32; i++) {
                const int8_t v = ((const int8_t *)w->q)[n * K + i];
                q[(n / 16) * 16 * K + (i / 4) * 64 + (n % 16) * 4 + i % 4] = (uint8_t)(v + 128);
                total += fabs((double)scale * v);
            }
            d[(n / 16 * B + b) * 16 + n % 16] = scale;
            l1[(n / 16 * B + b) * 16 + n % 16] = (float)(total * (1.0 + 1e-6));
        }
    return (dfa_screen){q, d, l1, NULL, N, K};
}

/* Seven rows' picks through the screen (a tile of six and one more; 70 head rows, the last panels part padding):
 * each the first largest of norm_linear's logits, or -1 (left to the whole head); a row with a NaN gives -1. */
static void check_norm_head_argmax(void) {
    enum { T = 7, K = 128, N = 70 };
    dfa_matrix w = matrix(&LAYOUTS[Q8_0], N, K);
    const dfa_screen s = screen_of(&w);
    float *x = activations(T, K), *norm = floats(K, 0.5f, 1.5f), y[T * N], found[T];
    x[6 * K + 5] = NAN;
    int64_t picks[T];
    if (dfa_norm_head_argmax(x, T, norm, 1e-6f, &w, &s, picks, THREADS)) fail("norm_head_argmax", "failed");
    if (dfa_norm_linear(x, T, norm, 1e-6f, &w, y, THREADS)) fail("norm_head_argmax", "norm_linear failed");
    int screened = 0;
    for (int t = 0; t < T; t++) {
        found[t] = (float)picks[t];
        screened += picks[t] >= 0;
        if (picks[t] >= 0 && picks[t] != dfa_argmax(y + t * N, N, 1)) fail("norm_head_argmax", "not argmax's pick");
    }
    if (picks[6] != -1) fail("norm_head_argmax", "a NaN row was screened");
    if (screened < T - 2) fail("norm_head_argmax", "the screen left most rows to the whole head");
    record("norm_head_argmax", found, T);
    free_matrix(&w), free(x), free(norm);
    free((void *)s.q), free((void *)s.d), free((void *)s.l1);
}

/* One decoder layer (every layout among its matrices) decoding three rows over a cache of 67 keys (two chunks of
 * keys), with full and with sliding attention; then the same rows one call each, which must give the same bits.
 * family 1: with 26B-A4B's routed experts (4, 2 a row, a float router) and E2B's per-layer input as well; family 2:
 * a layer that shares another's K / V (no K / V matrices), which must leave the cache as it found it. */
enum { FAMILY_EXPERTS = 4, FAMILY_TOP = 2, FAMILY_WIDTH = 64, FAMILY_PLE = 64 };
static void check_layer(int64_t window, int family) {
    enum { H = 256, HEADS = 2, KVH = 1, D = 32, I = 96, SLOTS = 80, PAST = 67, T = 3 };
    dfa_matrix m[7] = {matrix(&LAYOUTS[Q4_K], HEADS * D, H), matrix(&LAYOUTS[Q5_K], KVH * D, H),
                       matrix(&LAYOUTS[Q5_0], KVH * D, H),   matrix(&LAYOUTS[Q4_0], H, HEADS * D),
                       matrix(&LAYOUTS[Q8_0], I, H),         matrix(&LAYOUTS[Q6_K], I, H),
                       matrix(&LAYOUTS[S8_M], H, I)};
    float *norms[6];
    for (int i = 0; i < 6; i++) norms[i] = floats(i < 4 ? H : D, 0.5f, 1.5f);
    dfa_layer L = {m[0], m[1], m[2], m[3], m[4], m[5], m[6], norms[0], norms[1], norms[2], norms[3], norms[4],
                   norms[5], H, HEADS, KVH, D, I, 1, 1e-6f, 1.0f, 0.7f};
    dfa_matrix gate_up[FAMILY_EXPERTS], down[FAMILY_EXPERTS], ple[2];
    float *family_f[7] = {NULL}, *per_layer = NULL;
    if (family == 1) {
        for (int e = 0; e < FAMILY_EXPERTS; e++) {
            gate_up[e] = matrix(&LAYOUTS[e % 2 ? Q4_0 : Q4_K], 2 * FAMILY_WIDTH, H);
            down[e] = matrix(&LAYOUTS[Q8_0], H, FAMILY_WIDTH);
        }
        ple[0] = matrix(&LAYOUTS[Q4_0], FAMILY_PLE, H), ple[1] = matrix(&LAYOUTS[Q8_0], H, FAMILY_PLE);
        family_f[0] = floats(FAMILY_EXPERTS * H, -0.2f, 0.2f); /* the router, float as llama.cpp keeps it */
        family_f[1] = floats(H, 0.5f, 1.5f), family_f[2] = floats(FAMILY_EXPERTS, 0.5f, 1.5f);
        for (int i = 3; i < 7; i++) family_f[i] = floats(H, 0.5f, 1.5f);
        per_layer = floats(T * FAMILY_PLE, -1.0f, 1.0f);
        L.router_w = family_f[0], L.router_scale = family_f[1], L.expert_scale = family_f[2];
        L.expert_gate_up = gate_up, L.expert_down = down;
        L.post_ff_norm_1 = family_f[3], L.pre_ff_norm_2 = family_f[4], L.post_ff_norm_2 = family_f[5];
        L.experts = FAMILY_EXPERTS, L.top_k = FAMILY_TOP, L.expert_width = FAMILY_WIDTH;
        L.per_layer_gate = ple[0], L.per_layer_proj = ple[1], L.post_per_layer_norm = family_f[6];
        L.per_layer_width = FAMILY_PLE;
    } else if (family == 2) {
        L.k_proj = L.v_proj = (dfa_matrix){0};
    }
    float *k0 = floats(SLOTS * KVH * D, -1.0f, 1.0f), *v0 = floats(SLOTS * KVH * D, -1.0f, 1.0f);
    float *k = malloc(sizeof(float) * SLOTS * KVH * D), *v = malloc(sizeof(float) * SLOTS * KVH * D);
    float *x0 = activations(T, H), x[T * H], alone[T * H], inv_freq[D / 2], cos[T * D], sin[T * D];
    for (int i = 0; i < D / 2; i++) inv_freq[i] = powf(10000.0f, -2.0f * (float)i / D);
    int64_t pos[T], slots[T], groups[2] = {0, T};
    for (int t = 0; t < T; t++) pos[t] = slots[t] = PAST + t;
    dfa_rope_table(pos, T, inv_freq, D / 2, cos, sin);

    memcpy(k, k0, sizeof(float) * SLOTS * KVH * D), memcpy(v, v0, sizeof(float) * SLOTS * KVH * D);
    memcpy(x, x0, sizeof x);
    dfa_kv kv = {k, v, SLOTS, slots, NULL, PAST + T, window};
    const float *c[1] = {cos}, *s[1] = {sin};
    float *capture[1] = {NULL};
    if (dfa_layers_forward(&L, &kv, 1, x, T, pos, c, s, capture, groups, 1, per_layer, THREADS))
        fail("layer", "failed");
    static const char *names[3][2] = {{"layer.full", "layer.sliding"}, {"layer.family.full", "layer.family.sliding"},
                                      {"layer.shared.full", "layer.shared.sliding"}};
    record(names[family][window != 0], x, T * H);
    const size_t cache_bytes = sizeof(float) * SLOTS * KVH * D;
    if (family == 2 && (memcmp(k, k0, cache_bytes) || memcmp(v, v0, cache_bytes)))
        fail("layer", "a layer sharing K / V wrote the cache");

    memcpy(k, k0, sizeof(float) * SLOTS * KVH * D), memcpy(v, v0, sizeof(float) * SLOTS * KVH * D);
    memcpy(alone, x0, sizeof alone);
    for (int64_t t = 0; t < T; t++) {
        const int64_t one[2] = {0, 1};
        dfa_kv kv1 = {k, v, SLOTS, slots + t, NULL, PAST + t + 1, window};
        const float *c1[1] = {cos + t * D}, *s1[1] = {sin + t * D};
        dfa_layers_forward(&L, &kv1, 1, alone + t * H, 1, pos + t, c1, s1, capture, one, 1,
                           per_layer ? per_layer + t * FAMILY_PLE : NULL, THREADS);
    }
    if (memcmp(alone, x, sizeof x)) fail("layer", "rows decoded one at a time differ from the block's");

    /* a write slot past the cache is refused, and nothing is written */
    int64_t bad[T] = {PAST, PAST + 1, SLOTS};
    dfa_kv outside = {k, v, SLOTS, bad, NULL, PAST + T, window};
    memcpy(x, x0, sizeof x);
    if (dfa_layers_forward(&L, &outside, 1, x, T, pos, c, s, capture, groups, 1, per_layer, THREADS) != -2 ||
        memcmp(x, x0, sizeof x))
        fail("layer", "a write slot outside the cache was not refused untouched");

    if (family == 1) { /* a per-layer input left out is refused too */
        memcpy(x, x0, sizeof x);
        if (dfa_layers_forward(&L, &kv, 1, x, T, pos, c, s, capture, groups, 1, NULL, THREADS) != -2 ||
            memcmp(x, x0, sizeof x))
            fail("layer", "a PLE layer without its per-layer input was not refused untouched");
        for (int e = 0; e < FAMILY_EXPERTS; e++) free_matrix(&gate_up[e]), free_matrix(&down[e]);
        free_matrix(&ple[0]), free_matrix(&ple[1]);
    }
    for (int i = 0; i < 7; i++) free(family_f[i]);
    free(per_layer);
    for (int i = 0; i < 7; i++) free_matrix(&m[i]);
    for (int i = 0; i < 6; i++) free(norms[i]);
    free(k0), free(v0), free(k), free(v), free(x0);
}

int main(int argc, char **argv) {
    if (argc != 2 || !(out = fopen(argv[1], "wb"))) {
        fprintf(stderr, "usage: %s RESULTS\n", argv[0]);
        return 2;
    }
    const float simd = (float)dfa_simd();
    record("simd", &simd, 1);
    check_quantize();
    for (int i = 0; i < N_LAYOUTS; i++) {
        const int super = LAYOUTS[i].scales == DFA_SCALES_K || LAYOUTS[i].scales == DFA_SCALES_Q6K; /* of 256 */
        check_linear(&LAYOUTS[i], super ? 256 : 96); /* 96: an odd number of blocks, the tail */
        check_linear(&LAYOUTS[i], super ? 768 : 256);
        if (!super) check_linear(&LAYOUTS[i], 704); /* pairs of blocks, 6 past the last 8: 26B-A4B's expert width */
        check_gemm_i8(&LAYOUTS[i], super ? 512 : 96);
    }
    check_dequantize();
    check_argmax();
    check_norm_linear();
    check_norm_head_argmax();
    for (int family = 0; family < 3; family++) {
        check_layer(0, family);
        check_layer(16, family);
    }
    fclose(out);
    printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
