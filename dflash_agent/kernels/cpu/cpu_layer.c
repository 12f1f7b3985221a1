/* The Gemma decoder layers for a few new tokens (decode, speculative verification) on the CPU, all of a step's in
 * one call (and its final norm and LM head in another): the same computation as engine.model.DecoderLayer with
 * the "kernel" cache plan, on weights repacked for cpu_dot.c. A decode step through PyTorch's eager ops spends more time dispatching its ~370 small ops per
 * layer than computing them; here the only per-layer cost besides the matmuls is a few microseconds.
 *
 * Rows of several sequences (slots of concurrent requests) may share a call, each attending to its own cache.
 * Every step works on one token row at a time (norms, RoPE, attention) or through the matmuls, whose rows are
 * computed alone, so a row's result never depends on how many rows came with it: verifying a block gives
 * what decoding it token by token gives.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dot.h"


/* Four partial sums of 8 (AVX2) or 4 (NEON) lanes, in a fixed order (dotf where the width is not a multiple of
 * 32 / 16). */
static float dot(const float *a, const float *b, int64_t n) {
#ifdef DFA_AVX2
    if (n % 32 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(),
               s3 = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 32) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
            s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
            s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
        }
        __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        return _mm_cvtss_f32(h);
    }
#elif defined(DFA_NEON)
    if (n % 16 == 0) {
        float32x4_t s0 = vdupq_n_f32(0.0f), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < n; i += 16) {
            s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
            s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
            s2 = vfmaq_f32(s2, vld1q_f32(a + i + 8), vld1q_f32(b + i + 8));
            s3 = vfmaq_f32(s3, vld1q_f32(a + i + 12), vld1q_f32(b + i + 12));
        }
        return vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
    }
#endif
    return dotf(a, b, n);
}

/* out = x / rms(x) * w (w NULL: no weight); out may be x. */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    const float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w ? x[i] * inv * w[i] : x[i] * inv;
}

/* NeoX RoPE in place: dim i pairs with i + d/2; cos / sin [d] for this token. */
static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* tanh(u) = 1 - 2 / (exp(2u) + 1) through expf, several times faster than libm's tanhf and as accurate where
 * gelu needs it (an absolute error near 1e-7); past |u| = 10 tanh is +-1 in float. */
static float gelu_tanh(float x) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    float u = k * (x + 0.044715f * x * x * x);
    u = u > 10.0f ? 10.0f : (u < -10.0f ? -10.0f : u);
    return 0.5f * x * (2.0f - 2.0f / (expf(2.0f * u) + 1.0f));
}

#ifdef DFA_AVX2
/* e^x for 8 floats (|x| <= 88): 2^n times Cephes' degree-6 polynomial on the remainder, within 2 ulp of expf. */
static inline __m256 exp8(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

/* gate[i] = gelu_tanh(gate[i]) * up[i] for i < n: the feed-forward's activation, eight at a time with AVX2. */
static void gelu_times(float *gate, const float *up, int64_t n) {
    int64_t i = 0;
#ifdef DFA_AVX2
    const __m256 k = _mm256_set1_ps(0.7978845608028654f), c = _mm256_set1_ps(0.044715f), one = _mm256_set1_ps(1.0f);
    const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        __m256 u = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(c, x), _mm256_mul_ps(x, x), x));
        u = _mm256_min_ps(_mm256_max_ps(u, lo), hi);
        const __m256 e = exp8(_mm256_add_ps(u, u));
        /* 0.5 x (1 + tanh u) = x - x / (e^2u + 1) */
        const __m256 g = _mm256_sub_ps(x, _mm256_div_ps(x, _mm256_add_ps(e, one)));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(g, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) gate[i] = gelu_tanh(gate[i]) * up[i];
}

/* y [T, m->n] = x [T, m->k] @ w^T, activations quantized into the caller's scratch (xq, xs: [T, k], [2 T k / 32]). */
static void quantize(const float *x, int64_t T, int64_t K, int16_t *xq, float *xs, int threads) {
    dfa_quantize(x, T, K, xq, xs, xs + T * (K / 32), threads);
}

static void matmul(const dfa_matrix *w, const int16_t *xq, const float *xs, int64_t T, float *y, int threads) {
    dfa_matmul(xq, xs, xs + T * (w->k / 32), T, w->k, w->q, (int)w->bits, w->qh, (int)w->offset, w->d, (int)w->scales,
               w->m, w->group, w->n, y, threads);
}

/* Keys are taken CHUNK slots at a time, each chunk a work item of its own, dealt to the threads in turn: the two
 * cores of a decode step read half the cache each (from memory: the LM head streams through every cache level on
 * every step). The chunks are cut at fixed slots, so a query's result never depends on how many came with it. */
#define CHUNK 64
#define PARTIALS_MAX ((int64_t)8 << 20) /* floats: 32 MiB of chunk partials per pass at most */

#ifdef DFA_AVX2
/* score[j][u] = q_j . key seen[u] times scale for the n heads (a constant where inlined; d a multiple of 16), each key
 * read once for all n, top[j] raised to the largest (a NaN score makes it NaN, so it reaches the output). */
static inline __attribute__((always_inline)) void score_keys(int n, const dfa_kv *kv, const int64_t *seen, int64_t V,
                                                             int64_t stride, int64_t offset, int64_t d,
                                                             const float *q, float scale, float score[][CHUNK],
                                                             float *top) {
    for (int64_t u = 0; u < V; u++) {
        const float *key = kv->k + seen[u] * stride + offset;
        __m256 acc[4][2];
        for (int j = 0; j < n; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            const __m256 k0 = _mm256_loadu_ps(key + i), k1 = _mm256_loadu_ps(key + i + 8);
            for (int j = 0; j < n; j++) {
                acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i), k0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i + 8), k1, acc[j][1]);
            }
        }
        for (int j = 0; j < n; j++) {
            const __m256 v = _mm256_add_ps(acc[j][0], acc[j][1]);
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            const float sc = _mm_cvtss_f32(h) * scale;
            score[j][u] = sc;
            if (!(sc <= top[j])) top[j] = sc;
        }
    }
}

/* out[j] = sum over the V visible slots (in order) of score[j][u] times value row seen[u], for the n heads (a constant
 * where inlined), 16 values of every head at a time held in registers while each value row is read once for all n
 * (where a pass per head read it n times and loaded and stored the outputs at every key). Returns how many of the d
 * values it did (a multiple of 16; attend_chunk does the rest). */
static inline __attribute__((always_inline)) int64_t weigh_values(int n, const dfa_kv *kv, const int64_t *seen,
                                                                  int64_t V, int64_t stride, int64_t offset,
                                                                  int64_t d, float score[][CHUNK], float *out) {
    int64_t i0 = 0;
    for (; i0 + 16 <= d; i0 += 16) {
        __m256 acc[4][2];
        for (int j = 0; j < n; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t u = 0; u < V; u++) {
            const float *v = kv->v + seen[u] * stride + offset + i0;
            const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
            for (int j = 0; j < n; j++) {
                const __m256 e = _mm256_set1_ps(score[j][u]);
                acc[j][0] = _mm256_fmadd_ps(e, v0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(e, v1, acc[j][1]);
            }
        }
        for (int j = 0; j < n; j++) {
            _mm256_storeu_ps(out + j * d + i0, acc[j][0]);
            _mm256_storeu_ps(out + j * d + i0 + 8, acc[j][1]);
        }
    }
    return i0;
}
#endif

/* One chunk of softmax attention: query row q's n heads (sharing KV head kvh) over the visible slots of
 * [s0, s1) (see kernels.attention's rule), each key and value read once for the n heads. out [n, d] gets the
 * chunk's value sum weighted by exp(score - top[j]), total[j] the sum of those weights; top[j] is the chunk's
 * largest score (-inf: no visible key, out and total 0). */
static void attend_chunk(const dfa_layer *L, const dfa_kv *kv, const float *q, int64_t q_pos, int64_t kvh, int64_t n,
                         int64_t s0, int64_t s1, float *out, float *top, float *total) {
    const int64_t d = L->head_dim, stride = L->kv_heads * d;
    int64_t seen[CHUNK];
    float score[n][CHUNK];
    int64_t V = 0;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t p = kv->key_pos ? kv->key_pos[s] : s;
        if (p >= 0 && p <= q_pos && (kv->window == 0 || p > q_pos - kv->window)) seen[V++] = s;
    }
    for (int64_t j = 0; j < n; j++) {
        top[j] = -INFINITY;
        total[j] = 0.0f;
    }
    memset(out, 0, (size_t)(n * d) * sizeof(float));
    if (V == 0) return;
    int scored = 0;
#ifdef DFA_AVX2
    if (d % 16 == 0) {
        scored = 1;
        switch (n) { /* a constant head count, so the sums stay in registers */
        case 1: score_keys(1, kv, seen, V, stride, kvh * d, d, q, L->scale, score, top); break;
        case 2: score_keys(2, kv, seen, V, stride, kvh * d, d, q, L->scale, score, top); break;
        case 4: score_keys(4, kv, seen, V, stride, kvh * d, d, q, L->scale, score, top); break;
        default: scored = 0;
        }
    }
#endif
    for (int64_t u = 0; u < V && !scored; u++) {
        const float *key = kv->k + seen[u] * stride + kvh * d;
        for (int64_t j = 0; j < n; j++) {
            const float sc = dot(q + j * d, key, d) * L->scale;
            score[j][u] = sc;
            if (!(sc <= top[j])) top[j] = sc; /* a NaN score makes the top NaN, so it reaches the output */
        }
    }
    for (int64_t j = 0; j < n; j++)
        for (int64_t u = 0; u < V; u++) {
            score[j][u] = expf(score[j][u] - top[j]);
            total[j] += score[j][u];
        }
    int64_t i0 = 0;
#ifdef DFA_AVX2
    switch (n) { /* a constant head count, so the outputs stay in registers */
    case 1: i0 = weigh_values(1, kv, seen, V, stride, kvh * d, d, score, out); break;
    case 2: i0 = weigh_values(2, kv, seen, V, stride, kvh * d, d, score, out); break;
    case 4: i0 = weigh_values(4, kv, seen, V, stride, kvh * d, d, score, out); break;
    default: break;
    }
#endif
    for (int64_t u = 0; u < V; u++) { /* what is left: e v summed in key order, as above */
        const float *v = kv->v + seen[u] * stride + kvh * d;
        for (int64_t j = 0; j < n; j++) {
            const float e = score[j][u];
            float *o = out + j * d;
            for (int64_t i = i0; i < d; i++) o[i] = fmaf(e, v[i], o[i]);
        }
    }
}

/* Softmax attention of the T query rows over the cache into att [T, heads, d]: one work item per (row, KV head,
 * chunk of keys), then each row's chunks merged in order. Returns -1 when scratch memory could not be had. */
static int attention(const dfa_layer *L, const dfa_kv *kv, const float *q, const int64_t *q_pos, int64_t T,
                     float *att, int threads) {
    const int64_t d = L->head_dim, group = L->heads / L->kv_heads, chunks = (kv->n_keys + CHUNK - 1) / CHUNK;
    const int64_t per_row = L->kv_heads * chunks * group * (d + 2); /* floats of partials per query row */
    /* query rows taken a few at a time where a long context would make the partials large (a 27B-sized model at
     * 128k keys: half a GB for 16 rows); rows are independent, so this changes no result */
    const int64_t pass = per_row * T > PARTIALS_MAX ? (PARTIALS_MAX / per_row > 0 ? PARTIALS_MAX / per_row : 1) : T;
    float *part = malloc((size_t)(pass * per_row) * sizeof(float)); /* out, top, total of each item */
    if (!part) return -1;
    for (int64_t t0 = 0; t0 < T; t0 += pass) {
        const int64_t rows = T - t0 < pass ? T - t0 : pass, items = rows * L->kv_heads * chunks;
        /* the rows vary fastest and each thread takes a run of items, so a chunk's keys and values are read from
         * memory once for all the rows (a deep context's KV is far larger than the caches); an item's partials keep
         * their (row, KV head, chunk) place, so no result depends on the order */
#pragma omp parallel for num_threads(threads) schedule(static) if (items > 1)
        for (int64_t n = 0; n < items; n++) {
            const int64_t r = n % rows, c = n / rows % chunks, kvh = n / rows / chunks, t = t0 + r;
            const int64_t i = (r * L->kv_heads + kvh) * chunks + c;
            float *out = part + i * group * (d + 2);
            const int64_t s1 = (c + 1) * CHUNK < kv->n_keys ? (c + 1) * CHUNK : kv->n_keys;
            attend_chunk(L, kv, q + (t * L->heads + kvh * group) * d, q_pos[t], kvh, group, c * CHUNK, s1, out,
                         out + group * d, out + group * d + group);
        }
        for (int64_t r = 0; r < rows * L->kv_heads; r++)
            for (int64_t j = 0; j < group; j++) {
                float best = -INFINITY;
                for (int64_t c = 0; c < chunks; c++) {
                    const float top = part[((r * chunks + c) * group) * (d + 2) + group * d + j];
                    if (!(top <= best)) best = top;
                }
                float *o = att + ((t0 * L->kv_heads + r) * group + j) * d, sum = 0.0f;
                memset(o, 0, (size_t)d * sizeof(float));
                for (int64_t c = 0; c < chunks; c++) {
                    const float *item = part + ((r * chunks + c) * group) * (d + 2);
                    const float top = item[group * d + j];
                    if (top == -INFINITY) continue; /* no visible key in this chunk */
                    const float f = expf(top - best);
                    sum += f * item[group * d + group + j];
                    for (int64_t x = 0; x < d; x++) o[x] += f * item[j * d + x];
                }
                const float inv = 1.0f / sum; /* the query's own key is always visible, so sum >= 1 */
                for (int64_t x = 0; x < d; x++) o[x] *= inv;
            }
    }
    free(part);
    return 0;
}

/* x [T, hidden] float32 is updated in place to the layer's output; returns 0, or -1 when scratch memory
 * could not be had (x is then untouched). */
/* Each of T rows' experts: top[t k + j] the expert, weight[t k + j] its weight, as engine.model.Router gives them
 * (rms_norm(x) times the learned scale and hidden^-0.5, a softmax over every expert, the top k with the first of
 * equal probabilities first, renormalised, times each expert's own scale). x: the residual stream [T, hidden]. */
static int route(const dfa_layer *L, const float *x, int64_t T, int64_t *top, float *weight, int threads) {
    const int64_t H = L->hidden, E = L->experts, k = L->top_k;
    const float c = (float)(1.0 / sqrt((double)H));
    float *h = malloc((size_t)(T * H) * sizeof(float));
    float *p = malloc((size_t)(T * E) * sizeof(float));
    int16_t *xq = malloc((size_t)(T * H) * sizeof(int16_t));
    float *xs = malloc((size_t)(2 * T * (H / 32 + 1)) * sizeof(float));
    int status = -1;
    if (!h || !p || !xq || !xs) goto done;
    for (int64_t t = 0; t < T; t++) {
        float *ht = h + t * H;
        rms_norm(x + t * H, NULL, H, L->eps, ht);
        for (int64_t i = 0; i < H; i++) ht[i] = ht[i] * L->router_scale[i] * c;
    }
    if (L->router.q) {
        quantize(h, T, H, xq, xs, threads);
        matmul(&L->router, xq, xs, T, p, threads);
    } else {
        for (int64_t t = 0; t < T; t++)
            for (int64_t e = 0; e < E; e++) p[t * E + e] = dot(h + t * H, L->router_w + e * H, H);
    }
    for (int64_t t = 0; t < T; t++) {
        float *pt = p + t * E, top_p = -INFINITY, sum = 0.0f, chosen = 0.0f;
        for (int64_t e = 0; e < E; e++) top_p = pt[e] > top_p ? pt[e] : top_p;
        for (int64_t e = 0; e < E; e++) sum += pt[e] = expf(pt[e] - top_p);
        for (int64_t e = 0; e < E; e++) pt[e] /= sum;
        for (int64_t j = 0; j < k; j++) { /* k rounds of the largest not yet taken: k is 8 of 128 */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= top[t * k + i] == e;
                if (!taken && (best < 0 || pt[e] > pt[best])) best = e;
            }
            top[t * k + j] = best;
            chosen += weight[t * k + j] = pt[best];
        }
        for (int64_t j = 0; j < k; j++)
            weight[t * k + j] = weight[t * k + j] / chosen * L->expert_scale[top[t * k + j]];
    }
    status = 0;
done:
    free(h); free(p); free(xq); free(xs);
    return status;
}

/* out [T, hidden] = each row's chosen experts' GeGLU MLPs over xn (pre_ff_norm_2 of the residual), weighted and
 * summed in ascending expert order as engine.model.Experts sums them. The rows that chose an expert go through its
 * matrices together, each row computed alone, so a row's sum never depends on the rows beside it. The experts are
 * dealt to the threads whole (a decode step's 8 are small matmuls, where splitting each across the threads paid a
 * parallel region and a barrier per matrix), each into scratch of its own; a matrix's bits do not depend on how
 * many threads compute it. */
static int run_experts(const dfa_layer *L, const float *xn, const int64_t *top, const float *weight, int64_t T,
                       float *out, int threads) {
    const int64_t H = L->hidden, W = L->expert_width, k = L->top_k, E = L->experts, widest = W > H ? W : H;
    const int64_t picks = T * k, B = widest / 32 + 1;
    int64_t *start = malloc((size_t)(E + 1) * sizeof(int64_t)); /* expert e's rows: start[e] .. start[e + 1] - 1 */
    int64_t *used = malloc((size_t)picks * sizeof(int64_t));
    int64_t *rows = malloc((size_t)picks * sizeof(int64_t));
    float *row_w = malloc((size_t)picks * sizeof(float));
    float *in = malloc((size_t)(picks * H) * sizeof(float));
    float *gate_up = malloc((size_t)(picks * 2 * W) * sizeof(float));
    float *act = malloc((size_t)(picks * W) * sizeof(float));
    float *y = malloc((size_t)(picks * H) * sizeof(float));
    int16_t *xq = malloc((size_t)(picks * widest) * sizeof(int16_t));
    float *xs = malloc((size_t)(2 * picks * B) * sizeof(float));
    int status = -1;
    if (!start || !used || !rows || !row_w || !in || !gate_up || !act || !y || !xq || !xs) goto done;
    int64_t n_used = 0;
    start[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t R = start[e];
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < k; j++)
                if (top[t * k + j] == e) {
                    rows[R] = t;
                    row_w[R] = weight[t * k + j];
                    memcpy(in + R * H, xn + t * H, (size_t)H * sizeof(float));
                    R++;
                    break;
                }
        if (R > start[e]) used[n_used++] = e;
        start[e + 1] = R;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (n_used > 1)
    for (int64_t u = 0; u < n_used; u++) {
        const int64_t e = used[u], s = start[e], R = start[e + 1] - s;
        int16_t *eq = xq + s * widest;
        float *es = xs + 2 * s * B, *gu = gate_up + s * 2 * W, *a = act + s * W;
        quantize(in + s * H, R, H, eq, es, 1);
        matmul(&L->expert_gate_up[e], eq, es, R, gu, 1);
        for (int64_t r = 0; r < R; r++) {
            memcpy(a + r * W, gu + r * 2 * W, (size_t)W * sizeof(float));
            gelu_times(a + r * W, gu + r * 2 * W + W, W);
        }
        quantize(a, R, W, eq, es, 1);
        matmul(&L->expert_down[e], eq, es, R, y + s * H, 1);
    }
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    for (int64_t r = 0; r < start[E]; r++) /* ascending experts: each row's sum in engine.model's order */
        for (int64_t i = 0; i < H; i++) out[rows[r] * H + i] += y[r * H + i] * row_w[r];
    status = 0;
done:
    free(start); free(used); free(rows); free(row_w); free(in); free(gate_up); free(act); free(y); free(xq); free(xs);
    return status;
}

/* ffn [T, hidden] (the dense MLP's output) becomes post_ff_norm_1(ffn) + post_ff_norm_2(the routed experts' sum)
 * for the residual stream x: a MoE layer's feed-forward before its post_ff_norm. */
static int add_experts(const dfa_layer *L, const float *x, int64_t T, float *ffn, int threads) {
    const int64_t H = L->hidden;
    int64_t *top = malloc((size_t)(T * L->top_k) * sizeof(int64_t));
    float *weight = malloc((size_t)(T * L->top_k) * sizeof(float));
    float *xn = malloc((size_t)(T * H) * sizeof(float));
    float *routed = malloc((size_t)(T * H) * sizeof(float));
    int status = -1;
    if (!top || !weight || !xn || !routed || route(L, x, T, top, weight, threads)) goto done;
    for (int64_t t = 0; t < T; t++) rms_norm(x + t * H, L->pre_ff_norm_2, H, L->eps, xn + t * H);
    if (run_experts(L, xn, top, weight, T, routed, threads)) goto done;
    for (int64_t t = 0; t < T; t++) {
        rms_norm(ffn + t * H, L->post_ff_norm_1, H, L->eps, ffn + t * H);
        rms_norm(routed + t * H, L->post_ff_norm_2, H, L->eps, routed + t * H);
        for (int64_t i = 0; i < H; i++) ffn[t * H + i] += routed[t * H + i];
    }
    status = 0;
done:
    free(top); free(weight); free(xn); free(routed);
    return status;
}

/* x [T, hidden] += post_per_layer_norm(per_layer_proj(gelu(per_layer_gate(x)) * pl)): a PLE layer's per-layer
 * input, pl row t at pl + t * stride. Scratch: gate [T, width], out [T, hidden], xq / xs for T rows of the wider. */
static void add_per_layer(const dfa_layer *L, float *x, int64_t T, const float *pl, int64_t stride, float *gate,
                          float *out, int16_t *xq, float *xs, int threads) {
    const int64_t H = L->hidden, P = L->per_layer_width;
    quantize(x, T, H, xq, xs, threads);
    matmul(&L->per_layer_gate, xq, xs, T, gate, threads);
    for (int64_t t = 0; t < T; t++) gelu_times(gate + t * P, pl + t * stride, P);
    quantize(gate, T, P, xq, xs, threads);
    matmul(&L->per_layer_proj, xq, xs, T, out, threads);
    for (int64_t t = 0; t < T; t++) {
        rms_norm(out + t * H, L->post_per_layer_norm, H, L->eps, out + t * H);
        for (int64_t i = 0; i < H; i++) x[t * H + i] += out[t * H + i];
    }
}

static int layer_forward(const dfa_layer *L, const dfa_kv *kvs, const int64_t *groups, int64_t G, float *x,
                         int64_t T, const int64_t *q_pos, const float *cos, const float *sin, const float *pl,
                         int64_t pl_stride, int threads) {
    const int64_t H = L->hidden, d = L->head_dim, nq = L->heads * d, nkv = L->kv_heads * d;
    const int64_t I = L->intermediate > L->per_layer_width ? L->intermediate : L->per_layer_width;
    const int64_t widest = I > nq ? (I > H ? I : H) : (nq > H ? nq : H);
    float *xn = malloc((size_t)(T * widest) * sizeof(float));
    float *q = malloc((size_t)(T * nq) * sizeof(float));
    float *k = malloc((size_t)(T * nkv) * sizeof(float));
    float *v = malloc((size_t)(T * nkv) * sizeof(float));
    float *att = malloc((size_t)(T * nq) * sizeof(float));
    float *gate = malloc((size_t)(T * I) * sizeof(float));
    float *up = malloc((size_t)(T * I) * sizeof(float));
    int16_t *xq = malloc((size_t)(T * widest) * sizeof(int16_t));
    float *xs = malloc((size_t)(2 * T * (widest / 32)) * sizeof(float));
    int status = -1;
    if (!xn || !q || !k || !v || !att || !gate || !up || !xq || !xs) goto done;

    /* attention */
    for (int64_t t = 0; t < T; t++) rms_norm(x + t * H, L->input_norm, H, L->eps, xn + t * H);
    quantize(xn, T, H, xq, xs, threads);
    matmul(&L->q_proj, xq, xs, T, q, threads);
    const int owns_kv = L->k_proj.q != NULL; /* else the owner layer wrote this step's keys before */
    if (owns_kv) matmul(&L->k_proj, xq, xs, T, k, threads);
    if (owns_kv && L->v_proj.q)
        matmul(&L->v_proj, xq, xs, T, v, threads);
    else if (owns_kv)
        memcpy(v, k, (size_t)(T * nkv) * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < L->heads; h++) {
            float *qh = q + (t * L->heads + h) * d;
            rms_norm(qh, L->q_norm, d, L->eps, qh);
            rope(qh, cos + t * d, sin + t * d, d);
        }
        for (int64_t h = 0; owns_kv && h < L->kv_heads; h++) {
            float *kh = k + (t * L->kv_heads + h) * d, *vh = v + (t * L->kv_heads + h) * d;
            rms_norm(kh, L->k_norm, d, L->eps, kh);
            rope(kh, cos + t * d, sin + t * d, d);
            if (L->v_norm) rms_norm(vh, NULL, d, L->eps, vh);
        }
    }
    for (int64_t g = 0; g < G; g++) { /* each sequence's rows write its own cache, then attend to it */
        const dfa_kv *kv = kvs + g;
        const int64_t t0 = groups[g], rows = groups[g + 1] - groups[g];
        for (int64_t t = t0; owns_kv && t < t0 + rows; t++) {
            memcpy(kv->k + kv->write_slots[t - t0] * nkv, k + t * nkv, (size_t)nkv * sizeof(float));
            memcpy(kv->v + kv->write_slots[t - t0] * nkv, v + t * nkv, (size_t)nkv * sizeof(float));
        }
        if (rows > 0 && attention(L, kv, q + t0 * nq, q_pos + t0, rows, att + t0 * nq, threads)) goto done;
    }
    quantize(att, T, nq, xq, xs, threads);
    matmul(&L->o_proj, xq, xs, T, xn, threads);
    for (int64_t t = 0; t < T; t++) {
        rms_norm(xn + t * H, L->post_attn_norm, H, L->eps, xn + t * H);
        for (int64_t i = 0; i < H; i++) x[t * H + i] += xn[t * H + i];
    }

    /* feed-forward */
    for (int64_t t = 0; t < T; t++) rms_norm(x + t * H, L->pre_ff_norm, H, L->eps, xn + t * H);
    quantize(xn, T, H, xq, xs, threads);
    matmul(&L->gate, xq, xs, T, gate, threads);
    matmul(&L->up, xq, xs, T, up, threads);
    gelu_times(gate, up, T * I);
    quantize(gate, T, I, xq, xs, threads);
    matmul(&L->down, xq, xs, T, xn, threads);
    if (L->experts && add_experts(L, x, T, xn, threads)) goto done;
    for (int64_t t = 0; t < T; t++) {
        rms_norm(xn + t * H, L->post_ff_norm, H, L->eps, xn + t * H);
        for (int64_t i = 0; i < H; i++) x[t * H + i] += xn[t * H + i];
    }
    if (L->per_layer_width) add_per_layer(L, x, T, pl, pl_stride, gate, xn, xq, xs, threads);
    for (int64_t i = 0; i < T * H; i++) x[i] *= L->layer_scalar;
    status = 0;
done:
    free(xn); free(q); free(k); free(v); free(att); free(gate); free(up); free(xq); free(xs);
    return status;
}

/* y [T, w->n] = (x / rms(x) * norm) @ w^T for x [T, w->k]: the final norm and the LM head of a step in one call
 * (each row alone, as everywhere here). Returns 0, or -1 when scratch memory could not be had. */
/* The greedy pick of many rows' LM head (a verification block), without forming every logit exactly: an 8-bit copy
 * of the head (dfa_screen) multiplied with VNNI's u8 x s8 dot (64 products per instruction against the exact
 * path's 16; AVX2's vpmaddubsw and vpmaddwd, 32 in two) gives each logit to within a bound, and only a row's
 * candidates, whose upper bound reaches the best lower bound, are computed exactly, by the matmul norm_linear runs:
 * the pick is the exact path's, bit for bit (its first largest logit), which keeps greedy speculation lossless.
 *
 * Activations x (normed, as norm_linear has them) go to int8 per block of 32 at scale sx_b = max|x_b| / SCREEN_X, the
 * head to int8 per block at d_b (a Q8_0 head's own integers). For head row w, the exact path computes
 * L = sum_b d_b xs_b D_b in float: within 0.51 xs_b |w_b|_1 of w . x per block (its int16 quantization, 0.51 with
 * float's rounding of x / xs) and 2^-14 |w|_1 max|x| in all (its float rounding: far more than a few thousand blocks
 * can round). The screen's S = sum_b d_b sx_b I_b (I_b the exact integer dot) is within err_b |x8_b|_1 +
 * 0.51 sx_b |w_b|_1 per block of w . x (err_b the block's largest |d_b q - w| at repack: 0 for Q8_0), and as much
 * rounding. The sum of these, widened by 2^-10, plus 2^-21 |S| for S's own rounding, bounds |L - S|. */
#define SCREEN_TILE 6 /* activation rows per pass over two panels of 16 head rows: 24 accumulators */
/* The largest |x| the screen quantizes a block's activations to: VNNI's u8 x s8 dot sums to int32 at once; AVX2's
 * vpmaddubsw sums a pair of products to int16 first, which 255 x 127 x 2 would overflow (a coarser x: a wider bound) */
#if defined(DFA_AVX2) && !defined(DFA_AVX512)
#define SCREEN_X 63
#else
#define SCREEN_X 127
#endif
#define SCREEN_MAX 4096 /* candidates past which a row takes the full head instead (a row of zeros: all tie) */

typedef struct {
    int64_t *n;   /* head rows */
    float *upper; /* their upper bounds */
    int64_t len, cap;
} candidates;

/* Appends head row n with its upper bound; 0, or -1 when the list could not grow (the row then takes the full
 * head). */
static int add_candidate(candidates *c, int64_t n, float upper) {
    if (c->len == c->cap) {
        const int64_t cap = c->cap ? 2 * c->cap : 64;
        int64_t *rows = realloc(c->n, (size_t)cap * sizeof(int64_t));
        if (rows) c->n = rows;
        float *bounds = rows ? realloc(c->upper, (size_t)cap * sizeof(float)) : NULL;
        if (!bounds) return -1;
        c->upper = bounds;
        c->cap = cap;
    }
    c->n[c->len] = n;
    c->upper[c->len++] = upper;
    return 0;
}

/* The activation rows as the screen takes them, SCREEN_TILE rows to a tile (a last tile's missing rows zero), each
 * tile's values interleaved so that every broadcast of a row's four values lies at a constant offset. */
typedef struct {
    int32_t *q;     /* [tiles, K / 4, SCREEN_TILE]: four round(x / sx_b) as bytes */
    float *sx;      /* [tiles, B, SCREEN_TILE] */
    int32_t *init;  /* [tiles, B, SCREEN_TILE]: -128 times the sum of the block's q (the head's bytes are q + 128) */
    float *delta;   /* [T, B]: the bound's factor of |w_b|_1 */
    float *abs;     /* [T, B]: |x8_b|_1, sx_b times the sum of |q| (the factor of err_b) */
} screen_x;

/* Row t of x (K values, its int16 block scales xs) into the screen's arrays; 0, or -1 for a row with a NaN or an
 * infinity (the full head's to pick). */
static int screen_row(const float *x, const float *xs, int64_t K, int64_t t, const screen_x *out) {
    const int64_t B = K / 32, tile = t / SCREEN_TILE, r = t % SCREEN_TILE;
    float amax = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        const float a = fabsf(x[i]);
        if (!(a <= FLT_MAX)) return -1;
        amax = a > amax ? a : amax;
    }
    const float rounding = ldexpf(amax, -14);
    for (int64_t b = 0; b < B; b++) {
        float bmax = 0.0f;
        for (int i = 0; i < 32; i++) bmax = fabsf(x[b * 32 + i]) > bmax ? fabsf(x[b * 32 + i]) : bmax;
        const float scale = bmax / (float)SCREEN_X, inv = bmax > 0.0f ? (float)SCREEN_X / bmax : 0.0f;
        int32_t sum = 0, total = 0;
        int8_t q[32];
        for (int i = 0; i < 32; i++) {
            int v = (int)nearbyintf(x[b * 32 + i] * inv);
            v = v > SCREEN_X ? SCREEN_X : (v < -SCREEN_X ? -SCREEN_X : v);
            q[i] = (int8_t)v;
            sum += v;
            total += v < 0 ? -v : v;
        }
        for (int j = 0; j < 8; j++)
            memcpy(out->q + (tile * (K / 4) + b * 8 + j) * SCREEN_TILE + r, q + 4 * j, 4);
        out->sx[(tile * B + b) * SCREEN_TILE + r] = scale;
        out->init[(tile * B + b) * SCREEN_TILE + r] = -128 * sum;
        out->delta[t * B + b] = 0.51f * scale + 0.51f * xs[b] + rounding;
        out->abs[t * B + b] = scale * (float)total;
    }
    return 0;
}

/* Panel pair p (head rows 32 p .. 32 p + 31) against the R rows of tile `tile` (R a constant where inlined): each
 * row's candidates among them (upper bound at least the row's best lower bound so far, th[t], which it raises)
 * onto list[t]. */
static inline __attribute__((always_inline)) void screen_tile(const dfa_screen *s, int R, int64_t p,
                                                              const screen_x *x, int64_t tile, float *th,
                                                              candidates *list, int *failed) {
    const int64_t K = s->k, B = K / 32, t0 = tile * SCREEN_TILE;
    const int32_t *xq = x->q + tile * (K / 4) * SCREEN_TILE, *init = x->init + tile * B * SCREEN_TILE;
    const float *sx = x->sx + tile * B * SCREEN_TILE;
    float logit[SCREEN_TILE][32];
#ifdef DFA_AVX512
    const uint8_t *w0 = s->q + 2 * p * 16 * K, *w1 = w0 + 16 * K;
    const float *d0 = s->d + 2 * p * 16 * B, *d1 = d0 + 16 * B;
    __m512 acc0[SCREEN_TILE], acc1[SCREEN_TILE];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        __m512i dot0[SCREEN_TILE], dot1[SCREEN_TILE];
        for (int r = 0; r < R; r++) dot0[r] = dot1[r] = _mm512_set1_epi32(init[b * SCREEN_TILE + r]);
#pragma GCC unroll 8
        for (int k4 = 0; k4 < 8; k4++) {
            const __m512i a = _mm512_loadu_si512(w0 + (8 * b + k4) * 64), c = _mm512_loadu_si512(w1 + (8 * b + k4) * 64);
            for (int r = 0; r < R; r++) {
                const __m512i xb = _mm512_set1_epi32(xq[(8 * b + k4) * SCREEN_TILE + r]);
                dot0[r] = _mm512_dpbusd_epi32(dot0[r], a, xb);
                dot1[r] = _mm512_dpbusd_epi32(dot1[r], c, xb);
            }
        }
        const __m512 e0 = _mm512_loadu_ps(d0 + b * 16), e1 = _mm512_loadu_ps(d1 + b * 16);
        for (int r = 0; r < R; r++) {
            const __m512 scale = _mm512_set1_ps(sx[b * SCREEN_TILE + r]);
            acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0[r]), _mm512_mul_ps(e0, scale), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1[r]), _mm512_mul_ps(e1, scale), acc1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(logit[r], acc0[r]);
        _mm512_storeu_ps(logit[r] + 16, acc1[r]);
    }
#elif defined(DFA_AVX2)
    /* No u8 x s8 dot without VNNI: vpmaddubsw multiplies the head's bytes q + 128 by x and sums pairs to int16, which
     * holds them because this build's x stay within +-SCREEN_X (255 * 63 * 2 < 2^15); vpmaddwd sums the pairs to int32.
     * A quarter of the pair's 32 head rows (8 lanes) at a time, a block's bytes held in registers while each row
     * takes them. */
    const __m256i ones = _mm256_set1_epi16(1);
    for (int quarter = 0; quarter < 4; quarter++) {
        const uint8_t *w = s->q + (2 * p + quarter / 2) * 16 * K + (quarter % 2) * 32;
        const float *d = s->d + (2 * p + quarter / 2) * 16 * B + (quarter % 2) * 8;
        __m256 acc[SCREEN_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < B; b++) {
            __m256i q[8]; /* the block's bytes, kept in registers for every row */
            for (int k4 = 0; k4 < 8; k4++) q[k4] = _mm256_loadu_si256((const __m256i *)(w + (8 * b + k4) * 64));
            const __m256 e = _mm256_loadu_ps(d + b * 16);
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                __m256i dot = _mm256_set1_epi32(init[b * SCREEN_TILE + r]);
#pragma GCC unroll 8
                for (int k4 = 0; k4 < 8; k4++) {
                    const __m256i xb = _mm256_set1_epi32(xq[(8 * b + k4) * SCREEN_TILE + r]);
                    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(q[k4], xb), ones));
                }
                const __m256 scale = _mm256_mul_ps(e, _mm256_set1_ps(sx[b * SCREEN_TILE + r]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(logit[r] + 8 * quarter, acc[r]);
    }
#else
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 32; j++) {
            const int64_t panel = 2 * p + j / 16, lane = j % 16;
            float total = 0.0f;
            for (int64_t b = 0; b < B; b++) {
                int32_t dot = init[b * SCREEN_TILE + r];
                for (int64_t k = 32 * b; k < 32 * b + 32; k++) {
                    const int8_t *four = (const int8_t *)(xq + (k / 4) * SCREEN_TILE + r);
                    dot += (int32_t)s->q[panel * 16 * K + (k / 4) * 64 + lane * 4 + k % 4] * four[k % 4];
                }
                total += (float)dot * (s->d[(panel * B + b) * 16 + lane] * sx[b * SCREEN_TILE + r]);
            }
            logit[r][j] = total;
        }
#endif
    const float widen = 1.0f + ldexpf(1.0f, -10), own = ldexpf(1.0f, -21);
    for (int r = 0; r < R; r++) {
        const float *delta = x->delta + (t0 + r) * B, *abs = x->abs + (t0 + r) * B;
        float bound[32], upper[32], best = th[t0 + r];
        for (int half = 0; half < 2; half++) { /* each panel's 16 rows: lane i row 16 (2 p + half) + i */
            const float *l1 = s->l1 + (2 * p + half) * 16 * B, *err = s->err ? s->err + (2 * p + half) * 16 * B : NULL;
#ifdef DFA_AVX512
            __m512 sum = _mm512_setzero_ps();
            for (int64_t b = 0; b < B; b++) {
                sum = _mm512_fmadd_ps(_mm512_loadu_ps(l1 + b * 16), _mm512_set1_ps(delta[b]), sum);
                if (err) sum = _mm512_fmadd_ps(_mm512_loadu_ps(err + b * 16), _mm512_set1_ps(abs[b]), sum);
            }
            _mm512_storeu_ps(bound + 16 * half, sum);
#elif defined(DFA_AVX2)
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            for (int64_t b = 0; b < B; b++) {
                const __m256 scale = _mm256_set1_ps(delta[b]);
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(l1 + b * 16), scale, lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(l1 + b * 16 + 8), scale, hi);
                if (err) {
                    const __m256 size = _mm256_set1_ps(abs[b]);
                    lo = _mm256_fmadd_ps(_mm256_loadu_ps(err + b * 16), size, lo);
                    hi = _mm256_fmadd_ps(_mm256_loadu_ps(err + b * 16 + 8), size, hi);
                }
            }
            _mm256_storeu_ps(bound + 16 * half, lo);
            _mm256_storeu_ps(bound + 16 * half + 8, hi);
#else
            for (int i = 0; i < 16; i++) {
                float sum = 0.0f;
                for (int64_t b = 0; b < B; b++) {
                    sum += l1[b * 16 + i] * delta[b];
                    if (err) sum += err[b * 16 + i] * abs[b];
                }
                bound[16 * half + i] = sum;
            }
#endif
        }
        for (int j = 0; j < 32; j++) {
            const int64_t n = 32 * p + j;
            const float e = bound[j] * widen + fabsf(logit[r][j]) * own;
            upper[j] = n < s->n ? logit[r][j] + e : -INFINITY;
            const float lower = n < s->n ? logit[r][j] - e : -INFINITY;
            best = lower > best ? lower : best;
        }
        th[t0 + r] = best;
        for (int j = 0; j < 32; j++)
            if (upper[j] >= best && add_candidate(&list[t0 + r], 32 * p + j, upper[j])) *failed = 1;
    }
}

/* Rows' candidates over panel pairs [p0, p1), a tile of rows at a time (R a constant in each call). */
static void screen_pairs(const dfa_screen *s, const screen_x *x, int64_t T, int64_t p0, int64_t p1, float *th,
                         candidates *list, int *failed) {
    for (int64_t p = p0; p < p1; p++)
        for (int64_t tile = 0; tile * SCREEN_TILE < T; tile++) {
            switch (T - tile * SCREEN_TILE < SCREEN_TILE ? T - tile * SCREEN_TILE : SCREEN_TILE) {
#define SCREEN_ROWS(R) case R: screen_tile(s, R, p, x, tile, th, list, failed); break;
                SCREEN_ROWS(1) SCREEN_ROWS(2) SCREEN_ROWS(3) SCREEN_ROWS(4) SCREEN_ROWS(5) SCREEN_ROWS(6)
#undef SCREEN_ROWS
            }
        }
}

/* Weight row n of w alone, as a matrix of one row (the same bytes). */
static dfa_matrix matrix_row(const dfa_matrix *w, int64_t n) {
    const int64_t K = w->k, G = K / w->group, high = w->bits - 4;
    const int64_t scale_bytes = w->scales == DFA_SCALES_F32   ? G * 4
                                : w->scales == DFA_SCALES_F16 ? G * 2
                                : w->scales == DFA_SCALES_K   ? K / 256 * 16
                                                              : K / 256 * 18;
    dfa_matrix row = *w;
    row.q = (const char *)w->q + n * (w->bits == 8 ? K : K / 2);
    row.qh = w->qh && high > 0 ? w->qh + n * (K / 32) * high : w->qh;
    row.d = (const char *)w->d + n * scale_bytes;
    row.m = w->m ? w->m + n * G : NULL;
    row.n = 1;
    return row;
}

int dfa_norm_head_argmax(const float *x, int64_t T, const float *norm, float eps, const dfa_matrix *w,
                         const dfa_screen *s, int64_t *tokens, int threads) {
    const int64_t K = w->k, B = K / 32, pairs = (s->n + 31) / 32;
    if (s->k != K || s->n != w->n || threads < 1) return -2;
    if (T <= 0) return 0;
    float *xn = malloc((size_t)(T * K) * sizeof(float));
    int16_t *xq = malloc((size_t)(T * K) * sizeof(int16_t));
    float *xs = malloc((size_t)(2 * T * B) * sizeof(float));
    const int64_t tiles = (T + SCREEN_TILE - 1) / SCREEN_TILE, padded = tiles * SCREEN_TILE;
    screen_x rows = {calloc((size_t)(padded * K / 4), sizeof(int32_t)), calloc((size_t)(padded * B), sizeof(float)),
                     calloc((size_t)(padded * B), sizeof(int32_t)), malloc((size_t)(2 * T * B) * sizeof(float)), NULL};
    rows.abs = rows.delta ? rows.delta + T * B : NULL;
    int *ok = malloc((size_t)T * sizeof(int));
    float *th = malloc((size_t)(threads * T) * sizeof(float));
    candidates *lists = calloc((size_t)(threads * T), sizeof(candidates));
    int failed = !(xn && xq && xs && rows.q && rows.sx && rows.init && rows.delta && ok && th && lists);
    const int status = failed ? -1 : 0;
    if (!failed) {
        for (int64_t t = 0; t < T; t++) rms_norm(x + t * K, norm, K, eps, xn + t * K);
        quantize(xn, T, K, xq, xs, threads);
        for (int64_t t = 0; t < T; t++) ok[t] = screen_row(xn + t * K, xs + t * B, K, t, &rows) == 0;
        for (int64_t i = 0; i < threads * T; i++) th[i] = -INFINITY;
#pragma omp parallel num_threads(threads)
        {
            const int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
            int mine = 0;
            screen_pairs(s, &rows, T, pairs * id / count, pairs * (id + 1) / count, th + id * T, lists + id * T, &mine);
            if (mine) {
#pragma omp atomic write
                failed = 1;
            }
        }
#pragma omp parallel for num_threads(threads) schedule(dynamic)
        for (int64_t t = 0; t < T; t++) {
            float best = -INFINITY, top = -INFINITY;
            int64_t count = 0, pick = -1;
            for (int i = 0; i < threads; i++) best = th[i * T + t] > best ? th[i * T + t] : best;
            for (int i = 0; i < threads; i++)
                for (int64_t j = 0; j < lists[i * T + t].len; j++) count += lists[i * T + t].upper[j] >= best;
            if (!ok[t] || failed || count > SCREEN_MAX) { /* the full head for this row, in the caller */
                tokens[t] = -1;
                continue;
            }
            for (int i = 0; i < threads && pick != -2; i++) {
                const candidates *list = &lists[i * T + t];
                for (int64_t j = 0; j < list->len; j++) {
                    const int64_t n = list->n[j];
                    if (list->upper[j] < best) continue; /* below another thread's best lower bound */
                    const dfa_matrix row = matrix_row(w, n);
                    float logit;
                    dfa_matmul(xq + t * K, xs + t * B, xs + T * B + t * B, 1, K, row.q, (int)row.bits, row.qh,
                               (int)row.offset, row.d, (int)row.scales, row.m, row.group, 1, &logit, 1);
                    if (isnan(logit)) { /* NaN is the exact path's pick: let it make it */
                        pick = -2;
                        break;
                    }
                    if (logit > top || (logit == top && n < pick)) {
                        top = logit;
                        pick = n;
                    }
                }
            }
            tokens[t] = pick < 0 ? -1 : pick;
        }
    }
    if (lists)
        for (int64_t i = 0; i < threads * T; i++) {
            free(lists[i].n);
            free(lists[i].upper);
        }
    free(xn); free(xq); free(xs); free(rows.q); free(rows.sx); free(rows.init); free(rows.delta); free(ok);
    free(th); free(lists);
    return status;
}

/* The ABI the Python side (kernels/cpu/cpu_dot.py) was written against: DFA_ABI_VERSION, and the size of each struct
 * it mirrors with ctypes (which 0: dfa_matrix, 1: dfa_layer, 2: dfa_kv, 3: dfa_screen; else -1). A library built from
 * other sources (a stale prebuilt variant) is refused rather than called with misread structs. */
#ifndef DFA_SOURCE_DIGEST
#define DFA_SOURCE_DIGEST "" /* set by every build (kernels/cpu/build.py): the sources it compiled */
#endif

/* Which sources the library was built from: kernels/cpu/cpu_dot.py loads no library older than the files beside it. */
const char *dfa_source_digest(void) { return DFA_SOURCE_DIGEST; }

int64_t dfa_abi(int which) {
    switch (which) {
    case -1: return DFA_ABI_VERSION;
    case 0: return (int64_t)sizeof(dfa_matrix);
    case 1: return (int64_t)sizeof(dfa_layer);
    case 2: return (int64_t)sizeof(dfa_kv);
    case 3: return (int64_t)sizeof(dfa_screen);
    default: return -1;
    }
}

/* Every field of the ABI structs, by name, offset and size: kernels/cpu/cpu_dot.py checks its ctypes mirror field by
 * field against these, so a field moved, renamed, retyped or added on one side only is refused at load. */
typedef struct {
    const char *name;
    int64_t offset, size;
} dfa_abi_entry;
#define DFA_FIELD(s, f) {#f, (int64_t)offsetof(s, f), (int64_t)sizeof(((s *)0)->f)}
static const dfa_abi_entry dfa_matrix_fields[] = {
    DFA_FIELD(dfa_matrix, q),
    DFA_FIELD(dfa_matrix, qh),
    DFA_FIELD(dfa_matrix, d),
    DFA_FIELD(dfa_matrix, m),
    DFA_FIELD(dfa_matrix, group),
    DFA_FIELD(dfa_matrix, bits),
    DFA_FIELD(dfa_matrix, offset),
    DFA_FIELD(dfa_matrix, n),
    DFA_FIELD(dfa_matrix, k),
    DFA_FIELD(dfa_matrix, scales),
};
static const dfa_abi_entry dfa_layer_fields[] = {
    DFA_FIELD(dfa_layer, q_proj),
    DFA_FIELD(dfa_layer, k_proj),
    DFA_FIELD(dfa_layer, v_proj),
    DFA_FIELD(dfa_layer, o_proj),
    DFA_FIELD(dfa_layer, gate),
    DFA_FIELD(dfa_layer, up),
    DFA_FIELD(dfa_layer, down),
    DFA_FIELD(dfa_layer, input_norm),
    DFA_FIELD(dfa_layer, post_attn_norm),
    DFA_FIELD(dfa_layer, pre_ff_norm),
    DFA_FIELD(dfa_layer, post_ff_norm),
    DFA_FIELD(dfa_layer, q_norm),
    DFA_FIELD(dfa_layer, k_norm),
    DFA_FIELD(dfa_layer, hidden),
    DFA_FIELD(dfa_layer, heads),
    DFA_FIELD(dfa_layer, kv_heads),
    DFA_FIELD(dfa_layer, head_dim),
    DFA_FIELD(dfa_layer, intermediate),
    DFA_FIELD(dfa_layer, v_norm),
    DFA_FIELD(dfa_layer, eps),
    DFA_FIELD(dfa_layer, scale),
    DFA_FIELD(dfa_layer, layer_scalar),
    DFA_FIELD(dfa_layer, router),
    DFA_FIELD(dfa_layer, router_w),
    DFA_FIELD(dfa_layer, router_scale),
    DFA_FIELD(dfa_layer, expert_scale),
    DFA_FIELD(dfa_layer, expert_gate_up),
    DFA_FIELD(dfa_layer, expert_down),
    DFA_FIELD(dfa_layer, post_ff_norm_1),
    DFA_FIELD(dfa_layer, pre_ff_norm_2),
    DFA_FIELD(dfa_layer, post_ff_norm_2),
    DFA_FIELD(dfa_layer, experts),
    DFA_FIELD(dfa_layer, top_k),
    DFA_FIELD(dfa_layer, expert_width),
    DFA_FIELD(dfa_layer, per_layer_gate),
    DFA_FIELD(dfa_layer, per_layer_proj),
    DFA_FIELD(dfa_layer, post_per_layer_norm),
    DFA_FIELD(dfa_layer, per_layer_width),
};
static const dfa_abi_entry dfa_kv_fields[] = {
    DFA_FIELD(dfa_kv, k),
    DFA_FIELD(dfa_kv, v),
    DFA_FIELD(dfa_kv, slots),
    DFA_FIELD(dfa_kv, write_slots),
    DFA_FIELD(dfa_kv, key_pos),
    DFA_FIELD(dfa_kv, n_keys),
    DFA_FIELD(dfa_kv, window),
};
static const dfa_abi_entry dfa_screen_fields[] = {
    DFA_FIELD(dfa_screen, q),
    DFA_FIELD(dfa_screen, d),
    DFA_FIELD(dfa_screen, l1),
    DFA_FIELD(dfa_screen, err),
    DFA_FIELD(dfa_screen, n),
    DFA_FIELD(dfa_screen, k),
};

const char *dfa_abi_field(int s, int i, int64_t *offset, int64_t *size) {
    static const struct { const dfa_abi_entry *fields; int n; } structs[] = {
        {dfa_matrix_fields, (int)(sizeof dfa_matrix_fields / sizeof *dfa_matrix_fields)},
        {dfa_layer_fields, (int)(sizeof dfa_layer_fields / sizeof *dfa_layer_fields)},
        {dfa_kv_fields, (int)(sizeof dfa_kv_fields / sizeof *dfa_kv_fields)},
        {dfa_screen_fields, (int)(sizeof dfa_screen_fields / sizeof *dfa_screen_fields)},
    };
    if (s < 0 || s >= (int)(sizeof structs / sizeof *structs) || i < 0 || i >= structs[s].n) return NULL;
    *offset = structs[s].fields[i].offset;
    *size = structs[s].fields[i].size;
    return structs[s].fields[i].name;
}

int dfa_norm_linear(const float *x, int64_t T, const float *norm, float eps, const dfa_matrix *w, float *y,
                    int threads) {
    const int64_t K = w->k;
    float *xn = malloc((size_t)(T * K) * sizeof(float));
    int16_t *xq = malloc((size_t)(T * K) * sizeof(int16_t));
    float *xs = malloc((size_t)(2 * T * (K / 32)) * sizeof(float));
    int status = -1;
    if (xn && xq && xs) {
        for (int64_t t = 0; t < T; t++) rms_norm(x + t * K, norm, K, eps, xn + t * K);
        quantize(xn, T, K, xq, xs, threads);
        matmul(w, xq, xs, T, y, threads);
        status = 0;
    }
    free(xn); free(xq); free(xs);
    return status;
}

/* cos / sin [T, 2 half] of NeoX RoPE at positions pos [T] with inv_freq [half] (dim i and i + half share an
 * angle), the angle a float32 product as engine.model.rope_tables computes it. */
void dfa_rope_table(const int64_t *pos, int64_t T, const float *inv_freq, int64_t half, float *cos, float *sin) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            const float angle = (float)pos[t] * inv_freq[i];
            cos[t * 2 * half + i] = cos[t * 2 * half + half + i] = cosf(angle);
            sin[t * 2 * half + i] = sin[t * 2 * half + half + i] = sinf(angle);
        }
}

/* n decoder layers in turn over x [T, hidden] (layer_forward each): a step's layers in one call. The rows belong
 * to G sequences, each with caches of its own: sequence g owns rows groups[g] .. groups[g + 1] - 1 (groups [G + 1],
 * ascending from 0 to T) and layer i's cache kvs[i * G + g], whose write_slots are indexed by the group's own rows.
 * The matmuls read each weight once for all rows (every row computed alone); norms, RoPE and attention go row by
 * row, so a row's result never depends on the other sequences in its step. Layer i reads the RoPE tables
 * cos[i] / sin[i] and copies its output into capture[i] unless that is NULL; a PLE model's layer i reads its input
 * of row t at per_layer + (t * n + i) * width ([T, n, width], the same width for every layer). Returns 0; -2 when
 * the groups do not split the rows, a MoE layer's top_k is not within its experts, a PLE model comes without
 * per_layer or with layers of different widths, or a write slot or n_keys lies outside a layer's
 * cache (checked for every layer first: nothing is then written, as a slot past the end would write over the
 * heap); or -1 when scratch memory could not be had (x then holds the output of the layers before the one that
 * failed). */
int dfa_layers_forward(const dfa_layer *layers, const dfa_kv *kvs, int64_t n, float *x, int64_t T,
                       const int64_t *q_pos, const float *const *cos, const float *const *sin,
                       float *const *capture, const int64_t *groups, int64_t G, const float *per_layer,
                       int threads) {
    if (G < 1 || groups[0] != 0 || groups[G] != T) return -2;
    for (int64_t i = 0; i < n; i++) {
        if (layers[i].experts && !(layers[i].top_k >= 1 && layers[i].top_k <= layers[i].experts)) return -2;
        if (layers[i].per_layer_width && (!per_layer || layers[i].per_layer_width != layers[0].per_layer_width))
            return -2;
    }
    for (int64_t g = 0; g < G; g++)
        if (groups[g + 1] < groups[g]) return -2;
    for (int64_t i = 0; i < n * G; i++) {
        const dfa_kv *kv = kvs + i;
        const int64_t g = i % G, rows = groups[g + 1] - groups[g];
        if (kv->n_keys < 0 || kv->n_keys > kv->slots) return -2;
        for (int64_t t = 0; t < rows; t++)
            if (kv->write_slots[t] < 0 || kv->write_slots[t] >= kv->slots) return -2;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t P = layers[i].per_layer_width;
        if (layer_forward(layers + i, kvs + i * G, groups, G, x, T, q_pos, cos[i], sin[i],
                          P ? per_layer + i * P : NULL, n * P, threads))
            return -1;
        if (capture[i]) memcpy(capture[i], x, (size_t)(T * layers[i].hidden) * sizeof(float));
    }
    return 0;
}
