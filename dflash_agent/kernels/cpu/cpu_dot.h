/* Every entry point of the CPU kernels library (cpu_dot.c: quantized matmuls, see there for the layouts; cpu_layer.c:
 * decoder layers), the structs kernels/cpu/cpu_dot.py mirrors with ctypes, and the vector ISA a build uses. */
#ifndef DFA_CPU_DOT_H
#define DFA_CPU_DOT_H
#include <stdint.h>

/* The vector code a build compiles: AVX2 + FMA (x86-64-v3), NEON (every aarch64 CPU), else scalar C. DFA_SCALAR
 * forces the scalar code, the reference each vector build is tested against (the generic variant). A build with
 * AVX-512 (F, BW, VL) and VNNI runs the AVX2 code with its integer dots fused (vpdpwssd) and twice the activation
 * rows per tile in its 32 registers (DFA_AVX512): the same bits as the AVX2 build, fewer instructions. */
#if !defined(DFA_SCALAR) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DFA_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define DFA_AVX512 1
#endif
#elif !defined(DFA_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define DFA_NEON 1
#endif

/* Bumped with any change to an entry point or a struct the Python side mirrors (see dfa_abi). */
#define DFA_ABI_VERSION 12

void dfa_quantize(const float *x, int64_t M, int64_t K, int16_t *xq, float *xs, float *xsum, int threads);
/* How a layout's scales d are stored (see cpu_dot.c): float32, float16, Q4_K / Q5_K super-block headers, or
 * Q6_K super-block tails. */
enum { DFA_SCALES_F32 = 0, DFA_SCALES_F16 = 1, DFA_SCALES_K = 2, DFA_SCALES_Q6K = 3 };

/* y [M, N] = xq @ w^T for a weight of `bits` 4, 5, 6 or 8 (qh: 5 and 6 only; d stored as `scales` says) */
void dfa_matmul(const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K, const void *q, int bits,
                const uint32_t *qh, int offset, const void *d, int scales, const float *m, int64_t group, int64_t N,
                float *y, int threads);

/* x [M, K] float32 quantized and multiplied in one call; 0, or -1 when its scratch could not be had */
int dfa_linear(const float *x, int64_t M, int64_t K, const void *q, int bits, const uint32_t *qh, int offset,
               const void *d, int scales, const float *m, int64_t group, int64_t N, float *y, int threads);

/* Which vector code this build runs: 3 AVX-512 + VNNI, 2 AVX2, 1 NEON, 0 scalar. */
int dfa_simd(void);
/* Sizes of the mirrored structs and the ABI version (see cpu_layer.c), and the sources' digest. */
int64_t dfa_abi(int which);
/* Field i of ABI struct s (the numbering of dfa_abi): its name, with its offset and size written to *offset and
 * *size; NULL past the last field or for an unknown struct. The Python mirror is checked against it by name. */
const char *dfa_abi_field(int s, int i, int64_t *offset, int64_t *size);
const char *dfa_source_digest(void);

/* w [N, K] float32 from a layout (ids: the rows to take, else NULL for all N) */
void dfa_dequantize(const void *q, int bits, const uint32_t *qh, int offset, const void *d, int scales,
                    const float *m, int64_t group, int64_t N, int64_t K, const int64_t *ids, float *w, int threads);
/* GGML's type ids of the formats dfa_repack reads. */
enum { DFA_GGML_Q4_0 = 2, DFA_GGML_Q5_0 = 6, DFA_GGML_Q8_0 = 8, DFA_GGML_Q4_K = 12, DFA_GGML_Q5_K = 13,
       DFA_GGML_Q6_K = 14 };
/* A GGUF matrix [N, K] of type qtype (its blocks as the file stores them) into its layout: q (u4 / u5 / u6: N K / 2
 * bytes; s8: N K), qh (u5: N K / 32 uint32; u6: twice that; else unused), d (the file's own scales: float16 N K / 32,
 * or the super-blocks' headers / tails, N K / 256 x 16 / 18 bytes). 0; -1 a type it does not read; -2 K not a
 * whole number of blocks. */
int dfa_repack(const uint8_t *blocks, int qtype, int64_t N, int64_t K, uint8_t *q, uint32_t *qh, uint8_t *d,
               int threads);
/* the index of the first largest of x[0..n), NaN largest (torch.argmax's rule) */
int64_t dfa_argmax(const float *x, int64_t n, int threads);
/* Ends the OpenMP threads that parallel regions started from the calling thread had kept (0; -1 when called from
 * inside a parallel region), so that thread's pool no longer counts against the cores (see cpu_dot.c). */
int dfa_release_threads(void);

typedef struct {  /* a weight in one of cpu_dot.c's layouts */
    const void *q;  /* NULL: no such matrix */
    const uint32_t *qh;
    const void *d;   /* stored as `scales` says (DFA_SCALES_*) */
    const float *m;
    int64_t group, bits, offset, n, k, scales;
} dfa_matrix;

/* y [M, w->n] = x [M, K] @ w^T with x quantized to int8 per block of 32 (prompt GEMMs, see cpu_dot.c): 0; -1 no
 * memory; -2 K is not the weight's */
int dfa_gemm_i8(const float *x, int64_t M, int64_t K, const dfa_matrix *w, float *y, int threads);

typedef struct {
    /* v_proj.q NULL: the values are the raw keys; k_proj.q NULL: the layer writes no K / V and attends over the
     * cache it is given (a KV-sharing layer, given the owner layer's) */
    dfa_matrix q_proj, k_proj, v_proj, o_proj, gate, up, down;
    /* norm weights as applied, offset + w, float32 */
    const float *input_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm, *q_norm, *k_norm;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, v_norm; /* v_norm: values RMS-normed, no weight */
    float eps, scale, layer_scalar;
    /* A MoE layer's routed experts beside the dense MLP (engine.model.Router / Experts); experts 0: none. Each
     * row's top_k of `experts` by the router, their GeGLU MLPs (expert_width wide) weighted and summed. */
    dfa_matrix router;                 /* [experts, hidden]; q NULL: router_w [experts, hidden] float32 instead */
    const float *router_w, *router_scale, *expert_scale; /* router_scale [hidden], expert_scale [experts] */
    const dfa_matrix *expert_gate_up;  /* [experts]: each [2 expert_width, hidden], the gate's rows first */
    const dfa_matrix *expert_down;     /* [experts]: each [hidden, expert_width] */
    const float *post_ff_norm_1, *pre_ff_norm_2, *post_ff_norm_2;
    int64_t experts, top_k, expert_width;
    /* E2B / E4B's per-layer input (per_layer_width 0: none): x += post_per_layer_norm(per_layer_proj(
     * gelu(per_layer_gate(x)) * the layer's slice of the per-layer inputs)), before the layer scalar */
    dfa_matrix per_layer_gate, per_layer_proj; /* [width, hidden], [hidden, width] */
    const float *post_per_layer_norm;
    int64_t per_layer_width;
} dfa_layer;

typedef struct {
    float *k, *v;                /* [slots, kv_heads, head_dim] */
    int64_t slots;               /* the caches' capacity: write_slots and n_keys are checked against it */
    const int64_t *write_slots;  /* [T]: where the new keys go */
    const int64_t *key_pos;      /* [n_keys]: the position each slot holds (-1: empty); NULL: the slot index */
    int64_t n_keys, window;      /* window 0: full attention */
} dfa_kv;

/* cpu_layer.c: n decoder layers over x [T, hidden] in place (0; -1 no memory; -2 bad groups or slots) */
int dfa_layers_forward(const dfa_layer *layers, const dfa_kv *kvs, int64_t n, float *x, int64_t T,
                       const int64_t *q_pos, const float *const *cos, const float *const *sin,
                       float *const *capture, const int64_t *groups, int64_t G, const float *per_layer,
                       int threads);
/* y [T, w->n] = rms_norm(x) * norm @ w^T (0; -1 no memory) */
int dfa_norm_linear(const float *x, int64_t T, const float *norm, float eps, const dfa_matrix *w, float *y,
                    int threads);
/* An LM head as 8-bit integers per block of 32, for dfa_norm_head_argmax's screen (see cpu_layer.c): row n's block b
 * ~ d (q - 128). Panels of 16 rows, the rows rounded up to 32 (the extra rows zero): q [n_pad / 16, k / 4, 16, 4]
 * (four consecutive values of each of the 16 rows in turn), the per-block floats [n_pad / 16, k / 32, 16]. */
typedef struct {
    const uint8_t *q;
    const float *d;
    const float *l1;  /* the sum of |w| over each block, rounded up */
    const float *err; /* the largest |d (q - 128) - w| of each block, rounded up; NULL: all 0 (a Q8_0 head) */
    int64_t n, k;
} dfa_screen;

/* tokens [T]: the index of the first largest of each row of rms_norm(x) * norm @ w^T, as dfa_norm_linear and
 * dfa_argmax give it, through the screen s of w; -1 for a row left to them (a NaN or an infinity, or too many
 * candidates). 0; -1 no memory; -2 a screen of another shape. */
int dfa_norm_head_argmax(const float *x, int64_t T, const float *norm, float eps, const dfa_matrix *w,
                         const dfa_screen *s, int64_t *tokens, int threads);
/* NeoX RoPE tables cos / sin [T, 2 half] at positions pos */
void dfa_rope_table(const int64_t *pos, int64_t T, const float *inv_freq, int64_t half, float *cos, float *sin);

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
