/* Weight-only quantized matmuls for the CPU: y[m, n] = sum_k x[m, k] w[n, k], with w kept as small
 * integers per group of inputs and x quantized to int8 per block of 32 (the integer dot is what makes
 * a CPU fast here: AVX2 multiplies 16 pairs of int16 per instruction, where float32 does 8; NEON 8 pairs per
 * multiply-accumulate pair where float32 does 4). Each vector path has the scalar code as its reference (DFA_SCALAR).
 *
 * Weights (kernels.cpu.cpu_dot repacks GGUF blocks into these, exactly):
 *   u4: w = d (q - offset) (+ m), q in 0..15, groups of 32 in 16 bytes: the group's runs of 8 values R0..R3 as
 *       bytes 0-7 holding R0 in their low nibbles and R1 in their high ones, bytes 8-15 holding R2 and R3 likewise
 *       (one broadcast, shift and two in-lane unpacks give the values in order). (Q4_0: offset 8; Q4_K: m.)
 *   u5: w = d (q - offset) (+ m), q in 0..31, groups of 32: the low 4 bits as u4, the fifth bits in one uint32
 *       per group, bit k for value (R0, R2, R1, R3 in turn: the order of the unpacked nibbles) k. (Q5_0: offset 16.)
 *   u6: w = d_j (q - 32), q in 0..63, groups of 32 in two runs of 16 with a scale each: the low 4 bits as u4, the
 *       top two in 8 bytes per group (two uint32), byte i holding those of values i, 8 + i, 16 + i and 24 + i (runs
 *       R0..R3) in its bits 0-1, 2-3, 4-5 and 6-7: one broadcast and shift per group line them up with the nibbles.
 *       (Q6_K, with DFA_SCALES_Q6K.)
 *   s8: w = d q (+ m), q int8, groups of G = 32 or 16.
 *   d, the scales (dfa_matrix.scales): DFA_SCALES_F32, float32 [N, K/G]; DFA_SCALES_F16, float16 [N, K/G] where
 *   the GGUF stores one float16 scale per block (Q4_0, Q5_0, Q8_0); DFA_SCALES_K (u4 / u5 with groups of 32, no m),
 *   the 16-byte header of each Q4_K / Q5_K super-block of 256 as the file has it, [N, K/256, 16] (k_scales);
 *   DFA_SCALES_Q6K (u6 only), the 18-byte tail of each Q6_K super-block as the file has it, its 16 int8 scales of
 *   the runs of 16 then float16 d, [N, K/256, 18] (q6_scales). Kept as the file stores them, a layout repacks at
 *   the file's own size. m (or NULL): float32 [N, K/G].
 * Activations: xq int16 [M, K], xs float [M, K/32] (x ~ xs xq per block), xsum float [M, K/32]
 * (xs times the sum of xq over each block: the m terms need only these).
 * Rows of w are split across `threads` OpenMP threads (the runtime torch already loaded) in panels of PANEL rows;
 * activation rows are taken TILE at a time, so each group of weights is unpacked once for TILE rows (verify, batched
 * decoding), and every tile passes over a panel while it is in L1.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dot.h"

int dfa_simd(void) {
#if defined(DFA_AVX512)
    return 3;
#elif defined(DFA_AVX2)
    return 2;
#elif defined(DFA_NEON)
    return 1;
#else
    return 0;
#endif
}

/* A block that no finite float32 scale carries: one holding a NaN or an infinity, or one so small that
 * 32767 / amax overflows. float32 arithmetic would make its row's outputs NaN or infinite, never a finite wrong
 * number, and so does this: a NaN makes the scale NaN (the row's outputs NaN); infinities become +-32767 at an
 * infinite scale and the finite values 0, so inf * w keeps its sign (+-inf, or NaN where a zero meets the infinite
 * scale, as in every AVX2 lane but the infinity's); a tiny block is quantized in double. Never converts a NaN or an
 * out-of-range float to int (undefined behaviour in C, INT_MIN with cvtps, which flipped +inf's sign). */
static float quantize_rare_block(const float *v, int16_t *q, int *sum) {
    float amax = 0.0f;
    int any_nan = 0;
    for (int i = 0; i < 32; i++) {
        any_nan |= isnan(v[i]);
        amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    }
    const double inv = amax > 0.0f && !isinf(amax) ? 32767.0 / (double)amax : 0.0;
    int total = 0;
    for (int i = 0; i < 32; i++) {
        const int qi = any_nan ? 0 : isinf(v[i]) ? (v[i] > 0.0f ? 32767 : -32767) : (int)nearbyint((double)v[i] * inv);
        q[i] = (int16_t)qi;
        total += qi;
    }
    *sum = total;
    return any_nan ? NAN : amax / 32767.0f;
}

/* One block of 32 activations -> int16 at scale amax / 32767, returning the scale; *sum gets the sum of the
 * integers. Round to nearest even, as nearbyintf in the default rounding mode. Blocks with a NaN, an infinity or
 * amax under 32767 / FLT_MAX take quantize_rare_block (one compare per block on the common path). */
static inline float quantize_block(const float *v, int16_t *q, int *sum) {
#ifdef DFA_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x0 = _mm256_loadu_ps(v), x1 = _mm256_loadu_ps(v + 8), x2 = _mm256_loadu_ps(v + 16),
           x3 = _mm256_loadu_ps(v + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    /* max_ps drops a NaN operand, so NaNs are looked for apart */
    const __m256 unord01 = _mm256_or_ps(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q), _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q));
    const __m256 unord23 = _mm256_or_ps(_mm256_cmp_ps(x2, x2, _CMP_UNORD_Q), _mm256_cmp_ps(x3, x3, _CMP_UNORD_Q));
    const __m256 unordered = _mm256_or_ps(unord01, unord23);
    const float scale = amax > 0.0f ? 32767.0f / amax : 0.0f;
    if (__builtin_expect(_mm256_movemask_ps(unordered) || !(amax <= FLT_MAX && scale <= FLT_MAX), 0))
        return quantize_rare_block(v, q, sum);
    const __m256 inv = _mm256_set1_ps(scale);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, inv));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, inv));
    /* packs interleaves 128-bit lanes; the permute puts the 16 values of each pair back in order */
    __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
    __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
    _mm256_storeu_si256((__m256i *)q, p01);
    _mm256_storeu_si256((__m256i *)(q + 16), p23);
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *sum = _mm_cvtsi128_si32(s4);
    return amax / 32767.0f;
#elif defined(DFA_NEON)
    float32x4_t x[8], mx = vdupq_n_f32(0.0f);
    for (int j = 0; j < 8; j++) {
        x[j] = vld1q_f32(v + 4 * j);
        mx = vmaxq_f32(mx, vabsq_f32(x[j])); /* FMAX keeps a NaN: amax is then NaN and takes the rare path */
    }
    const float amax = vmaxvq_f32(mx);
    const float scale = amax > 0.0f ? 32767.0f / amax : 0.0f;
    if (__builtin_expect(!(amax <= FLT_MAX && scale <= FLT_MAX), 0)) return quantize_rare_block(v, q, sum);
    int32x4_t total = vdupq_n_s32(0);
    for (int j = 0; j < 8; j += 2) {
        /* round to nearest even, as nearbyintf and AVX2's cvtps do: every build quantizes to the same integers */
        const int32x4_t i0 = vcvtnq_s32_f32(vmulq_n_f32(x[j], scale));
        const int32x4_t i1 = vcvtnq_s32_f32(vmulq_n_f32(x[j + 1], scale));
        vst1q_s16(q + 4 * j, vcombine_s16(vqmovn_s32(i0), vqmovn_s32(i1)));
        total = vaddq_s32(total, vaddq_s32(i0, i1));
    }
    *sum = vaddvq_s32(total);
    return amax / 32767.0f;
#else
    float amax = 0.0f;
    int any_nan = 0;
    for (int i = 0; i < 32; i++) {
        float a = fabsf(v[i]);
        any_nan |= isnan(a);
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    if (any_nan || !(amax <= FLT_MAX && inv <= FLT_MAX)) return quantize_rare_block(v, q, sum);
    int total = 0;
    for (int i = 0; i < 32; i++) {
        int qi = (int)nearbyintf(v[i] * inv);
        q[i] = (int16_t)qi;
        total += qi;
    }
    *sum = total;
    return amax / 32767.0f;
#endif
}

void dfa_quantize(const float *x, int64_t M, int64_t K, int16_t *xq, float *xs, float *xsum, int threads) {
    const int64_t B = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 4)
    for (int64_t r = 0; r < M * B; r++) {
        int sum;
        const float d = quantize_block(x + r * 32, xq + r * 32, &sum);
        xs[r] = d;
        xsum[r] = d * (float)sum;
    }
}

/* Activation rows per tile: as many as the accumulators (two per row) and a block's weights keep in registers (AVX2
 * has 16: 6 or 8 rows spilled; AVX-512 has 32). A row's result does not depend on it. */
#ifdef DFA_AVX512
#define TILE 8
#else
#define TILE 4
#endif
/* How far ahead of the row being computed its successors' bytes are fetched: the hardware prefetcher alone
 * keeps too few lines in flight while the core computes, leaving the matmuls at 60-70% of the memory
 * bandwidth a plain read gets (the 262k-row LM head: 21 GB/s against 30). */
#define PREFETCH_BYTES 2048

/* Start loading `bytes` from p into the cache (no fault past the end of an array: prefetches never trap). */
static inline void prefetch(const void *p, int64_t bytes) {
    /* GCC's builtin: _mm_prefetch's were dropped from some inlined loops at -O3 */
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

/* Rows ahead to prefetch, for rows of `row_bytes` bytes. */
static inline int64_t rows_ahead(int64_t row_bytes) {
    return row_bytes > 0 ? PREFETCH_BYTES / row_bytes + 1 : 1;
}

/* The 4-bit value v (0..31) of a u4 / u5 group, and the bit of its fifth bit (see the layouts above). */
static inline int nibble(const uint8_t *g, int v) {
    const int run = v / 8, byte = (run / 2) * 8 + v % 8;
    return run % 2 ? g[byte] >> 4 : g[byte] & 0x0F;
}

static inline int fifth_bit(int v) {
    const int run = v / 8;
    return ((run & 1) << 4) | ((run >> 1) << 3) | (v % 8);
}

/* Value v (0..63) of a u4 / u5 / u6 group (high: 0 / 1 / 2 bits past the nibble, in the group's words hb). */
static inline int nibble_value(const uint8_t *g, const uint32_t *hb, int high, int v) {
    int u = nibble(g, v);
    if (high == 1) u |= (int)(hb[0] >> fifth_bit(v) & 1) << 4;
    if (high == 2) u |= (((const uint8_t *)hb)[v % 8] >> (2 * (v / 8)) & 3) << 4;
    return u;
}

/* A float16 as float32, exactly (every half is a float): F16C's vcvtph2ps, NEON's fcvt, or by its bits. */
static inline float half_to_float(uint16_t h) {
#if defined(DFA_AVX2)
    return _cvtsh_ss(h);
#elif defined(DFA_NEON)
    __fp16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = h >> 10 & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float */
        const float v = ldexpf((float)mantissa, -24);
        return sign ? -v : v;
    }
    const uint32_t body = exponent == 0x1F ? 0x7F800000u : (exponent + 112) << 23; /* inf / NaN, or rebiased */
    const uint32_t bits = sign | body | mantissa << 13;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

/* Scale i of a row stored as float32 or float16 (scales DFA_SCALES_F32 / F16, a constant where inlined). */
static inline __attribute__((always_inline)) float scale_at(const void *d, int scales, int64_t i) {
    return scales == DFA_SCALES_F16 ? half_to_float(((const uint16_t *)d)[i]) : ((const float *)d)[i];
}

/* The scales d and offsets m of the 8 groups of 32 in one Q4_K / Q5_K super-block, from its 16-byte header as
 * the GGUF stores it (float16 d and dmin, then 6-bit scales and mins packed in 12 bytes: ggml's get_scale_min_k4):
 * d_j = d sc_j and m_j = -dmin mn_j, the float32 products the file's dequantization forms. */
static inline void k_scales(const uint8_t *header, float d[8], float m[8]) {
    const float super = half_to_float((uint16_t)(header[0] | header[1] << 8));
    const float super_min = half_to_float((uint16_t)(header[2] | header[3] << 8));
    /* bytes 0-3: scales 0-3 in their low 6 bits, the top 2 bits of scales 4-7; bytes 4-7 the same for the mins;
     * bytes 8-11: the low 4 bits of scales 4-7 and of mins 4-7. Four bytes at a time (little-endian), then the
     * 8 + 8 products in vector registers (a scalar loop here cost a Q4_K row 25% of its time). */
    uint32_t u[3], packed[4];
    memcpy(u, header + 4, sizeof u);
    const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, top2 = 0x03030303u;
    packed[0] = u[0] & low6;                               /* scales 0-3 */
    packed[1] = (u[2] & low4) | (u[0] >> 6 & top2) << 4;   /* scales 4-7 */
    packed[2] = u[1] & low6;                               /* mins 0-3 */
    packed[3] = (u[2] >> 4 & low4) | (u[1] >> 6 & top2) << 4; /* mins 4-7 */
#if defined(DFA_AVX2)
    const __m128i sm = _mm_loadu_si128((const __m128i *)packed);
    _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_set1_ps(super), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm, sm)));
    _mm256_storeu_ps(m, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(super_min), mins), _mm256_set1_ps(-0.0f)));
#elif defined(DFA_NEON)
    const uint8x16_t sm = vld1q_u8((const uint8_t *)packed);
    const uint16x8_t scales = vmovl_u8(vget_low_u8(sm)), mins = vmovl_u8(vget_high_u8(sm));
    vst1q_f32(d, vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(scales))), super));
    vst1q_f32(d + 4, vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_high_u16(scales))), super));
    vst1q_f32(m, vnegq_f32(vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(mins))), super_min)));
    vst1q_f32(m + 4, vnegq_f32(vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_high_u16(mins))), super_min)));
#else
    uint8_t sm[16];
    memcpy(sm, packed, sizeof sm);
    for (int j = 0; j < 8; j++) {
        d[j] = super * (float)sm[j];
        m[j] = -(super_min * (float)sm[8 + j]);
    }
#endif
}

/* k_scales for the n (1..2) super-blocks of a row from `header`: d[8 s + j], m[8 s + j], the same floats. With
 * AVX2 two headers are unpacked at once (one per 128-bit lane), for fewer instructions than a header at a time. */
static inline void k_scales2(const uint8_t *header, int n, float d[16], float m[16]) {
#if defined(DFA_AVX2)
    const __m256i h = n == 2 ? _mm256_loadu_si256((const __m256i *)header)
                             : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)header));
    /* per lane: dword 0 the float16 d and dmin, then u0, u1, u2 as k_scales names them */
    const __m256i u001 = _mm256_shuffle_epi32(h, _MM_SHUFFLE(2, 2, 1, 1)), u2 = _mm256_shuffle_epi32(h, 0xFF);
    const __m256i low = _mm256_and_si256(u001, _mm256_set1_epi32(0x3F3F3F3F)); /* scales 0-3, mins 0-3 */
    const __m256i top =
        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u001, 6), _mm256_set1_epi32(0x03030303)), 4);
    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(u2, _mm256_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4)),
                                         _mm256_set1_epi32(0x0F0F0F0F));
    /* per lane: bytes 0-7 the scales, 8-15 the mins (scales 4-7 and mins 4-7 in the odd dwords) */
    const __m256i both = _mm256_blend_epi32(low, _mm256_or_si256(nib, top), 0xAA);
    const __m128i halves =
        _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)));
    const __m256 supers = _mm256_cvtph_ps(halves); /* d_0, dmin_0, d_1, dmin_1 (twice) */
    const __m256 neg = _mm256_set1_ps(-0.0f);
    const __m128i lo = _mm256_castsi256_si128(both), hi = _mm256_extracti128_si256(both, 1);
    _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_permutevar8x32_ps(supers, _mm256_set1_epi32(0)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))));
    _mm256_storeu_ps(m, _mm256_xor_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(supers, _mm256_set1_epi32(1)),
                                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                        _mm_unpackhi_epi64(lo, lo)))),
                                      neg));
    if (n == 2) {
        _mm256_storeu_ps(d + 8, _mm256_mul_ps(_mm256_permutevar8x32_ps(supers, _mm256_set1_epi32(2)),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))));
        _mm256_storeu_ps(m + 8, _mm256_xor_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(supers, _mm256_set1_epi32(3)),
                                                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                                _mm_unpackhi_epi64(hi, hi)))),
                                              neg));
    }
#else
    for (int s = 0; s < n; s++) k_scales(header + 16 * s, d + 8 * s, m + 8 * s);
#endif
}

#if defined(DFA_AVX512)
/* k_scales for the n (1..4) super-blocks of a row from `header`, four headers at once (one per 128-bit lane), for
 * the AVX-512 Q4_K rows (q4_rows). Each super-block's 8 floats are stored as one 32-byte store, as they are
 * loaded: a load from inside a wider store waits for it to reach the cache. */
static inline void k_scales4(const uint8_t *header, int n, float d[32], float m[32]) {
    const __m512i h = _mm512_maskz_loadu_epi8(n == 4 ? ~0ULL : (1ULL << (16 * n)) - 1, header);
    const __m512i u001 = _mm512_shuffle_epi32(h, _MM_SHUFFLE(2, 2, 1, 1)), u2 = _mm512_shuffle_epi32(h, 0xFF);
    const __m512i low = _mm512_and_si512(u001, _mm512_set1_epi32(0x3F3F3F3F)); /* scales 0-3, mins 0-3 */
    const __m512i top =
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u001, 6), _mm512_set1_epi32(0x03030303)), 4);
    const __m512i nib = _mm512_and_si512(_mm512_srlv_epi32(u2, _mm512_set4_epi32(4, 4, 0, 0)),
                                         _mm512_set1_epi32(0x0F0F0F0F));
    /* per lane: bytes 0-7 the scales, 8-15 the mins; then the four lanes' scales, and their mins, side by side */
    const __m512i both = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                                  _mm512_mask_blend_epi32(0xAAAA, low, _mm512_or_si512(nib, top)));
    const __m128i halves = _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_set4_epi32(12, 8, 4, 0), h));
    const __m512 supers = _mm512_castps256_ps512(_mm256_cvtph_ps(halves)); /* d_0, dmin_0, d_1, dmin_1, ... */
    const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(4)), one = _mm512_set1_epi32(1);
    const __m512 neg = _mm512_set1_ps(-0.0f);
    const __m512 out[4] = {
        _mm512_mul_ps(_mm512_permutexvar_ps(first, supers),
                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(both)))),
        _mm512_mul_ps(_mm512_permutexvar_ps(second, supers),
                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(both, 1)))),
        _mm512_xor_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(first, one), supers),
                                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(both, 2)))),
                      neg),
        _mm512_xor_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(second, one), supers),
                                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(both, 3)))),
                      neg)};
    for (int i = 0; i < 4; i++) {
        float *to = i < 2 ? d + 16 * i : m + 16 * (i - 2);
        _mm256_storeu_ps(to, _mm512_castps512_ps256(out[i]));
        _mm256_storeu_ps(to + 8, _mm512_extractf32x8_ps(out[i], 1));
    }
}
#endif

/* The scales d_j = d sc_j of the 16 runs of 16 in one Q6_K super-block, from its 18-byte tail as the GGUF stores it
 * (16 int8 scales, then float16 d): the float32 products the file's dequantization forms. */
static inline void q6_scales(const uint8_t *tail, float d[16]) {
    const float super = half_to_float((uint16_t)(tail[16] | tail[17] << 8));
#if defined(DFA_AVX2)
    const __m128i sc = _mm_loadu_si128((const __m128i *)tail);
    const __m256 s = _mm256_set1_ps(super);
    _mm256_storeu_ps(d, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(d + 8, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
#elif defined(DFA_NEON)
    const int8x16_t sc = vld1q_s8((const int8_t *)tail);
    const int16x8_t lo = vmovl_s8(vget_low_s8(sc)), hi = vmovl_s8(vget_high_s8(sc));
    vst1q_f32(d, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), super));
    vst1q_f32(d + 4, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))), super));
    vst1q_f32(d + 8, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), super));
    vst1q_f32(d + 12, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi))), super));
#else
    for (int j = 0; j < 16; j++) d[j] = super * (float)(int8_t)tail[j];
#endif
}

/* Each ISA's accumulators (ACC: two chains per activation row, even and odd blocks) and block kernels:
 * block_nibbles adds block b of a u4 / u5 / u6 row (high 0 / 1 / 2 bits past the nibble), block_s8 of an s8 row,
 * times p0[i * 8], the product of its scale and activation row i's block scale (u6, and s8 groups of 16: p0 for the
 * first run of 16, p1 for the second, into the chains 0 and 1), into the accumulators of parity a (high, a, group
 * and rows are constants where inlined). The products come eight blocks at a time (scale_products). */
#if defined(DFA_AVX2)
typedef __m256 ACC;
static inline ACC acc_zero(void) { return _mm256_setzero_ps(); }
/* acc += the 8 products m[j] x[j] (a super-block's min terms) */
static inline ACC acc_mins(ACC acc, const float m[8], const float *x) {
    return _mm256_fmadd_ps(_mm256_loadu_ps(m), _mm256_loadu_ps(x), acc);
}

static inline float acc_sum(ACC a, ACC b) {
    const __m256 v = _mm256_add_ps(a, b);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Dot products of 16 weights, widened to int16, with 16 int16 activations: 8 int32 lanes of pair sums. */
static inline __m256i dot16(__m256i w16, const int16_t *x) {
    return _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)x));
}

/* Dot products of 32 weights (lo: values 0..15, hi: 16..31) with 32 activations: 8 int32 lanes, lane j the sum of
 * pairs j of both halves (exact: VNNI's fused multiply-add of pairs gives the same integers as the two halves
 * added). */
static inline __m256i dot32(__m256i lo, __m256i hi, const int16_t *x) {
#ifdef DFA_AVX512
    return _mm256_dpwssd_epi32(dot16(lo, x), hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
#else
    return _mm256_add_epi32(dot16(lo, x), dot16(hi, x + 16));
#endif
}

/* acc[a][i] += p (8 int32 lanes) * s, s a vector of 8 equal scales */
#define ACC2(acc, a, i, p, s) acc[a][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[a][i])
/* The scale of a block's products for one activation row, broadcast from the products scale_products formed. */
#define SCALE(p, i) _mm256_broadcast_ss((p) + (i) * 8)
/* or, without products (p0 NULL: float16 / float32 scales, one per block), the weight's scale times the row's */
#define SCALE_OF(p, i, vsd, sx) ((p) ? SCALE(p, i) : _mm256_mul_ps(vsd, _mm256_broadcast_ss(sx)))

/* The fifth bits of a group of 32 as bytes: byte k is 16 where bit k of `bits` is set, else 0. */
static inline __m256i fifth_bits(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), select);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, select), _mm256_set1_epi8(16));
}

/* The values of group b of a u4 / u5 / u6 row (high 0 / 1 / 2) as bytes: lane 0 runs R0 R2, lane 1 R1 R3, so the
 * in-lane unpacks give values 0..15 (low halves) and 16..31 (high halves) in order, without a lane-crossing
 * shuffle. */
static inline __attribute__((always_inline)) __m256i group_bytes(int high, const uint8_t *qn, const uint32_t *qhn,
                                                                 int64_t b) {
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4); /* lane 0: low nibbles, lane 1: high */
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(qn + b * 16)));
    v = _mm256_and_si256(_mm256_srlv_epi32(v, shift), _mm256_set1_epi8(0x0F));
    if (high == 1) v = _mm256_or_si256(v, fifth_bits(qhn[b]));
    if (high == 2) { /* the four qwords take the top bits of R0, R2, R1, R3: the runs in the nibble vector's order */
        uint64_t top;
        memcpy(&top, qhn + b * 2, sizeof top);
        const __m256i t = _mm256_srlv_epi64(_mm256_set1_epi64x((long long)top), _mm256_setr_epi64x(0, 4, 2, 6));
        v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(t, _mm256_set1_epi8(3)), 4));
    }
    return v;
}

/* The group's 32 values as int16 in order, minus the offset, against TILE activation rows at most. */
static inline __attribute__((always_inline)) void block_nibbles(ACC acc[2][TILE], int a, int high, const uint8_t *qn,
                                                                const uint32_t *qhn, const float *p0, const float *p1,
                                                                float sd, int offset, const int16_t *xq,
                                                                const float *xs, int64_t K, int64_t b, int64_t r0,
                                                                int rows) {
    const __m256i v = group_bytes(high, qn, qhn, b);
    const __m256 vsd = _mm256_set1_ps(sd);
    const __m256i off = _mm256_set1_epi16((short)offset);
    const __m256i lo = _mm256_sub_epi16(_mm256_unpacklo_epi8(v, _mm256_setzero_si256()), off); /* values 0..15 */
    const __m256i hi = _mm256_sub_epi16(_mm256_unpackhi_epi8(v, _mm256_setzero_si256()), off); /* 16..31 */
    for (int i = 0; i < rows; i++) {
        const int16_t *xb = xq + (r0 + i) * K + b * 32;
        if (high == 2) { /* u6: runs of 16 with a scale each */
            ACC2(acc, 0, i, dot16(lo, xb), SCALE(p0, i));
            ACC2(acc, 1, i, dot16(hi, xb + 16), SCALE(p1, i));
        } else {
            ACC2(acc, a, i, dot32(lo, hi, xb), SCALE_OF(p0, i, vsd, xs + (r0 + i) * (K / 32) + b));
        }
    }
}

static inline __attribute__((always_inline)) void block_s8(ACC acc[2][TILE], int a, const int8_t *qn, const float *p0,
                                                           const float *p1, float sd, int64_t group, const int16_t *xq,
                                                           const float *xs, int64_t K, int64_t b, int64_t r0,
                                                           int rows) {
    const __m256 vsd = _mm256_set1_ps(sd);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qn + b * 32)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qn + b * 32 + 16)));
    for (int i = 0; i < rows; i++) {
        const int16_t *xb = xq + (r0 + i) * K + b * 32;
        if (group == 32) {
            ACC2(acc, a, i, dot32(w0, w1, xb), SCALE_OF(p0, i, vsd, xs + (r0 + i) * (K / 32) + b));
        } else { /* runs of 16 with a scale each */
            ACC2(acc, 0, i, dot16(w0, xb), SCALE(p0, i));
            ACC2(acc, 1, i, dot16(w1, xb + 16), SCALE(p1, i));
        }
    }
}

/* Group b of a u4 / u5 / u6 row as float32: sd (u - offset) for values 0..15, sd1 (u - offset) for 16..31, then
 * + *min where min is given: the scalar loop's product and sum, eight values at a time. */
static inline __attribute__((always_inline)) void dequantize_group(int high, const uint8_t *qn, const uint32_t *qhn,
                                                                   int64_t b, int offset, float sd, float sd1,
                                                                   const float *min, float *w) {
    const __m256i v = group_bytes(high, qn, qhn, b), off = _mm256_set1_epi16((short)offset);
    const __m256i lo = _mm256_sub_epi16(_mm256_unpacklo_epi8(v, _mm256_setzero_si256()), off);
    const __m256i hi = _mm256_sub_epi16(_mm256_unpackhi_epi8(v, _mm256_setzero_si256()), off);
    const __m128i eights[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                               _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    for (int j = 0; j < 4; j++) {
        const __m256 u = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(eights[j]));
        __m256 f = _mm256_mul_ps(_mm256_set1_ps(j < 2 ? sd : sd1), u);
        if (min) f = _mm256_add_ps(f, _mm256_set1_ps(*min));
        _mm256_storeu_ps(w + 8 * j, f);
    }
}
#elif defined(DFA_NEON)
typedef float32x4_t ACC;
static inline ACC acc_zero(void) { return vdupq_n_f32(0.0f); }
static inline ACC acc_mins(ACC acc, const float m[8], const float *x) {
    return vfmaq_f32(vfmaq_f32(acc, vld1q_f32(m), vld1q_f32(x)), vld1q_f32(m + 4), vld1q_f32(x + 4));
}
static inline float acc_sum(ACC a, ACC b) { return vaddvq_f32(vaddq_f32(a, b)); }

/* 32 int16 weights w[0..3] (8 each) against 32 int16 activations: 4 int32 lanes of sums, each of 8 products of at
 * most 2^15 * 2^7 (no overflow). */
static inline int32x4_t dot32(const int16x8_t w[4], const int16_t *x) {
    int32x4_t p = vdupq_n_s32(0), r = vdupq_n_s32(0);
    for (int j = 0; j < 4; j += 2) {
        const int16x8_t x0 = vld1q_s16(x + 8 * j), x1 = vld1q_s16(x + 8 * j + 8);
        p = vmlal_high_s16(vmlal_s16(p, vget_low_s16(w[j]), vget_low_s16(x0)), w[j], x0);
        r = vmlal_high_s16(vmlal_s16(r, vget_low_s16(w[j + 1]), vget_low_s16(x1)), w[j + 1], x1);
    }
    return vaddq_s32(p, r);
}

/* 16 int16 weights against 16 activations (the runs of an s8 layout with groups of 16). */
static inline int32x4_t dot16(int16x8_t w0, int16x8_t w1, const int16_t *x) {
    const int16x8_t x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8);
    const int32x4_t p = vmlal_high_s16(vmlal_s16(vdupq_n_s32(0), vget_low_s16(w0), vget_low_s16(x0)), w0, x0);
    return vmlal_high_s16(vmlal_s16(p, vget_low_s16(w1), vget_low_s16(x1)), w1, x1);
}

#define ACC2(acc, a, i, p, s) acc[a][i] = vfmaq_n_f32(acc[a][i], vcvtq_f32_s32(p), s)

/* The fifth bits of 16 values as bytes (16 where bit j of `bits` is set, byte j): the u5 layout's word holds the
 * bits of (R0, R2) in its low half and of (R1, R3) in its high one, the order of the nibble vectors below. */
static inline uint8x16_t fifth_bits16(uint32_t bits) {
    static const uint8_t select[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
    return vandq_u8(vtstq_u8(v, vld1q_u8(select)), vdupq_n_u8(16));
}

/* The 16 bytes' low nibbles are runs R0, R2 and their high nibbles R1, R3, so the values 0..31 in order are the
 * halves of the two nibble vectors, widened. */
static inline __attribute__((always_inline)) void block_nibbles(ACC acc[2][TILE], int a, int high, const uint8_t *qn,
                                                                const uint32_t *qhn, const float *p0, const float *p1,
                                                                float sd, int offset, const int16_t *xq,
                                                                const float *xs, int64_t K, int64_t b, int64_t r0,
                                                                int rows) {
    const uint8x16_t raw = vld1q_u8(qn + b * 16);
    uint8x16_t low = vandq_u8(raw, vdupq_n_u8(0x0F)), top = vshrq_n_u8(raw, 4); /* R0 R2 | R1 R3 */
    if (high == 1) {
        low = vorrq_u8(low, fifth_bits16(qhn[b]));
        top = vorrq_u8(top, fifth_bits16(qhn[b] >> 16));
    }
    if (high == 2) { /* byte i: the top bits of R0, R1, R2, R3's value i in bits 0-1, 2-3, 4-5, 6-7 */
        const uint8x8_t h = vld1_u8((const uint8_t *)(qhn + b * 2)), m = vdup_n_u8(0x30);
        low = vorrq_u8(low, vcombine_u8(vshl_n_u8(vand_u8(h, vdup_n_u8(3)), 4), vand_u8(h, m))); /* R0 | R2 */
        top = vorrq_u8(top, vcombine_u8(vand_u8(vshl_n_u8(h, 2), m), vand_u8(vshr_n_u8(h, 2), m))); /* R1 | R3 */
    }
    const int16x8_t off = vdupq_n_s16((int16_t)offset);
    const int16x8_t w[4] = {vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(low))), off),
                            vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(top))), off),
                            vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(low))), off),
                            vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(top))), off)};
    for (int i = 0; i < rows; i++) {
        const int16_t *xb = xq + (r0 + i) * K + b * 32;
        if (high == 2) { /* u6: runs of 16 with a scale each */
            ACC2(acc, 0, i, dot16(w[0], w[1], xb), p0[i * 8]);
            ACC2(acc, 1, i, dot16(w[2], w[3], xb + 16), p1[i * 8]);
        } else {
            ACC2(acc, a, i, dot32(w, xb), p0 ? p0[i * 8] : sd * xs[(r0 + i) * (K / 32) + b]);
        }
    }
}

static inline __attribute__((always_inline)) void block_s8(ACC acc[2][TILE], int a, const int8_t *qn, const float *p0,
                                                           const float *p1, float sd, int64_t group, const int16_t *xq,
                                                           const float *xs, int64_t K, int64_t b, int64_t r0,
                                                           int rows) {
    const int8x16_t q0 = vld1q_s8(qn + b * 32), q1 = vld1q_s8(qn + b * 32 + 16);
    const int16x8_t w[4] = {vmovl_s8(vget_low_s8(q0)), vmovl_s8(vget_high_s8(q0)), vmovl_s8(vget_low_s8(q1)),
                            vmovl_s8(vget_high_s8(q1))};
    for (int i = 0; i < rows; i++) {
        const int16_t *xb = xq + (r0 + i) * K + b * 32;
        if (group == 32) {
            ACC2(acc, a, i, dot32(w, xb), p0 ? p0[i * 8] : sd * xs[(r0 + i) * (K / 32) + b]);
        } else { /* runs of 16 with a scale each */
            ACC2(acc, 0, i, dot16(w[0], w[1], xb), p0[i * 8]);
            ACC2(acc, 1, i, dot16(w[2], w[3], xb + 16), p1[i * 8]);
        }
    }
}
#else
/* The scalar reference: each block's integer dot exactly, then one multiply-add per block. */
typedef float ACC;
static inline ACC acc_zero(void) { return 0.0f; }
static inline ACC acc_mins(ACC acc, const float m[8], const float *x) {
    for (int j = 0; j < 8; j++) acc += m[j] * x[j];
    return acc;
}
static inline float acc_sum(ACC a, ACC b) { return a + b; }

static inline void block_nibbles(ACC acc[2][TILE], int a, int high, const uint8_t *qn, const uint32_t *qhn,
                                 const float *p0, const float *p1, float sd, int offset, const int16_t *xq,
                                 const float *xs, int64_t K, int64_t b, int64_t r0, int rows) {
    int w[32];
    for (int v = 0; v < 32; v++) w[v] = nibble_value(qn + b * 16, high ? qhn + b * high : NULL, high, v) - offset;
    for (int i = 0; i < rows; i++) {
        const int16_t *xb = xq + (r0 + i) * K + b * 32;
        int32_t s0 = 0, s1 = 0;
        for (int v = 0; v < 16; v++) {
            s0 += w[v] * xb[v];
            s1 += w[16 + v] * xb[16 + v];
        }
        if (high == 2) {
            acc[0][i] += p0[i * 8] * (float)s0;
            acc[1][i] += p1[i * 8] * (float)s1;
        } else {
            acc[a][i] += (p0 ? p0[i * 8] : sd * xs[(r0 + i) * (K / 32) + b]) * (float)(s0 + s1);
        }
    }
}

static inline void block_s8(ACC acc[2][TILE], int a, const int8_t *qn, const float *p0, const float *p1, float sd,
                            int64_t group, const int16_t *xq, const float *xs, int64_t K, int64_t b, int64_t r0,
                            int rows) {
    for (int i = 0; i < rows; i++) {
        const int16_t *xb = xq + (r0 + i) * K + b * 32;
        int32_t s0 = 0, s1 = 0;
        for (int v = 0; v < 16; v++) {
            s0 += qn[b * 32 + v] * xb[v];
            s1 += qn[b * 32 + 16 + v] * xb[16 + v];
        }
        if (group == 32) {
            acc[a][i] += (p0 ? p0[i * 8] : sd * xs[(r0 + i) * (K / 32) + b]) * (float)(s0 + s1);
        } else {
            acc[0][i] += p0[i * 8] * (float)s0;
            acc[1][i] += p1[i * 8] * (float)s1;
        }
    }
}
#endif

/* prod[i][j] = sd[j] times activation row r0 + i's scale of block b + j, for the n (<= 8) blocks from b: the scales
 * the block kernels multiply by, eight at a time (one vector multiply per row where each block took a broadcast and
 * a multiply); the same float products, so the same bits. */
static inline __attribute__((always_inline)) void scale_products(float prod[TILE][8], const float sd[8],
                                                                 const float *xs, int64_t B, int64_t b, int n,
                                                                 int64_t r0, int rows) {
#ifdef DFA_AVX2
    if (n == 8) {
        const __m256 d = _mm256_loadu_ps(sd);
        for (int i = 0; i < rows; i++)
            _mm256_storeu_ps(prod[i], _mm256_mul_ps(d, _mm256_loadu_ps(xs + (r0 + i) * B + b)));
        return;
    }
#endif
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < n; j++) prod[i][j] = sd[j] * xs[(r0 + i) * B + b + j];
}

/* The scales of the n (<= 8) runs from run `first`, every `step`-th (2: one run of 16 of each block), as floats. */
static inline __attribute__((always_inline)) void scales_at(const void *d, int scales, int64_t first, int step, int n,
                                                            float sd[8]) {
    for (int j = 0; j < n; j++) sd[j] = scale_at(d, scales, first + (int64_t)j * step);
}

/* One u4 / u5 / u6 weight row (high 0 / 1 / 2) against `rows` (1..TILE, a constant where inlined) activation rows
 * from r0, its offsets m excluded (the caller adds them) but for K-format headers, whose min terms are summed here,
 * a super-block at a time. Even and odd blocks (u6: the runs of 16) accumulate separately, so two multiply-add
 * chains run at once; the order is the same for every `rows`, so a row's result never depends on the rows beside
 * it. */
static inline __attribute__((always_inline)) void row_nibbles(int high, const uint8_t *qn, const uint32_t *qhn,
                                                              const void *dn, int scales, int offset,
                                                              const int16_t *xq, const float *xs, const float *xsum,
                                                              int64_t K, int64_t r0, int rows, float *out) {
    const int64_t B = K / 32;
    ACC acc[2][TILE], mins[TILE];
    float p0[TILE][8], p1[TILE][8];
    for (int i = 0; i < rows; i++) acc[0][i] = acc[1][i] = mins[i] = acc_zero();
    if (scales == DFA_SCALES_K) {
        float kds[16], kms[16];
        for (int64_t s = 0; s < B / 8; s++) {
            if (s % 2 == 0) k_scales2((const uint8_t *)dn + s * 16, B / 8 - s < 2 ? 1 : 2, kds, kms);
            const float *kd = kds + s % 2 * 8, *km = kms + s % 2 * 8;
            for (int i = 0; i < rows; i++) mins[i] = acc_mins(mins[i], km, xsum + (r0 + i) * B + s * 8);
            scale_products(p0, kd, xs, B, s * 8, 8, r0, rows);
            for (int j = 0; j < 8; j += 2) {
                block_nibbles(acc, 0, high, qn, qhn, p0[0] + j, NULL, 0.0f, offset, xq, xs, K, s * 8 + j, r0, rows);
                block_nibbles(acc, 1, high, qn, qhn, p0[0] + j + 1, NULL, 0.0f, offset, xq, xs, K, s * 8 + j + 1, r0,
                              rows);
            }
        }
    } else if (scales == DFA_SCALES_Q6K) {
        for (int64_t s = 0; s < B / 8; s++) {
            float sd[16], first[8], second[8];
            q6_scales((const uint8_t *)dn + s * 18, sd);
            for (int j = 0; j < 8; j++) {
                first[j] = sd[2 * j];
                second[j] = sd[2 * j + 1];
            }
            scale_products(p0, first, xs, B, s * 8, 8, r0, rows);
            scale_products(p1, second, xs, B, s * 8, 8, r0, rows);
            for (int j = 0; j < 8; j++)
                block_nibbles(acc, 0, high, qn, qhn, p0[0] + j, p1[0] + j, 0.0f, offset, xq, xs, K, s * 8 + j, r0,
                              rows);
        }
    } else { /* a float16 / float32 scale per block, multiplied by the rows' as each block is read: products formed
              * ahead, as above, measured slower here */
        int64_t b = 0;
        for (; b + 2 <= B; b += 2) {
            block_nibbles(acc, 0, high, qn, qhn, NULL, NULL, scale_at(dn, scales, b), offset, xq, xs, K, b, r0, rows);
            block_nibbles(acc, 1, high, qn, qhn, NULL, NULL, scale_at(dn, scales, b + 1), offset, xq, xs, K, b + 1,
                          r0, rows);
        }
        if (b < B)
            block_nibbles(acc, 0, high, qn, qhn, NULL, NULL, scale_at(dn, scales, b), offset, xq, xs, K, b, r0, rows);
    }
    for (int i = 0; i < rows; i++) out[i] = acc_sum(acc[0][i], acc[1][i]) + acc_sum(mins[i], acc_zero());
}

static inline __attribute__((always_inline)) void row_s8(const int8_t *qn, const void *dn, int scales, int64_t group,
                                                         const int16_t *xq, const float *xs, int64_t K,
                                                         int64_t r0, int rows, float *out) {
    const int64_t B = K / 32;
    ACC acc[2][TILE];
    float p0[TILE][8], p1[TILE][8];
    for (int i = 0; i < rows; i++) acc[0][i] = acc[1][i] = acc_zero();
    if (group == 32) {
        int64_t b = 0;
        for (; b + 2 <= B; b += 2) {
            block_s8(acc, 0, qn, NULL, NULL, scale_at(dn, scales, b), 32, xq, xs, K, b, r0, rows);
            block_s8(acc, 1, qn, NULL, NULL, scale_at(dn, scales, b + 1), 32, xq, xs, K, b + 1, r0, rows);
        }
        if (b < B) block_s8(acc, 0, qn, NULL, NULL, scale_at(dn, scales, b), 32, xq, xs, K, b, r0, rows);
    } else { /* runs of 16: scales 2b and 2b + 1 for block b */
        for (int64_t c = 0; c < B; c += 8) {
            const int n = B - c < 8 ? (int)(B - c) : 8;
            float sd[8] = {0.0f}; /* n < 8: the rest unread */
            scales_at(dn, scales, 2 * c, 2, n, sd);
            scale_products(p0, sd, xs, B, c, n, r0, rows);
            scales_at(dn, scales, 2 * c + 1, 2, n, sd);
            scale_products(p1, sd, xs, B, c, n, r0, rows);
            for (int j = 0; j < n; j++)
                block_s8(acc, 0, qn, p0[0] + j, p1[0] + j, 0.0f, 16, xq, xs, K, c + j, r0, rows);
        }
    }
    for (int i = 0; i < rows; i++) out[i] = acc_sum(acc[0][i], acc[1][i]);
}

/* Bytes of scales per block of 32 (one float32, one float16, or a 16-byte K header per 8 blocks); a Q6_K tail
 * of 18 bytes per 8 blocks has its own row_scale_bytes. */
static inline int64_t scale_bytes(int scales) { return scales == DFA_SCALES_F32 ? 4 : 2; }

/* Bytes of scales in a row of `groups` groups (of `group` values each: 32, or 16 for s8 and u6). */
static inline int64_t row_scale_bytes(int scales, int64_t K, int64_t group) {
    return scales == DFA_SCALES_Q6K ? K / 256 * 18 : K / group * scale_bytes(scales);
}

/* Weight rows [n0, n1) of a u4 / u5 / u6 matrix (high 0 / 1 / 2) against the M activation rows: each tile of TILE
 * activation rows passes over the whole panel before the next tile, so the panel's weights stay in L1 while every
 * tile reads them and a tile's activations stay there while the panel's rows read them, and each activation row's
 * outputs are stored as one run (y's rows lie N floats apart: storing one row's outputs for 64 activation rows at
 * a time hit 64 lines of the same cache set). Inlined with M == 1 (panels of one row) as its own loop, a decode
 * step's matmul compiles to a loop free of the tiles' bookkeeping (a third fewer instructions). */
static inline __attribute__((always_inline)) void nibbles_panel(int high, const int16_t *xq, const float *xs,
                                                                const float *xsum, int64_t M, int64_t K,
                                                                const uint8_t *q, const uint32_t *qh, int offset,
                                                                const void *d, int scales, const float *m, int64_t N,
                                                                float *y, int64_t n0, int64_t n1, int64_t ahead) {
    const int64_t B = K / 32, dbytes = row_scale_bytes(scales, K, 32);
    for (int64_t n = n0; n < n1; n++) {
        prefetch(q + (n + ahead) * (K / 2), K / 2);
        if (high) prefetch(qh + (n + ahead) * B * high, B * high * 4);
        prefetch((const char *)d + (n + ahead) * dbytes, dbytes);
        if (m) prefetch(m + (n + ahead) * B, B * 4);
    }
    float out[TILE];
    int64_t r0 = 0;
    for (; r0 + TILE <= M; r0 += TILE)
        for (int64_t n = n0; n < n1; n++) {
            const float *mn = m ? m + n * B : NULL;
            row_nibbles(high, q + n * (K / 2), high ? qh + n * B * high : NULL, (const char *)d + n * dbytes, scales,
                        offset, xq, xs, xsum, K, r0, TILE, out);
            for (int i = 0; i < TILE; i++)
                y[(r0 + i) * N + n] = out[i] + (mn ? dotf(mn, xsum + (r0 + i) * B, B) : 0.0f);
        }
    for (; r0 < M; r0++)
        for (int64_t n = n0; n < n1; n++) {
            const float *mn = m ? m + n * B : NULL;
            row_nibbles(high, q + n * (K / 2), high ? qh + n * B * high : NULL, (const char *)d + n * dbytes, scales,
                        offset, xq, xs, xsum, K, r0, 1, out);
            y[r0 * N + n] = out[0] + (mn ? dotf(mn, xsum + r0 * B, B) : 0.0f);
        }
}

/* Weight rows in a panel: as many as keep a panel's weights and a tile's activations in L1 together. */
#define PANEL 16
/* The N weight rows in panels (of one row where `rows` is 1: a decode step has no tiles to share a panel), split
 * across the threads: panel_fn(args..., n0, n1, ahead) for each. */
#define OVER_PANELS(rows, panel_fn, ...)                                                                      \
    do {                                                                                                     \
        const int64_t panel = (rows) == 1 ? 1 : PANEL;                                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (int64_t p = 0;              \
                                                                               p < (N + panel - 1) / panel; \
                                                                               p++)                         \
            panel_fn(__VA_ARGS__, p * panel, p * panel + panel < N ? p * panel + panel : N, ahead);          \
    } while (0)
/* A u4 / u5 / u6 matrix, with the panel function inlined for each of the constants it branches on (4 / 5 / 6 bits,
 * one activation row, the scales' format), so no block tests them. */
#define NIBBLE_ROWS(high, rows, scales, offset) \
    OVER_PANELS(rows, nibbles_panel, high, xq, xs, xsum, rows, K, q, qh, offset, d, scales, m, N, y)
/* Q4_K and Q5_K (K headers) have no offset: a constant 0 drops its subtraction from every block */
#define NIBBLE_SCALES(high, rows)                                                                   \
    do {                                                                                            \
        if (scales == DFA_SCALES_K && offset == 0) NIBBLE_ROWS(high, rows, DFA_SCALES_K, 0);      \
        else if (scales == DFA_SCALES_K) NIBBLE_ROWS(high, rows, DFA_SCALES_K, offset);            \
        else if (scales == DFA_SCALES_F16) NIBBLE_ROWS(high, rows, DFA_SCALES_F16, offset);        \
        else NIBBLE_ROWS(high, rows, DFA_SCALES_F32, offset);                                     \
    } while (0)

#if defined(DFA_AVX2)
/* Activation rows per q4_rows call (TILE's 8 spilled AVX-512's accumulators) */
#define Q4_ROWS 4
/* Q4_K (u4, K headers, no offset) and Q4_0 (`half`: u4, a float16 scale per group, offset 8) for AVX2 and AVX-512
 * alike: the same integers and the same float operations in the same order, so every vector build gives the same
 * bits. A group's 16 bytes widen to int16 at once, their low
 * nibbles in one register and their high ones in another (AVX-512: a pair of groups' 32 bytes), against activations
 * in the order those come in: per pair of groups, values 0-7 and 16-23 of each, then 8-15 and 24-31 of each
 * (q4_order; or, `ordered` 0, the rows as they are, shuffled as they are read). Lane l of a group's eight is the
 * dot of the four values its bytes 2l and 2l + 1 hold; the even groups accumulate in one chain, the odd ones in
 * another (AVX-512: the two halves of one register), summed by acc_sum at the end. In order, a group took two
 * unpacks and a variable shift more (row_nibbles), and its header's scales a scalar unpacking each (k_scales):
 * decode-step Q4_K matmuls run 1.4x as fast with AVX-512 (in L2; 1.2x from memory), 1.1x with AVX2; Q4_0 ones
 * (the offset subtracted as int16) 1.56x and 1.26x. One row or Q4_ROWS, the same operations per row. */
static inline __attribute__((always_inline)) void q4_rows(int half, const uint8_t *qn, const uint8_t *dn,
                                                          const int16_t *xq, int ordered, const float *xs,
                                                          const float *xsum, int64_t K, int64_t r0, int rows,
                                                          float *out) {
    enum { R = Q4_ROWS };
    const int64_t B = K / 32; /* Q4_K: whole super-blocks of 8 groups; Q4_0: pairs of groups, the last 8 maybe not */
    __m256 mins[R];
    float kds[32], kms[32];
#if defined(DFA_AVX512)
    const __m512i low = _mm512_set1_epi16(0x0F), eight = _mm512_set1_epi16(half ? 8 : 0);
    const __m512i pick0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i pick[4] = {pick0, _mm512_add_epi32(pick0, _mm512_set1_epi32(2)),
                             _mm512_add_epi32(pick0, _mm512_set1_epi32(4)),
                             _mm512_add_epi32(pick0, _mm512_set1_epi32(6))};
    __m512 acc[R];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
#else
    const __m256i low = _mm256_set1_epi16(0x0F), eight = _mm256_set1_epi16(half ? 8 : 0);
    __m256 acc[2][R]; /* [group % 2] */
    for (int i = 0; i < rows; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
#endif
    for (int i = 0; i < rows; i++) mins[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < (B + 7) / 8; s++) {
        const int pairs = B - s * 8 < 8 ? (int)(B - s * 8) / 2 : 4;
#if defined(DFA_AVX512)
        __m512 prod[R];
#else
        float prod[R][8]; /* broadcast from memory: a load, where a permute took the shuffle port */
#endif
        /* the last groups of a Q4_0 row: 2, 4 or 6 scales, and as many of the rows', loaded masked (through a buffer
         * on the stack, the stores' forwarding to the vector load stalled: rows of 704 ran no faster than before) */
        const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * pairs),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 kd;
        if (half && pairs == 4) {
            kd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dn + s * 16)));
        } else if (half) { /* a pair's two float16 scales are one 32-bit word */
            const __m128i words = _mm_cmpgt_epi32(_mm_set1_epi32(pairs), _mm_setr_epi32(0, 1, 2, 3));
            kd = _mm256_cvtph_ps(_mm_maskload_epi32((const int *)(dn + s * 16), words));
        } else {
#if defined(DFA_AVX512)
            if (s % 4 == 0) k_scales4(dn + s * 16, B / 8 - s < 4 ? (int)(B / 8 - s) : 4, kds, kms);
#else
            if (s % 2 == 0) k_scales2(dn + s * 16, B / 8 - s < 2 ? 1 : 2, kds + s % 4 * 8, kms + s % 4 * 8);
#endif
            kd = _mm256_loadu_ps(kds + s % 4 * 8);
        }
        for (int i = 0; i < rows; i++) {
            const float *row_scales = xs + (r0 + i) * B + s * 8;
            const __m256 x_scales = pairs == 4 ? _mm256_loadu_ps(row_scales) : _mm256_maskload_ps(row_scales, first);
            if (!half)
                mins[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kms + s % 4 * 8),
                                          _mm256_loadu_ps(xsum + (r0 + i) * B + s * 8), mins[i]);
            const __m256 scales = _mm256_mul_ps(kd, x_scales);
#if defined(DFA_AVX512)
            prod[i] = _mm512_castps256_ps512(scales);
#else
            _mm256_storeu_ps(prod[i], scales);
#endif
        }
        /* each pair of groups (AVX-512) or group (AVX2) unpacked once for the rows */
        for (int p = 0; p < pairs; p++) {
#if defined(DFA_AVX512)
            const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qn + s * 128 + p * 32)));
            __m512i lo = _mm512_and_si512(z, low), hi = _mm512_srli_epi16(z, 4);
            if (half) lo = _mm512_sub_epi16(lo, eight), hi = _mm512_sub_epi16(hi, eight);
            for (int i = 0; i < rows; i++) {
                const int16_t *xp = xq + (r0 + i) * K + s * 256 + p * 64;
                __m512i a = _mm512_loadu_si512(xp), b = _mm512_loadu_si512(xp + 32);
                if (!ordered) {
                    const __m512i t = _mm512_shuffle_i64x2(a, b, 0x88); /* 128-bit quarters 0, 2 of each group */
                    b = _mm512_shuffle_i64x2(a, b, 0xDD);               /* and 1, 3 */
                    a = t;
                }
                const __m512i dot = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, a), hi, b);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick[p], prod[i]), acc[i]);
            }
#else
            for (int e = 0; e < 2; e++) {
                const int g = 2 * p + e;
                const __m256i z = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qn + s * 128 + g * 16)));
                __m256i lo = _mm256_and_si256(z, low), hi = _mm256_srli_epi16(z, 4);
                if (half) lo = _mm256_sub_epi16(lo, eight), hi = _mm256_sub_epi16(hi, eight);
                for (int i = 0; i < rows; i++) {
                    const int16_t *xp = xq + (r0 + i) * K + s * 256 + p * 64;
                    __m256i a, b;
                    if (ordered) {
                        a = _mm256_loadu_si256((const __m256i *)(xp + 16 * e));
                        b = _mm256_loadu_si256((const __m256i *)(xp + 32 + 16 * e));
                    } else {
                        const int16_t *xg = xp + 32 * e;
                        a = _mm256_loadu2_m128i((const __m128i *)(xg + 16), (const __m128i *)xg);
                        b = _mm256_loadu2_m128i((const __m128i *)(xg + 24), (const __m128i *)(xg + 8));
                    }
                    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, a), _mm256_madd_epi16(hi, b));
                    acc[e][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(prod[i] + g), acc[e][i]);
                }
            }
#endif
        }
    }
    for (int i = 0; i < rows; i++) {
#if defined(DFA_AVX512)
        const __m256 even = _mm512_castps512_ps256(acc[i]), odd = _mm512_extractf32x8_ps(acc[i], 1);
#else
        const __m256 even = acc[0][i], odd = acc[1][i];
#endif
        out[i] = acc_sum(even, odd) + (half ? 0.0f : acc_sum(mins[i], acc_zero()));
    }
}

/* Rows [n0, n1) of a Q4_K or (half) Q4_0 matrix (q4_rows), as nibbles_panel: both keep K / 16 bytes of scales a
 * row. */
static inline __attribute__((always_inline)) void q4_panel(int half, const int16_t *xq, int ordered, const float *xs,
                                                           const float *xsum, int64_t M, int64_t K, const uint8_t *q,
                                                           const uint8_t *d, int64_t N, float *y, int64_t n0,
                                                           int64_t n1, int64_t ahead) {
    for (int64_t n = n0; n < n1; n++) {
        prefetch(q + (n + ahead) * (K / 2), K / 2);
        prefetch(d + (n + ahead) * (K / 16), K / 16);
    }
    float out[TILE];
    int64_t r0 = 0;
    for (; r0 + TILE <= M; r0 += TILE)
        for (int64_t n = n0; n < n1; n++) {
            for (int i = 0; i < TILE; i += Q4_ROWS)
                q4_rows(half, q + n * (K / 2), d + n * (K / 16), xq, ordered, xs, xsum, K, r0 + i, Q4_ROWS,
                        out + i);
            for (int i = 0; i < TILE; i++) y[(r0 + i) * N + n] = out[i];
        }
    for (; r0 < M; r0++)
        for (int64_t n = n0; n < n1; n++) {
            q4_rows(half, q + n * (K / 2), d + n * (K / 16), xq, ordered, xs, xsum, K, r0, 1, out);
            y[r0 * N + n] = out[0];
        }
}

/* Activation rows in q4_rows' order (K a multiple of 64), once per matmul: shuffled as they were read instead,
 * a block of rows took 40% longer with AVX2. */
#define Q4_STACK_VALUES 32768
#ifndef DFA_Q4_ORDER /* 0: never (the tests' build of the path taken without memory for the order) */
#define DFA_Q4_ORDER 1
#endif
static void q4_order(const int16_t *x, int64_t M, int64_t K, int16_t *to) {
    static const int eighths[8] = {0, 2, 4, 6, 1, 3, 5, 7};
    for (int64_t p = 0; p < M * K / 64; p++)
        for (int j = 0; j < 8; j++) memcpy(to + p * 64 + 8 * j, x + p * 64 + 8 * eighths[j], 8 * sizeof(int16_t));
}

static void matmul_q4(int half, const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                      const uint8_t *q, const uint8_t *d, int64_t N, float *y, int threads) {
    const int64_t ahead = rows_ahead(K / 2 + K / 16);
    int16_t on_stack[Q4_STACK_VALUES];
    int16_t *ordered = !DFA_Q4_ORDER ? NULL
                       : M * K <= Q4_STACK_VALUES ? on_stack
                                                   : (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    if (ordered) q4_order(xq, M, K, ordered); /* else (no memory) the rows as they are, shuffled as they are read */
    const int16_t *x = ordered ? ordered : xq;
    /* the constants inlined: Q4_K or Q4_0, a decode row or tiles */
    if (half && M == 1) OVER_PANELS(1, q4_panel, 1, x, ordered != NULL, xs, xsum, 1, K, q, d, N, y);
    else if (half) OVER_PANELS(M, q4_panel, 1, x, ordered != NULL, xs, xsum, M, K, q, d, N, y);
    else if (M == 1) OVER_PANELS(1, q4_panel, 0, x, ordered != NULL, xs, xsum, 1, K, q, d, N, y);
    else OVER_PANELS(M, q4_panel, 0, x, ordered != NULL, xs, xsum, M, K, q, d, N, y);
    if (ordered != on_stack) free(ordered);
}
#endif

static void matmul_nibbles(int high, const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                           const uint8_t *q, const uint32_t *qh, int offset, const void *d, int scales,
                           const float *m, int64_t N, float *y, int threads) {
#if defined(DFA_AVX2)
    if (high == 0 && !m && ((scales == DFA_SCALES_K && offset == 0) ||
                            (scales == DFA_SCALES_F16 && offset == 8 && K % 64 == 0))) {
        matmul_q4(scales == DFA_SCALES_F16, xq, xs, xsum, M, K, q, (const uint8_t *)d, N, y, threads);
        return;
    }
#endif
    const int64_t B = K / 32,
                  ahead = rows_ahead(K / 2 + (4 * high + (m ? 4 : 0)) * B + row_scale_bytes(scales, K, 32));
    /* u6 comes with Q6_K tails only, and Q6_K's offset of 32 */
    if (high == 2 && M == 1 && offset == 32) NIBBLE_ROWS(2, 1, DFA_SCALES_Q6K, 32);
    else if (high == 2 && offset == 32) NIBBLE_ROWS(2, M, DFA_SCALES_Q6K, 32);
    else if (high == 2) NIBBLE_ROWS(2, M, DFA_SCALES_Q6K, offset);
    else if (high && M == 1) NIBBLE_SCALES(1, 1);
    else if (high) NIBBLE_SCALES(1, M);
    else if (M == 1) NIBBLE_SCALES(0, 1);
    else NIBBLE_SCALES(0, M);
}

/* Weight rows [n0, n1) of an s8 matrix against the M activation rows, in panels as nibbles_panel (group 32 or 16,
 * constants where inlined). */
static inline __attribute__((always_inline)) void s8_panel(const int16_t *xq, const float *xs, const float *xsum,
                                                           int64_t M, int64_t K, const int8_t *q, const void *d,
                                                           int scales, const float *m, int64_t group, int64_t N,
                                                           float *y, int64_t n0, int64_t n1, int64_t ahead) {
    const int64_t B = K / 32, G = K / group, dbytes = scale_bytes(scales);
    for (int64_t n = n0; n < n1; n++) {
        prefetch(q + (n + ahead) * K, K);
        prefetch((const char *)d + (n + ahead) * G * dbytes, G * dbytes);
        if (m) prefetch(m + (n + ahead) * G, G * 4);
    }
    float out[TILE];
    int64_t r0 = 0;
    for (; r0 + TILE <= M; r0 += TILE)
        for (int64_t n = n0; n < n1; n++) {
            const float *mn = m ? m + n * G : NULL;
            row_s8(q + n * K, (const char *)d + n * G * dbytes, scales, group, xq, xs, K, r0, TILE, out);
            for (int i = 0; i < TILE; i++)
                y[(r0 + i) * N + n] = out[i] + (mn ? dotf(mn, xsum + (r0 + i) * B, B) : 0.0f);
        }
    for (; r0 < M; r0++)
        for (int64_t n = n0; n < n1; n++) {
            const float *mn = m ? m + n * G : NULL;
            row_s8(q + n * K, (const char *)d + n * G * dbytes, scales, group, xq, xs, K, r0, 1, out);
            y[r0 * N + n] = out[0] + (mn ? dotf(mn, xsum + r0 * B, B) : 0.0f);
        }
}

#define S8_ROWS(group, rows, scales) OVER_PANELS(rows, s8_panel, xq, xs, xsum, rows, K, q, d, scales, m, group, N, y)
#define S8_SCALES(group, rows)                                                     \
    do {                                                                           \
        if (scales == DFA_SCALES_F16) S8_ROWS(group, rows, DFA_SCALES_F16); \
        else S8_ROWS(group, rows, DFA_SCALES_F32);                                 \
    } while (0)

static void matmul_s8(const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K, const int8_t *q,
                      const void *d, int scales, const float *m, int64_t group, int64_t N, float *y, int threads) {
    /* group is 32 or 16 (m only with 32); scales float32 or float16 */
    const int64_t G = K / group, ahead = rows_ahead(K + scale_bytes(scales) * G + (m ? 4 : 0) * G);
    if (group == 16 && M == 1) S8_SCALES(16, 1);
    else if (group == 16) S8_SCALES(16, M);
    else if (M == 1) S8_SCALES(32, 1);
    else S8_SCALES(32, M);
}

/* w [N, K] float32 = d (q - offset) + m, exactly as the GGUF dequantization computes
 * it (one product, one sum, no fused multiply-add: the build passes -ffp-contract=off): for blocks of many
 * activation rows (prefill), where a float32 GEMM on the dequantized rows beats the integer dot; and (ids [N],
 * else NULL: rows 0..N-1) the embedding rows of a step's tokens. */
void dfa_dequantize(const void *q, int bits, const uint32_t *qh, int offset, const void *d, int scales,
                    const float *m, int64_t group, int64_t N, int64_t K, const int64_t *ids, float *w, int threads) {
    const int64_t G = K / group;
#pragma omp parallel for num_threads(threads) schedule(static) if (N > 1)
    for (int64_t i = 0; i < N; i++) {
        const int64_t n = ids ? ids[i] : i;
        const char *dn = (const char *)d + n * row_scale_bytes(scales, K, group);
        const float *mn = m ? m + n * G : NULL;
        float *wn = w + i * K;
        if (bits == 8) {
            const int8_t *qn = (const int8_t *)q + n * K;
            for (int64_t k = 0; k < K; k++) {
                const float v = scale_at(dn, scales, k / group) * (float)qn[k];
                wn[k] = mn ? v + mn[k / group] : v;
            }
            continue;
        }
        const uint8_t *qn = (const uint8_t *)q + n * (K / 2);
        const int high = bits - 4;
        float kd[16], km[8];
        for (int64_t b = 0; b < K / 32; b++) {
            if (scales == DFA_SCALES_K && b % 8 == 0) k_scales((const uint8_t *)dn + b / 8 * 16, kd, km);
            if (scales == DFA_SCALES_Q6K && b % 8 == 0) q6_scales((const uint8_t *)dn + b / 8 * 18, kd);
            const float *min = scales == DFA_SCALES_K ? &km[b % 8] : mn ? &mn[b] : NULL;
            const float sd0 = scales == DFA_SCALES_K     ? kd[b % 8]
                              : scales == DFA_SCALES_Q6K ? kd[b % 8 * 2]
                                                         : scale_at(dn, scales, b);
            const float sd1 = scales == DFA_SCALES_Q6K ? kd[b % 8 * 2 + 1] : sd0; /* the second run of 16 */
            const uint32_t *qhn = high ? qh + n * (K / 32) * high : NULL;
#ifdef DFA_AVX2
            dequantize_group(high, qn, qhn, b, offset, sd0, sd1, min, wn + b * 32);
#else
            for (int v = 0; v < 32; v++) {
                const float sd = v < 16 ? sd0 : sd1;
                const int u = nibble_value(qn + b * 16, high ? qhn + b * high : NULL, high, v);
                const float a = sd * (float)(u - offset);
                wn[b * 32 + v] = min ? a + *min : a;
            }
#endif
        }
    }
}

/* Prompt GEMMs with int8 activations (dfa_gemm_i8): what llama.cpp prefills with. The activations are quantized to
 * int8 per block of 32 (x ~ xs q, q in -127..127, round to nearest even) and multiplied with the weights' own
 * integers as unsigned bytes u (u4 / u5 / u6 as stored; s8 as q + 128, offset 128), so that AVX-512 VNNI's vpdpbusd
 * forms 64 byte products per instruction, four times float32's multiply-adds. Each weight row's runs (of 32 values,
 * or 16 for u6 and s8 groups of 16: `runs` per block) contribute
 *     acc += (float)(sum u q - offset sum q) * xs * d  (+ m * xs * sum q where the layout has offsets m),
 * the integer part exact (at most 32 * 255 * 127 per run), the offset subtracted in the integer sum, so an infinite
 * activation keeps the sign of its weight. Gemma's normed activations have a few channels far larger than the rest,
 * which would leave their blocks' other values a handful of levels: each row's GEMM_OUTLIERS channels of largest |x|
 * are taken out of its int8 blocks and multiplied in float32 with the weights dequantized exactly (LLM.int8()'s
 * decomposition; top-1 agreement on the embedded model 96.4% without). Each row picks its own, so a row's result
 * does not depend on the rows called with it: a prompt's keys are the same wherever its chunks start (a prefix-cache
 * hit moves them). A panel dequantizes the union of the rows' channels once. Not the exact path: `bench --fidelity`
 * reports its agreement.
 * Weights are unpacked a panel of GEMM_COLS rows at a time into bytes [K / 4, GEMM_COLS, 4] (four consecutive inputs
 * of each row in turn: one vector holds four inputs of 16 rows), with the panel's scales as floats, then every tile of
 * GEMM_TILE activation rows passes over the panel; the unpacking is paid once per panel for all M rows. Every build
 * computes the same operations per output in the same order (the scalar code with fmaf where the vector code fuses),
 * so every build gives the same bits. */
#define GEMM_COLS 16
#define GEMM_TILE 8
#define GEMM_OUTLIERS 16

/* One block of 32 activations, those whose bit in `kept` is clear taken as 0 (the row's outliers), -> int8 at scale
 * amax / 127 (its return), the sums of the integers of its two runs of 16 in sums. NaN, infinities and blocks too
 * small for a float scale as quantize_rare_block: a NaN block gets a NaN scale, infinities +-127 at an infinite
 * scale. The values are masked as they are loaded: a copy with a few lanes zeroed would be stored in pieces and
 * loaded whole, which the CPU cannot forward from its store buffer (a stall on most blocks of a row). */
static float quantize_block_i8(const float *x, uint32_t kept, int8_t *q, int32_t sums[2]) {
    float amax = 0.0f, v[32];
    int any_nan = 0;
#if defined(DFA_AVX512) /* NaN lanes give zero (vmaxps returns its second operand); a NaN block goes the rare way */
    const __m512 lo = _mm512_maskz_loadu_ps((__mmask16)kept, x),
                 hi = _mm512_maskz_loadu_ps((__mmask16)(kept >> 16), x + 16);
    const __m512 zero = _mm512_setzero_ps();
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), zero),
                                              _mm512_max_ps(_mm512_abs_ps(hi), zero)));
    any_nan = (_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q)) != 0;
#else
    for (int i = 0; i < 32; i++) {
        v[i] = kept >> i & 1 ? x[i] : 0.0f;
        any_nan |= isnan(v[i]);
        amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    }
#endif
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const int rare = any_nan || !(amax <= FLT_MAX && inv <= FLT_MAX);
    const double rare_inv = amax > 0.0f && !isinf(amax) ? 127.0 / (double)amax : 0.0;
    int32_t s[2] = {0, 0};
#if defined(DFA_AVX512)
    if (!rare) {
        const __m512 scale = _mm512_set1_ps(inv);
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale)),
                      i1 = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
        _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(i1));
        sums[0] = _mm512_reduce_add_epi32(i0), sums[1] = _mm512_reduce_add_epi32(i1);
        return amax / 127.0f;
    }
    _mm512_storeu_ps(v, lo);
    _mm512_storeu_ps(v + 16, hi);
#endif
    for (int i = 0; i < 32; i++) {
        const int qi = !rare ? (int)nearbyintf(v[i] * inv)
                       : any_nan ? 0
                       : isinf(v[i]) ? (v[i] > 0.0f ? 127 : -127)
                                     : (int)nearbyint((double)v[i] * rare_inv);
        q[i] = (int8_t)qi;
        s[i / 16] += qi;
    }
    sums[0] = s[0], sums[1] = s[1];
    return any_nan ? NAN : amax / 127.0f;
}

/* The 32 values of group b of weight row n as unsigned bytes in order (s8: q + 128). */
static inline void group_u8(const dfa_matrix *w, int64_t n, int64_t b, uint8_t out[32]) {
    const int64_t K = w->k;
    if (w->bits == 8) {
        const int8_t *qn = (const int8_t *)w->q + n * K + b * 32;
        for (int v = 0; v < 32; v++) out[v] = (uint8_t)(qn[v] + 128);
        return;
    }
    const int high = (int)w->bits - 4;
    const uint8_t *qn = (const uint8_t *)w->q + n * (K / 2);
    const uint32_t *qhn = high ? w->qh + n * (K / 32) * high : NULL;
#if defined(DFA_AVX2)
    /* group_bytes' qwords hold runs R0 R2 R1 R3: 0xD8 puts them in order */
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(group_bytes(high, qn, qhn, b), 0xD8));
#else
    for (int v = 0; v < 32; v++) out[v] = (uint8_t)nibble_value(qn + b * 16, high ? qhn + b * high : NULL, high, v);
#endif
}

/* Whether a layout's runs are of 16 (two scales per group of 32): u6 (Q6_K), s8 with groups of 16. */
static inline int gemm_runs(const dfa_matrix *w) { return w->scales == DFA_SCALES_Q6K || w->group == 16 ? 2 : 1; }

/* The scales d and offsets m (0 where the layout has none) of each of row n's runs, as the exact path forms them. */
static void run_scales(const dfa_matrix *w, int64_t n, float *d, float *m) {
    const int64_t K = w->k, B = K / 32, G = K / w->group;
    const int scales = (int)w->scales;
    const char *dn = (const char *)w->d + n * row_scale_bytes(scales, K, w->group);
    if (scales == DFA_SCALES_K) {
        for (int64_t s = 0; s < B / 8; s++) k_scales((const uint8_t *)dn + s * 16, d + s * 8, m + s * 8);
    } else if (scales == DFA_SCALES_Q6K) {
        for (int64_t s = 0; s < B / 8; s++) q6_scales((const uint8_t *)dn + s * 18, d + s * 16);
        for (int64_t r = 0; r < 2 * B; r++) m[r] = 0.0f;
    } else {
        for (int64_t g = 0; g < G; g++) {
            d[g] = scale_at(dn, scales, g);
            m[g] = w->m ? w->m[n * G + g] : 0.0f;
        }
    }
}

/* Weight rows [n0, n0 + cols) as a panel: bytes wp [K / 4, GEMM_COLS, 4], the runs' scales sd and offsets mv
 * [runs K / 32, GEMM_COLS], and wf [n_channels, GEMM_COLS] the weights of the outlier inputs channels[] (the union
 * of the rows' own) as the exact dequantization gives them (d (u - offset), then + m); the columns past cols zero.
 * scratch: 2 runs K / 32 floats. */
static void pack_panel(const dfa_matrix *w, int offset, int64_t n0, int cols, const int32_t *channels, int n_channels,
                       uint8_t *wp, float *sd, float *mv, float *wf, float *scratch) {
    const int64_t K = w->k, B = K / 32, runs = gemm_runs(w), R = B * runs;
    if (cols < GEMM_COLS) {
        memset(wp, 0, (size_t)(K * GEMM_COLS));
        memset(sd, 0, (size_t)(R * GEMM_COLS) * sizeof(float));
        memset(mv, 0, (size_t)(R * GEMM_COLS) * sizeof(float));
        memset(wf, 0, (size_t)(n_channels * GEMM_COLS) * sizeof(float));
    }
    for (int c = 0; c < cols; c++) {
        run_scales(w, n0 + c, scratch, scratch + R);
        for (int64_t r = 0; r < R; r++) {
            sd[r * GEMM_COLS + c] = scratch[r];
            mv[r * GEMM_COLS + c] = scratch[R + r];
        }
    }
    /* a group of every row, then the next: each group's 512 bytes are written while in L1 (row by row, a panel past
     * L1's size, K = 4096, was written from L2 16 times over) */
    for (int64_t b = 0; b < B; b++)
        for (int c = 0; c < cols; c++) {
            uint8_t values[32];
            group_u8(w, n0 + c, b, values);
            for (int j = 0; j < 8; j++) memcpy(wp + ((b * 8 + j) * GEMM_COLS + c) * 4, values + 4 * j, 4);
        }
    for (int o = 0; o < n_channels; o++) {
        const int64_t k = channels[o], run = runs == 2 ? k / 16 : k / 32; /* shifts, where k / (32 / runs) divides */
#if defined(DFA_AVX512) /* the union of many rows' channels can be most of K: a vector a channel */
        const __m512i quad = _mm512_loadu_si512((const void *)(wp + (k / 4) * GEMM_COLS * 4));
        const __m512i u = _mm512_and_si512(_mm512_srli_epi32(quad, (unsigned)(8 * (k % 4))), _mm512_set1_epi32(0xff));
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sd + run * GEMM_COLS),
                                       _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(offset))));
        _mm512_storeu_ps(wf + o * GEMM_COLS, _mm512_add_ps(v, _mm512_loadu_ps(mv + run * GEMM_COLS)));
#else
        for (int c = 0; c < cols; c++) {
            const int u = wp[((k / 4) * GEMM_COLS + c) * 4 + k % 4];
            const float v = sd[run * GEMM_COLS + c] * (float)(u - offset);
            wf[o * GEMM_COLS + c] = v + mv[run * GEMM_COLS + c];
        }
#endif
    }
}

/* out [GEMM_TILE, GEMM_COLS]: GEMM_TILE activation rows (xq [., K], xs [., K / 32]; per run, xo the integer offset
 * term -offset sum q and xm the float xs sum q; xf [., n_out] the row's outlier inputs, ascending, and xu their
 * rows of the panel's wf) against a panel (runs and has_m constants where inlined). */
static inline __attribute__((always_inline)) void gemm_tile(int runs, int has_m, const uint8_t *wp, const float *sd,
                                                            const float *mv, const float *wf, int n_out,
                                                            const int32_t *xu, const int8_t *xq, const float *xs,
                                                            const int32_t *xo, const float *xm, const float *xf,
                                                            int64_t K, float *out) {
    const int64_t B = K / 32, R = B * runs;
#if defined(DFA_AVX512)
    __m512 acc[GEMM_TILE];
    for (int i = 0; i < GEMM_TILE; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t run = 0; run < R; run++) { /* a run's integer sums, then its float terms: one set of sums live */
        const int64_t b = run / runs;
        __m512i p[GEMM_TILE];
        for (int i = 0; i < GEMM_TILE; i++) p[i] = _mm512_set1_epi32(xo[i * R + run]);
        for (int j = 0; j < 8 / runs; j++) {
            const int64_t quad = run * (8 / runs) + j; /* inputs 4 quad .. 4 quad + 3 */
            const __m512i wv = _mm512_loadu_si512((const void *)(wp + quad * GEMM_COLS * 4));
            for (int i = 0; i < GEMM_TILE; i++) {
                int32_t four;
                memcpy(&four, xq + i * K + quad * 4, 4);
                p[i] = _mm512_dpbusd_epi32(p[i], wv, _mm512_set1_epi32(four));
            }
        }
        const __m512 s = _mm512_loadu_ps(sd + run * GEMM_COLS);
        const __m512 mvec = has_m ? _mm512_loadu_ps(mv + run * GEMM_COLS) : _mm512_setzero_ps();
        for (int i = 0; i < GEMM_TILE; i++) {
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(p[i]), _mm512_set1_ps(xs[i * B + b]));
            acc[i] = _mm512_fmadd_ps(t, s, acc[i]);
            if (has_m) acc[i] = _mm512_fmadd_ps(mvec, _mm512_set1_ps(xm[i * R + run]), acc[i]);
        }
    }
    for (int o = 0; o < n_out; o++) /* the rows' chains of multiply-adds interleaved */
        for (int i = 0; i < GEMM_TILE; i++) {
            const __m512 wo = _mm512_loadu_ps(wf + (int64_t)xu[i * n_out + o] * GEMM_COLS);
            acc[i] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xf[i * n_out + o]), acc[i]);
        }
    for (int i = 0; i < GEMM_TILE; i++) _mm512_storeu_ps(out + i * GEMM_COLS, acc[i]);
#else
    for (int i = 0; i < GEMM_TILE; i++)
        for (int c = 0; c < GEMM_COLS; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < B; b++)
                for (int h = 0; h < runs; h++) {
                    const int64_t run = b * runs + h;
                    int32_t p = xo[i * R + run];
                    for (int k = 32 / runs * h; k < 32 / runs * (h + 1); k++)
                        p += (int32_t)wp[((b * 8 + k / 4) * GEMM_COLS + c) * 4 + k % 4] * xq[i * K + b * 32 + k];
                    const float t = (float)p * xs[i * B + b];
                    acc = fmaf(t, sd[run * GEMM_COLS + c], acc);
                    if (has_m) acc = fmaf(mv[run * GEMM_COLS + c], xm[i * R + run], acc);
                }
            for (int o = 0; o < n_out; o++)
                acc = fmaf(wf[(int64_t)xu[i * n_out + o] * GEMM_COLS + c], xf[i * n_out + o], acc);
            out[i * GEMM_COLS + c] = acc;
        }
#endif
}

/* Every tile of the activation rows against one panel, stored into y's rows below M (the arrays hold whole tiles). */
static inline __attribute__((always_inline)) void gemm_panel(int runs, int has_m, const uint8_t *wp, const float *sd,
                                                             const float *mv, const float *wf, int n_out,
                                                             const int32_t *xu, const int8_t *xq, const float *xs,
                                                             const int32_t *xo, const float *xm, const float *xf,
                                                             int64_t M, int64_t K, int64_t N, int64_t n0, int cols,
                                                             float *y) {
    const int64_t B = K / 32, R = B * runs;
    float out[GEMM_TILE * GEMM_COLS];
    for (int64_t r0 = 0; r0 < M; r0 += GEMM_TILE) {
        gemm_tile(runs, has_m, wp, sd, mv, wf, n_out, xu + r0 * n_out, xq + r0 * K, xs + r0 * B, xo + r0 * R,
                  xm + r0 * R, xf + r0 * n_out, K, out);
        for (int i = 0; i < GEMM_TILE && r0 + i < M; i++)
            memcpy(y + (r0 + i) * N + n0, out + i * GEMM_COLS, (size_t)cols * sizeof(float));
    }
}

#define OUTLIER_CANDIDATES 128

#if defined(DFA_AVX512)
/* |x| of 16 activations, a NaN's 0 */
static inline __m512 magnitudes(const float *x) {
    const __m512 v = _mm512_loadu_ps(x);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_abs_ps(v));
}
#endif

/* out[0..n) (ascending): the n channels of the row x [K] with the largest |x|, the first of equals; a NaN counts as
 * 0 (its block's scale is NaN: the row comes out NaN). */
static void row_outliers(const float *x, int64_t K, int n, int32_t *out) {
#if defined(DFA_AVX512)
    /* Each lane's largest |x| is a different channel's, so the smallest of the 16 is at most the row's n-th largest:
     * only the channels at or above it can be picked (a few dozen of K). Each of those is picked when fewer than n
     * of the others come before it (larger, or as large and earlier), which leaves them in channel order. */
    __m512 lane_max = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) lane_max = _mm512_max_ps(lane_max, magnitudes(x + k));
    const __m512 least = _mm512_set1_ps(_mm512_reduce_min_ps(lane_max));
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float value[OUTLIER_CANDIDATES + 16];
    int32_t channel[OUTLIER_CANDIDATES + 16];
    int c = 0;
    for (int64_t k = 0; k < K && c <= OUTLIER_CANDIDATES; k += 16) {
        const __m512 a = magnitudes(x + k);
        const __mmask16 pass = _mm512_cmp_ps_mask(a, least, _CMP_GE_OQ);
        const __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int32_t)k), lanes);
        _mm512_storeu_ps(value + c, _mm512_maskz_compress_ps(pass, a)); /* compress to memory is slow on Zen 4 */
        _mm512_storeu_si512((void *)(channel + c), _mm512_maskz_compress_epi32(pass, at));
        c += __builtin_popcount(pass);
    }
    if (c <= OUTLIER_CANDIDATES) {
        for (int j = c; j < (c + 15) / 16 * 16; j++) value[j] = -1.0f, channel[j] = 0; /* below every |x| */
        while (c > 32) { /* the same bound over the candidates (each lane holds two or more), in place */
            lane_max = _mm512_loadu_ps(value);
            for (int j0 = 16; j0 < c; j0 += 16) lane_max = _mm512_max_ps(lane_max, _mm512_loadu_ps(value + j0));
            const __m512 tighter = _mm512_set1_ps(_mm512_reduce_min_ps(lane_max));
            int kept = 0;
            for (int j0 = 0; j0 < c; j0 += 16) {
                const __m512 v = _mm512_loadu_ps(value + j0);
                const __mmask16 pass = _mm512_cmp_ps_mask(v, tighter, _CMP_GE_OQ);
                const __m512i at = _mm512_loadu_si512((const void *)(channel + j0));
                _mm512_storeu_ps(value + kept, _mm512_maskz_compress_ps(pass, v));
                _mm512_storeu_si512((void *)(channel + kept), _mm512_maskz_compress_epi32(pass, at));
                kept += __builtin_popcount(pass);
            }
            for (int j = kept; j < (kept + 15) / 16 * 16; j++) value[j] = -1.0f, channel[j] = 0;
            if (kept == c) break;
            c = kept;
        }
        int picked = 0;
        for (int i = 0; i < c; i++) {
            const __m512 vi = _mm512_set1_ps(value[i]);
            int before = 0;
            for (int j0 = 0; j0 < c; j0 += 16) {
                const __m512 vj = _mm512_loadu_ps(value + j0);
                const __mmask16 earlier = i >= j0 + 16 ? 0xffff : i > j0 ? (__mmask16)((1u << (i - j0)) - 1) : 0;
                before += __builtin_popcount(_mm512_cmp_ps_mask(vj, vi, _CMP_GT_OQ)) +
                          __builtin_popcount(_mm512_mask_cmp_ps_mask(earlier, vj, vi, _CMP_EQ_OQ));
            }
            if (before < n) out[picked++] = channel[i];
        }
        return;
    }
#endif
    float top[GEMM_OUTLIERS]; /* the n largest so far, descending, an earlier channel first among equals */
    for (int64_t k = 0; k < K; k++) {
        const float a = isnan(x[k]) ? 0.0f : fabsf(x[k]);
        if (k >= n && !(a > top[n - 1])) continue;
        int at = k < n ? (int)k : n - 1;
        for (; at > 0 && a > top[at - 1]; at--) top[at] = top[at - 1], out[at] = out[at - 1];
        top[at] = a, out[at] = (int32_t)k;
    }
    for (int o = 1; o < n; o++) /* ascending channels: the float terms are added in one order whatever was picked */
        for (int at = o; at > 0 && out[at - 1] > out[at]; at--) {
            const int32_t t = out[at];
            out[at] = out[at - 1], out[at - 1] = t;
        }
}

int dfa_gemm_i8(const float *x, int64_t M, int64_t K, const dfa_matrix *w, float *y, int threads) {
    if (K != w->k || K % 32 || M < 1 || w->n < 1) return -2;
    const int runs = gemm_runs(w), has_m = w->m != NULL || w->scales == DFA_SCALES_K;
    const int offset = w->bits == 8 ? 128 : (int)w->offset;
    const int n_out = K / 32 < GEMM_OUTLIERS ? (int)(K / 32) : GEMM_OUTLIERS;
    const int64_t N = w->n, B = K / 32, R = B * runs, padded = (M + GEMM_TILE - 1) / GEMM_TILE * GEMM_TILE;
    if (threads < 1) threads = 1;
    /* the rows past M (up to a whole tile) stay zero: computed, never stored */
    int8_t *xq = calloc((size_t)(padded * K), 1);
    float *xs = calloc((size_t)(padded * (B + R + n_out)), sizeof(float));
    float *xm = xs ? xs + padded * B : NULL, *xf = xs ? xm + padded * R : NULL;
    int32_t *xo = calloc((size_t)(padded * R), sizeof(int32_t));
    /* each row's outlier channels xk, their rows xu of the panels' outlier weights, the channels of those rows */
    int32_t *xk = calloc((size_t)(padded * n_out), sizeof(int32_t));
    int32_t *xu = calloc((size_t)(padded * n_out), sizeof(int32_t));
    int32_t *slot = malloc((size_t)K * sizeof(int32_t)), *channels = malloc((size_t)K * sizeof(int32_t));
    uint8_t *panels = NULL;
    int status = xq && xs && xo && xk && xu && slot && channels ? 0 : -1;
    if (status == 0) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M * B > 64)
        for (int64_t r = 0; r < M; r++) {
            const float *xr = x + r * K;
            int32_t *own = xk + r * n_out;
            row_outliers(xr, K, n_out, own);
            for (int o = 0; o < n_out; o++) xf[r * n_out + o] = xr[own[o]];
            for (int64_t b = 0, o = 0; b < B; b++) {
                uint32_t kept = 0xffffffffu; /* the block without the row's outliers in it */
                for (; o < n_out && own[o] / 32 == b; o++) kept &= ~(1u << own[o] % 32);
                int32_t sums[2];
                const float scale = quantize_block_i8(xr + b * 32, kept, xq + r * K + b * 32, sums);
                xs[r * B + b] = scale;
                for (int h = 0; h < runs; h++) {
                    const int32_t sum = runs == 2 ? sums[h] : sums[0] + sums[1];
                    xo[r * R + b * runs + h] = -offset * sum;
                    xm[r * R + b * runs + h] = scale * (float)sum;
                }
            }
        }
        for (int64_t k = 0; k < K; k++) slot[k] = -1;
        for (int64_t i = 0; i < M * n_out; i++) slot[xk[i]] = 0;
        int n_channels = 0;
        for (int64_t k = 0; k < K; k++)
            if (slot[k] == 0) slot[k] = n_channels, channels[n_channels++] = (int32_t)k;
        for (int64_t i = 0; i < M * n_out; i++) xu[i] = slot[xk[i]];
        /* per thread: a panel's bytes, scales, offsets and outlier weights, and one row's run scales */
        const size_t panel_bytes =
            ((size_t)(K * GEMM_COLS) + (size_t)(2 * R * GEMM_COLS + (int64_t)n_channels * GEMM_COLS + 2 * R) *
                                           sizeof(float) + 63) / 64 * 64;
        panels = aligned_alloc(64, panel_bytes * (size_t)threads);
        status = panels ? 0 : -1;
        const int64_t n_panels = (N + GEMM_COLS - 1) / GEMM_COLS;
        if (status == 0) {
#pragma omp parallel num_threads(threads)
            {
                uint8_t *wp = panels + panel_bytes * (size_t)omp_get_thread_num();
                float *sd = (float *)(wp + K * GEMM_COLS), *mv = sd + R * GEMM_COLS, *wf = mv + R * GEMM_COLS,
                      *scratch = wf + (int64_t)n_channels * GEMM_COLS;
#pragma omp for schedule(static)
                for (int64_t p = 0; p < n_panels; p++) {
                    const int64_t n0 = p * GEMM_COLS;
                    const int cols = (int)(N - n0 < GEMM_COLS ? N - n0 : GEMM_COLS);
                    pack_panel(w, offset, n0, cols, channels, n_channels, wp, sd, mv, wf, scratch);
                    if (runs == 2)
                        gemm_panel(2, 0, wp, sd, mv, wf, n_out, xu, xq, xs, xo, xm, xf, M, K, N, n0, cols, y);
                    else if (has_m)
                        gemm_panel(1, 1, wp, sd, mv, wf, n_out, xu, xq, xs, xo, xm, xf, M, K, N, n0, cols, y);
                    else
                        gemm_panel(1, 0, wp, sd, mv, wf, n_out, xu, xq, xs, xo, xm, xf, M, K, N, n0, cols, y);
                }
            }
        }
    }
    free(xq), free(xs), free(xo), free(xk), free(xu), free(slot), free(channels), free(panels);
    return status;
}

/* y [M, N] = x [M, K] float32 @ w^T in one call (decode, verification): the activations are quantized into a
 * scratch buffer here, which saves the caller three allocations and a crossing into C per matmul. bits 4, 5, 6
 * or 8 picks the layout (qh: u5 and u6 only). Returns 0, or -1 when the scratch could not be had (y is then
 * unwritten), as dfa_norm_linear and dfa_layers_forward do. */
int dfa_linear(const float *x, int64_t M, int64_t K, const void *q, int bits, const uint32_t *qh, int offset,
               const void *d, int scales, const float *m, int64_t group, int64_t N, float *y, int threads) {
    const int64_t B = K / 32;
    int16_t *xq = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    float *xs = (float *)malloc((size_t)(2 * M * B) * sizeof(float));
    const int status = xq && xs ? 0 : -1;
    if (status == 0) {
        dfa_quantize(x, M, K, xq, xs, xs + M * B, threads);
        dfa_matmul(xq, xs, xs + M * B, M, K, q, bits, qh, offset, d, scales, m, group, N, y, threads);
    }
    free(xq);
    free(xs);
    return status;
}

void dfa_matmul(const int16_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K, const void *q, int bits,
                const uint32_t *qh, int offset, const void *d, int scales, const float *m, int64_t group, int64_t N,
                float *y, int threads) {
    if (bits == 8)
        matmul_s8(xq, xs, xsum, M, K, (const int8_t *)q, d, scales, m, group, N, y, threads);
    else
        matmul_nibbles(bits - 4, xq, xs, xsum, M, K, (const uint8_t *)q, qh, offset, d, scales, m, N, y, threads);
}

/* The index of the first largest of x[0..n), a NaN counting as larger than any number (torch.argmax's rule):
 * greedy decoding's pick from the 262k logits of a vocabulary, which torch's argmax takes 0.3 ms over. Each of
 * `threads` chunks finds its largest value (and whether it holds a NaN), then the first occurrence of the overall
 * pick in the first chunk that holds it: no single-threaded pass over the whole vocabulary. */
int64_t dfa_argmax(const float *x, int64_t n, int threads) {
    if (threads < 1) threads = 1;
    float top[threads];
    int nan[threads];
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 65536)
    for (int64_t c = 0; c < threads; c++) {
        const int64_t lo = n * c / threads, hi = n * (c + 1) / threads;
        int64_t i = lo;
        float m = -INFINITY;
        int bad = 0;
#ifdef DFA_AVX2
        __m256 vm = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
        for (; i + 8 <= hi; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            vm = _mm256_max_ps(vm, v);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        bad = _mm256_movemask_ps(vnan) != 0;
#endif
        for (; i < hi; i++) {
            bad |= isnan(x[i]);
            m = x[i] > m ? x[i] : m;
        }
        top[c] = m;
        nan[c] = bad;
    }
    int any_nan = 0;
    float best = -INFINITY;
    for (int c = 0; c < threads; c++) {
        any_nan |= nan[c];
        best = top[c] > best ? top[c] : best;
    }
    for (int c = 0; c < threads; c++) {
        if (any_nan ? !nan[c] : top[c] != best) continue;
        int64_t i = n * c / threads;
        const int64_t hi = n * (c + 1) / threads;
#ifdef DFA_AVX2
        const __m256 target = _mm256_set1_ps(best);
        for (; !any_nan && i + 8 <= hi; i += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
            if (hit) return i + __builtin_ctz((unsigned)hit);
        }
#endif
        for (; i < hi; i++)
            if (any_nan ? isnan(x[i]) : x[i] == best) return i;
    }
    return 0; /* n == 0, or all -inf: index 0, as torch */
}

/* libgomp keeps the threads of each thread that started a parallel region (its master) for the next region, and
 * when it manages more threads than there are cores (a model loaded on one thread, then run on another: two pools)
 * every waiting thread sleeps at once instead of spinning, so each of the ~130 parallel regions of a decode step
 * pays a wake-up: 2.5x the step's layer time on a 2-core VM. A thread that is done with the kernels (the one that
 * loaded the model, an idle engine worker) gives its pool back. */
int dfa_release_threads(void) { return omp_pause_resource_all(omp_pause_hard); }

/* Repacking a GGUF matrix into the layouts above, one pass over the file's blocks and no temporaries: what loading
 * costs is then reading the file. Each format's values of a group of 32 are taken with the shifts of its own packing
 * (the same for every value of a group, so the loops vectorize), then laid out as the layouts' comment says. */
static inline void put_u4(const uint8_t lo[32], uint8_t *q) {
    for (int i = 0; i < 8; i++) {
        q[i] = (uint8_t)(lo[i] | lo[8 + i] << 4);
        q[8 + i] = (uint8_t)(lo[16 + i] | lo[24 + i] << 4);
    }
}

/* u5: bit r * 8 + i of the word is the fifth bit of value run[r] * 8 + i, runs (R0, R2, R1, R3) */
static inline uint32_t u5_word(const uint8_t fifth[32]) {
    static const int run[4] = {0, 2, 1, 3};
    uint32_t word = 0;
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 8; i++) word |= (uint32_t)fifth[run[r] * 8 + i] << (r * 8 + i);
    return word;
}

/* u6: byte i of the group's 8 holds the top two bits of values i, 8 + i, 16 + i, 24 + i in turn */
static inline void put_u6_high(const uint8_t top[32], uint8_t *qh) {
    for (int i = 0; i < 8; i++)
        qh[i] = (uint8_t)(top[i] | top[8 + i] << 2 | top[16 + i] << 4 | top[24 + i] << 6);
}

static inline __attribute__((always_inline)) void repack_block(int qtype, const uint8_t *blk, int64_t b, uint8_t *q,
                                                              uint32_t *qh, uint8_t *d) {
    uint8_t lo[32], top[32];
    if (qtype == DFA_GGML_Q8_0) {
        memcpy(d + b * 2, blk, 2);
        memcpy(q + b * 32, blk + 2, 32);
        return;
    }
    if (qtype == DFA_GGML_Q4_0 || qtype == DFA_GGML_Q5_0) {  /* value j: low nibble of byte j, high of j - 16 */
        const uint8_t *qs = blk + (qtype == DFA_GGML_Q5_0 ? 6 : 2);
        for (int j = 0; j < 16; j++) {
            lo[j] = qs[j] & 15;
            lo[16 + j] = qs[j] >> 4;
        }
        memcpy(d + b * 2, blk, 2);
        put_u4(lo, q + b * 16);
        if (qtype == DFA_GGML_Q5_0) {  /* the file's word: bit j for value j */
            uint32_t bits;
            memcpy(&bits, blk + 2, 4);
            for (int j = 0; j < 32; j++) top[j] = (bits >> j) & 1;
            qh[b] = u5_word(top);
        }
        return;
    }
    /* K-quants: super-block b of 256 values, groups g = 0..7 of 32 */
    if (qtype == DFA_GGML_Q6_K) memcpy(d + b * 18, blk + 192, 18);
    else memcpy(d + b * 16, blk, 16);
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const int64_t group = b * 8 + g;
        if (qtype == DFA_GGML_Q6_K) {  /* halves of 128: ql runs of 64 (two nibbles), qh runs of 32 (four fields) */
            const uint8_t *ql = blk + 64 * (g / 4) + 32 * (g % 2), *qhs = blk + 128 + 32 * (g / 4);
            const int lshift = 4 * ((g % 4) / 2), hshift = 2 * (g % 4);
            for (int i = 0; i < 32; i++) {
                lo[i] = (ql[i] >> lshift) & 15;
                top[i] = (qhs[i] >> hshift) & 3;
            }
            put_u4(lo, q + group * 16);
            put_u6_high(top, (uint8_t *)(qh + group * 2));
            continue;
        }
        const uint8_t *qs = blk + (qtype == DFA_GGML_Q5_K ? 48 : 16) + 32 * (g / 2);  /* pairs share 32 bytes */
        const int shift = 4 * (g % 2);
        for (int i = 0; i < 32; i++) lo[i] = (qs[i] >> shift) & 15;
        put_u4(lo, q + group * 16);
        if (qtype == DFA_GGML_Q5_K) {  /* the fifth bits: bit g of each of 32 bytes */
            for (int i = 0; i < 32; i++) top[i] = (blk[16 + i] >> g) & 1;
            qh[group] = u5_word(top);
        }
    }
}

int dfa_repack(const uint8_t *blocks, int qtype, int64_t N, int64_t K, uint8_t *q, uint32_t *qh, uint8_t *d,
               int threads) {
    int64_t size, block = 32;
    switch (qtype) {
    case DFA_GGML_Q4_0: size = 18; break;
    case DFA_GGML_Q5_0: size = 22; break;
    case DFA_GGML_Q8_0: size = 34; break;
    case DFA_GGML_Q4_K: size = 144; block = 256; break;
    case DFA_GGML_Q5_K: size = 176; block = 256; break;
    case DFA_GGML_Q6_K: size = 210; block = 256; break;
    default: return -1;
    }
    if (K <= 0 || K % block) return -2;
    const int64_t B = N * (K / block);  /* blocks in all: rows hold whole blocks, so they run on across rows */
    /* one loop per format, so each inlines its own constant shifts */
#define REPACK_ALL(T)                                                                                              \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (B > 4096)") for (int64_t b = 0; b < B;   \
                                                                                          b++)                     \
        repack_block(T, blocks + b * size, b, q, qh, d)
    switch (qtype) {
    case DFA_GGML_Q4_0: REPACK_ALL(DFA_GGML_Q4_0); break;
    case DFA_GGML_Q5_0: REPACK_ALL(DFA_GGML_Q5_0); break;
    case DFA_GGML_Q8_0: REPACK_ALL(DFA_GGML_Q8_0); break;
    case DFA_GGML_Q4_K: REPACK_ALL(DFA_GGML_Q4_K); break;
    case DFA_GGML_Q5_K: REPACK_ALL(DFA_GGML_Q5_K); break;
    default: REPACK_ALL(DFA_GGML_Q6_K); break;
    }
#undef REPACK_ALL
    return 0;
}
