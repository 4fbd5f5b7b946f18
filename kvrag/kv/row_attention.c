/* kvrag's attention of one query token over a request's keys, for decode and verify steps on x86 CPUs.
 *
 * For each entry (a row's new token, or one drafted position of a verify step) and each KV head h, over that
 * head's G = H / H_kv query heads g and the entry's n keys t:
 *
 *   s[g, t] = scale * sum_d q[g, d] k[t, d]
 *   out[g, :] = sum_t exp(s[g, t] - max_t s[g, t]) v[t, :] / sum_t exp(s[g, t] - max_t s[g, t])
 *
 * in float32 (scores, softmax, weighted sum), the output rounded to the inputs' dtype (round to nearest even for
 * bfloat16). The scores visit each key once for up to 4 query heads; the weighted sum walks the values
 * contiguously, 64 dimensions of every position a pass, for up to 4 query heads in bfloat16 (float32: one query head
 * a pass with AVX2's 16 registers, which hold one head's 64 float32 sums, the later passes reading the values from
 * cache; up to 3 heads a pass where AVX512-VL gives 32 registers -- the same sums in the same order, so the same
 * bits).
 *
 *   bfloat16 (AVX512-BF16): q . k by VDPBF16PS (exact products of bf16 pairs, float32 sums), values widened to
 *                           float32 and accumulated by FMA;
 *   float32  (AVX2 + FMA):  FMA throughout; also for float32 queries over bfloat16 keys and values (MODE_F32_BF16KV:
 *                           each element widened to float32 as it is loaded, exactly, then the same arithmetic --
 *                           the bits the float32 path computes over the widened K/V).
 *
 * Each entry's result depends on its own query, keys and values only -- never on the other entries of the call or
 * on how the work is split between threads -- and every sum runs in a fixed order, so a row decoded in a batch gets
 * the bits it gets alone, and a verified position the bits of a plain step at that position.
 *
 * Entries: int64 [E, 6] = (address of the query's head 0, address of head 0 position 0 of the keys, of the values,
 * elements between K/V heads, keys n >= 1, address of the contiguous [H, D] output). Queries are [H, D] with
 * `q_head` elements between heads and D contiguous; a key / value position is D contiguous elements.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define GB 4 /* query heads per pass over a KV head's keys / values */

/* Cephes' expf for x <= 0 (~1 ulp), shared by both paths: x clamped at EXP_MIN, n = round(x log2 e),
 * r = x - n ln2 (ln2 in two parts), exp(x) = 2^n (1 + r + r^2 P(r)) with P's coefficients highest first. */
#define EXP_MIN -87.3f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
static const float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

/* ------------------------------------------------------------------------------------------------- bfloat16 */
#define BF __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define I8 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) /* int8 K/V; a subset of BF */

I8 static inline __m512 exp512(__m512 x) { /* x <= 0 */
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P[i])); /* Horner, highest first */
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

BF static inline __m512 widen16(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* softmax weights of s[0 .. n) in place; returns their sum */
I8 static float softmax512(float *s, int64_t n) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) {
        __mmask16 m = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, s + t));
    }
    __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv)), sv = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        __mmask16 m = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mx));
        _mm512_mask_storeu_ps(s + t, m, e);
        sv = _mm512_mask_add_ps(sv, m, sv, e);
    }
    return _mm512_reduce_add_ps(sv);
}

/* the sums of a0 .. a3's lanes, in that order */
I8 static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
    y = _mm512_add_ps(y, _mm512_permute_ps(y, 0x4E));
    y = _mm512_add_ps(y, _mm512_permute_ps(y, 0xB1));
    return _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, y));
}

BF static inline __attribute__((always_inline)) void scores_bf16(const uint16_t *q, int64_t qh, const uint16_t *k,
                                                                 int64_t n, int64_t d, int gb, float scale,
                                                                 float *s) {
    const int64_t chunks = (d + 31) / 32;
    const __mmask32 last = d % 32 ? (__mmask32)((1ull << (d % 32)) - 1) : 0xffffffffu;
    const __m128 sc = _mm_set1_ps(scale);
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) { /* four keys at a time, their sums reduced together */
        __m512 acc[GB][4];
        for (int g = 0; g < GB; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            __mmask32 m = c == chunks - 1 ? last : 0xffffffffu;
            __m512i kv[4];
            for (int j = 0; j < 4; j++) kv[j] = _mm512_maskz_loadu_epi16(m, k + (t + j) * d + 32 * c);
            for (int g = 0; g < GB; g++)
                if (g < gb) {
                    __m512i qv = _mm512_maskz_loadu_epi16(m, q + g * qh + 32 * c);
                    for (int j = 0; j < 4; j++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], (__m512bh)qv, (__m512bh)kv[j]);
                }
        }
        for (int g = 0; g < GB; g++)
            if (g < gb) _mm_storeu_ps(s + g * n + t, _mm_mul_ps(sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), sc));
    }
    for (; t < n; t++) {
        __m512 acc[GB];
        for (int g = 0; g < GB; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            __mmask32 m = c == chunks - 1 ? last : 0xffffffffu;
            __m512i kv = _mm512_maskz_loadu_epi16(m, k + t * d + 32 * c);
            for (int g = 0; g < GB; g++)
                if (g < gb) {
                    __m512i qv = _mm512_maskz_loadu_epi16(m, q + g * qh + 32 * c);
                    acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)qv, (__m512bh)kv);
                }
        }
        for (int g = 0; g < GB; g++) /* the same sums as sum4's lane 0 */
            if (g < gb) {
                __m512 z = _mm512_setzero_ps();
                s[g * n + t] = _mm_cvtss_f32(sum4(acc[g], z, z, z)) * scale;
            }
    }
}

BF static inline __attribute__((always_inline)) void values_bf16(const float *p, const float *sums,
                                                                 const uint16_t *v, int64_t n, int64_t d, int gb,
                                                                 uint16_t *out) {
    for (int64_t d0 = 0; d0 < d; d0 += 64) { /* 64 dims (two 64-byte lines) of each position per pass */
        int64_t w = d - d0 < 64 ? d - d0 : 64;
        __mmask16 m[4];
        for (int c = 0; c < 4; c++) {
            int64_t r = w - 16 * c;
            m[c] = r >= 16 ? 0xffff : r > 0 ? (__mmask16)((1u << r) - 1) : 0;
        }
        __m512 acc[GB][4];
        for (int g = 0; g < GB; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *vt = v + t * d + d0;
            __m512 vv[4];
            for (int c = 0; c < 4; c++) vv[c] = widen16(vt + 16 * c, m[c]);
            for (int g = 0; g < GB; g++)
                if (g < gb) {
                    __m512 pb = _mm512_set1_ps(p[g * n + t]);
                    for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(pb, vv[c], acc[g][c]);
                }
        }
        for (int g = 0; g < GB; g++)
            if (g < gb) {
                __m512 l = _mm512_set1_ps(sums[g]);
                for (int c = 0; c < 4; c++) {
                    __m256bh o = _mm512_cvtneps_pbh(_mm512_div_ps(acc[g][c], l));
                    _mm256_mask_storeu_epi16(out + g * d + d0 + 16 * c, m[c], (__m256i)o);
                }
            }
    }
}

BF static void head_bf16(const uint16_t *q, int64_t qh, const uint16_t *k, const uint16_t *v, int64_t n, int64_t d,
                         int heads, float scale, uint16_t *out, float *s) {
    float sums[GB];
    for (int g0 = 0; g0 < heads; g0 += GB) {
        int gb = heads - g0 < GB ? heads - g0 : GB;
        const uint16_t *qg = q + g0 * qh;
        if (d == 64 && gb == 3) scores_bf16(qg, qh, k, n, 64, 3, scale, s); /* SmolLM2, Llama-3.2, Qwen: inlined */
        else if (d == 128 && gb == 4) scores_bf16(qg, qh, k, n, 128, 4, scale, s);
        else scores_bf16(qg, qh, k, n, d, gb, scale, s);
        for (int g = 0; g < gb; g++) sums[g] = softmax512(s + g * n, n);
        if (d == 64 && gb == 3) values_bf16(s, sums, v, n, 64, 3, out + g0 * d);
        else if (d == 128 && gb == 4) values_bf16(s, sums, v, n, 128, 4, out + g0 * d);
        else values_bf16(s, sums, v, n, d, gb, out + g0 * d);
    }
}

/* --------------------------------------------------------------------------------------------------- float32 */
#define F32 __attribute__((target("avx2,fma")))

/* 8 keys' / values' elements from `p` (element i on): float32 as they are, or bfloat16 K/V (`half`) widened to
 * float32 exactly -- so float32 queries over bfloat16 K/V run the float32 path's arithmetic on the widened values. */
F32 static inline __attribute__((always_inline)) __m256 load8(const void *p, int64_t i, int half) {
    if (half)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

F32 static inline __m256 exp256(__m256 x) { /* x <= 0 */
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P[i])); /* Horner, highest first */
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

F32 static inline float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

F32 static inline __m256i tail8(int64_t w) { /* lanes < w */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

F32 static float softmax256(float *s, int64_t n) {
    float mx = -INFINITY, l = 0.0f;
    int64_t n8 = n & ~(int64_t)7;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n8; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    for (int64_t t = n8; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    __m256 mb = _mm256_set1_ps(mx), sv = _mm256_setzero_ps();
    for (int64_t t = 0; t < n8; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
        _mm256_storeu_ps(s + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    if (n8 < n) {
        __m256i m = tail8(n - n8);
        __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(s + n8, m), mb));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(m));
        _mm256_maskstore_ps(s + n8, m, e);
        sv = _mm256_add_ps(sv, e);
    }
    l = hsum256(sv);
    return l;
}

/* the sums of a0 .. a3's lanes, in that order */
F32 static inline __m128 sum4_256(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

F32 static inline __attribute__((always_inline)) void scores_f32(const float *q, int64_t qh, const void *k, int64_t n,
                                                                 int64_t d, int gb, float scale, float *s, int half) {
    const __m128 sc = _mm_set1_ps(scale);
    const __m256 z = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) { /* four keys at a time, their sums reduced together */
        for (int g0 = 0; g0 < gb; g0 += 2) { /* two query heads (8 accumulators) per pass over the four keys */
            __m256 acc[2][4];
            for (int g = 0; g < 2; g++)
                for (int j = 0; j < 4; j++) acc[g][j] = z;
            for (int64_t c = 0; c < d; c += 8) {
                __m256 q0 = _mm256_loadu_ps(q + g0 * qh + c);
                __m256 q1 = g0 + 1 < gb ? _mm256_loadu_ps(q + (g0 + 1) * qh + c) : z;
                for (int j = 0; j < 4; j++) {
                    __m256 kv = load8(k, (t + j) * d + c, half);
                    acc[0][j] = _mm256_fmadd_ps(q0, kv, acc[0][j]);
                    acc[1][j] = _mm256_fmadd_ps(q1, kv, acc[1][j]);
                }
            }
            for (int g = 0; g < 2 && g0 + g < gb; g++)
                _mm_storeu_ps(s + (g0 + g) * n + t,
                              _mm_mul_ps(sum4_256(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), sc));
        }
    }
    for (; t < n; t++) {
        for (int g = 0; g < gb; g++) {
            __m256 acc = z;
            for (int64_t c = 0; c < d; c += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * qh + c), load8(k, t * d + c, half), acc);
            s[g * n + t] = _mm_cvtss_f32(sum4_256(acc, z, z, z)) * scale; /* the same sums as sum4_256's lane 0 */
        }
    }
}

F32 static inline __attribute__((always_inline)) void values_f32(const float *p, const float *sums, const void *v,
                                                                 int64_t n, int64_t d, int gb, float *out, int half) {
    for (int g = 0; g < gb; g++) /* one query head per pass: its 64-dim accumulators fill the registers */
        for (int64_t d0 = 0; d0 < d; d0 += 64) {
            const int64_t w = d - d0 < 64 ? (d - d0) / 8 : 8;
            __m256 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const int64_t vt = t * d + d0;
                __m256 pb = _mm256_set1_ps(p[g * n + t]);
                for (int c = 0; c < 8; c++)
                    if (c < w) acc[c] = _mm256_fmadd_ps(pb, load8(v, vt + 8 * c, half), acc[c]);
            }
            __m256 l = _mm256_set1_ps(sums[g]);
            for (int c = 0; c < 8; c++)
                if (c < w) _mm256_storeu_ps(out + g * d + d0 + 8 * c, _mm256_div_ps(acc[c], l));
        }
}

/* head_f32 (AVX2 + FMA) and head_f32_wide (below, with AVX512-VL): one KV head's query heads, GB at a time --
 * their scores, softmax and weighted sums (VALUES: values_f32 or values_f32_wide), over float32 K/V or (HALF 1)
 * bfloat16 K/V */
#define HEAD_F32_PASS(VALUES, HALF)                                                                                \
    for (int g0 = 0; g0 < heads; g0 += GB) {                                                                       \
        int gb = heads - g0 < GB ? heads - g0 : GB;                                                                \
        const float *qg = q + g0 * qh;                                                                             \
        if (d == 64) scores_f32(qg, qh, k, n, 64, gb, scale, s, HALF);                                             \
        else scores_f32(qg, qh, k, n, d, gb, scale, s, HALF);                                                      \
        for (int g = 0; g < gb; g++) sums[g] = softmax256(s + g * n, n);                                           \
        if (d == 64) VALUES(s, sums, v, n, 64, gb, out + g0 * d, HALF);                                            \
        else VALUES(s, sums, v, n, d, gb, out + g0 * d, HALF);                                                     \
    }
#define HEAD_F32(NAME, TARGET, VALUES)                                                                             \
    TARGET static void NAME(const float *q, int64_t qh, const void *k, const void *v, int64_t n, int64_t d,        \
                            int heads, float scale, float *out, float *s, int half) {                              \
        float sums[GB];                                                                                            \
        if (half) {                                                                                                \
            HEAD_F32_PASS(VALUES, 1)                                                                               \
        } else {                                                                                                   \
            HEAD_F32_PASS(VALUES, 0)                                                                               \
        }                                                                                                          \
    }

HEAD_F32(head_f32, F32, values_f32)

/* float32 with AVX512-VL's 32 vector registers: the weighted sums of up to 3 query heads in one pass over the
 * values (24 accumulators), each head's products and sums the ones values_f32 computes, in the same order -- the
 * same bits, the values read once per KV head instead of once per query head. */
#define F32W __attribute__((target("avx2,fma,avx512f,avx512vl")))

F32W static inline __attribute__((always_inline)) void values_f32_wide(const float *p, const float *sums,
                                                                       const void *v, int64_t n, int64_t d, int gb,
                                                                       float *out, int half) {
    for (int g0 = 0; g0 < gb; g0 += 3) {
        const int hb = gb - g0 < 3 ? gb - g0 : 3;
        const float *p0 = p + g0 * n, *p1 = p0 + n, *p2 = p1 + n;
        for (int64_t d0 = 0; d0 < d; d0 += 64) {
            const int64_t w = d - d0 < 64 ? (d - d0) / 8 : 8;
            __m256 a0[8], a1[8], a2[8];
            for (int c = 0; c < 8; c++) a0[c] = a1[c] = a2[c] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const int64_t vt = t * d + d0;
                const __m256 b0 = _mm256_set1_ps(p0[t]);
                const __m256 b1 = hb > 1 ? _mm256_set1_ps(p1[t]) : b0, b2 = hb > 2 ? _mm256_set1_ps(p2[t]) : b0;
                for (int c = 0; c < 8; c++)
                    if (c < w) {
                        const __m256 x = load8(v, vt + 8 * c, half);
                        a0[c] = _mm256_fmadd_ps(b0, x, a0[c]);
                        a1[c] = _mm256_fmadd_ps(b1, x, a1[c]);
                        a2[c] = _mm256_fmadd_ps(b2, x, a2[c]);
                    }
            }
            for (int h = 0; h < hb; h++) {
                const __m256 l = _mm256_set1_ps(sums[g0 + h]);
                const __m256 *a = h == 0 ? a0 : h == 1 ? a1 : a2;
                for (int c = 0; c < 8; c++)
                    if (c < w) _mm256_storeu_ps(out + (g0 + h) * d + d0 + 8 * c, _mm256_div_ps(a[c], l));
            }
        }
    }
}

HEAD_F32(head_f32_wide, F32W, values_f32_wide)

/* head_f32_wide where the CPU has AVX512-F + VL (the same bits as head_f32), else head_f32 (also where
 * KVRAG_ROW_ATTENTION_NARROW is set: for A/B runs) */
static void head_f32_any(const float *q, int64_t qh, const void *k, const void *v, int64_t n, int64_t d, int heads,
                         float scale, float *out, float *s, int half) {
    static int wide = -1; /* decided once (every thread decides alike) */
    if (wide < 0) {
        __builtin_cpu_init();
        wide = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
               !getenv("KVRAG_ROW_ATTENTION_NARROW");
    }
    if (wide)
        head_f32_wide(q, qh, k, v, n, d, heads, scale, out, s, half);
    else
        head_f32(q, qh, k, v, n, d, heads, scale, out, s, half);
}

/* The dtypes of a call (`mode`): float32 throughout, bfloat16 throughout, or float32 queries and outputs over
 * bfloat16 keys and values (a decode buffer narrower than the model's dtype), or float32 / bfloat16 queries over
 * int8 keys and values with a float32 scale per group of 32 dims of a position (head_i8). */
#define MODE_F32 0
#define MODE_BF16 1
#define MODE_F32_BF16KV 2
#define MODE_F32_I8KV 3
#define MODE_BF16_I8KV 4
#define IS_I8(mode) ((mode) == MODE_F32_I8KV || (mode) == MODE_BF16_I8KV)
#define Q_BF16(mode) ((mode) == MODE_BF16 || (mode) == MODE_BF16_I8KV)

/* ------------------------------------------------------------------------------------------------- portable */
static inline uint16_t round_bf16(float f);
static inline float widen_bf16(uint16_t h);

/* ---------------------------------------------------------------------------------------------------- int8 K/V */
/* int8 keys and values (EngineConfig.kv_dtype="int8"): a position of a KV head is its d int8 values followed by one
 * float32 scale per group of I8_GROUP dimensions (one group of d where d is not a multiple of it): d + 4 * groups
 * bytes, x ~= value * its group's scale, symmetric absmax over the group (llama.cpp's q8_0 cache scales blocks of 32
 * the same way). Queries in float32 or bfloat16 are widened to float32 once per call; each int8 value is widened to
 * float32 exactly as it is loaded and multiplied by its group's scale; a score is scale * (q . k) and a weighted sum
 * accumulates (p * value scale) * v8, float32 FMAs in a fixed order -- so, as on the other paths, an entry's result
 * depends on its own query, keys and values only. Needs AVX512-F/BW/DQ/VL; d a multiple of 16. */
#define I8_GROUP 32

static inline int64_t i8_group(int64_t d) { return d % I8_GROUP ? d : I8_GROUP; }
static inline int64_t i8_width(int64_t d) { return d + 4 * (d / i8_group(d)); } /* bytes of a position */

static inline float i8_scale(const int8_t *pos, int64_t d, int64_t group) { /* the scale of group `group` */
    float s;
    memcpy(&s, pos + d + 4 * group, sizeof s);
    return s;
}

I8 static inline __m512 widen_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

I8 static inline __attribute__((always_inline)) void scores_i8(const float *q, const int8_t *k, int64_t n, int64_t d,
                                                               int gb, float scale, float *s) {
    const int64_t pd = i8_width(d), gs = i8_group(d);
    const __m128 sc = _mm_set1_ps(scale);
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) { /* four keys at a time, their sums reduced together */
        __m512 acc[GB][4];
        for (int g = 0; g < GB; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) {
            __m512 kv[4];
            for (int j = 0; j < 4; j++) {
                const int8_t *kt = k + (t + j) * pd;
                kv[j] = _mm512_mul_ps(widen_i8(kt + c), _mm512_set1_ps(i8_scale(kt, d, c / gs)));
            }
            for (int g = 0; g < GB; g++)
                if (g < gb) {
                    __m512 qv = _mm512_loadu_ps(q + g * d + c);
                    for (int j = 0; j < 4; j++) acc[g][j] = _mm512_fmadd_ps(qv, kv[j], acc[g][j]);
                }
        }
        for (int g = 0; g < GB; g++)
            if (g < gb) _mm_storeu_ps(s + g * n + t, _mm_mul_ps(sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), sc));
    }
    for (; t < n; t++) {
        __m512 acc[GB];
        for (int g = 0; g < GB; g++) acc[g] = _mm512_setzero_ps();
        const int8_t *kt = k + t * pd;
        for (int64_t c = 0; c < d; c += 16) {
            __m512 kv = _mm512_mul_ps(widen_i8(kt + c), _mm512_set1_ps(i8_scale(kt, d, c / gs)));
            for (int g = 0; g < GB; g++)
                if (g < gb) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + c), kv, acc[g]);
        }
        for (int g = 0; g < GB; g++) /* the same sums as sum4's lane 0 */
            if (g < gb) {
                __m512 z = _mm512_setzero_ps();
                s[g * n + t] = _mm_cvtss_f32(sum4(acc[g], z, z, z)) * scale;
            }
    }
}

I8 static inline __attribute__((always_inline)) void values_i8(const float *p, const float *sums, const int8_t *v,
                                                               int64_t n, int64_t d, int gb, void *out, int bf16) {
    const int64_t pd = i8_width(d), gs = i8_group(d);
    for (int64_t d0 = 0; d0 < d; d0 += 64) { /* 64 dims of each position per pass */
        const int w = d - d0 < 64 ? (int)((d - d0) / 16) : 4;
        __m512 acc[GB][4];
        for (int g = 0; g < GB; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const int8_t *vt = v + t * pd;
            __m512 vv[4];
            for (int c = 0; c < 4; c++)
                vv[c] = c < w ? _mm512_mul_ps(widen_i8(vt + d0 + 16 * c),
                                              _mm512_set1_ps(i8_scale(vt, d, (d0 + 16 * c) / gs)))
                              : _mm512_setzero_ps();
            for (int g = 0; g < GB; g++)
                if (g < gb) {
                    __m512 pb = _mm512_set1_ps(p[g * n + t]);
                    for (int c = 0; c < 4; c++)
                        if (c < w) acc[g][c] = _mm512_fmadd_ps(pb, vv[c], acc[g][c]);
                }
        }
        for (int g = 0; g < GB; g++)
            if (g < gb) {
                __m512 l = _mm512_set1_ps(sums[g]);
                for (int c = 0; c < 4; c++)
                    if (c < w) {
                        __m512 o = _mm512_div_ps(acc[g][c], l);
                        if (bf16) { /* round to nearest even, as round_bf16 (no NaN can arise from finite K/V) */
                            __m512i u = _mm512_castps_si512(o);
                            __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                          _mm512_set1_epi32(1)));
                            _mm256_storeu_si256((__m256i *)((uint16_t *)out + g * d + d0 + 16 * c),
                                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
                        } else {
                            _mm512_storeu_ps((float *)out + g * d + d0 + 16 * c, o);
                        }
                    }
            }
    }
}

/* One KV head's query heads (float32, or bfloat16 with `bf16`; `qh` elements apart) over n int8 positions, into
 * `out` [heads, d] in the queries' dtype. */
I8 static void head_i8(int bf16, const void *q, int64_t qh, const int8_t *k, const int8_t *v, int64_t n, int64_t d,
                       int heads, float scale, void *out, float *s) {
    float sums[GB], qf[GB * d];
    for (int g0 = 0; g0 < heads; g0 += GB) {
        int gb = heads - g0 < GB ? heads - g0 : GB;
        for (int g = 0; g < gb; g++)
            for (int64_t j = 0; j < d; j++)
                qf[g * d + j] = bf16 ? widen_bf16(((const uint16_t *)q)[(g0 + g) * qh + j])
                                     : ((const float *)q)[(g0 + g) * qh + j];
        if (d == 64 && gb == 3) scores_i8(qf, k, n, 64, 3, scale, s); /* SmolLM2, Llama-3.2, Qwen: inlined */
        else if (d == 128 && gb == 4) scores_i8(qf, k, n, 128, 4, scale, s);
        else scores_i8(qf, k, n, d, gb, scale, s);
        for (int g = 0; g < gb; g++) sums[g] = softmax512(s + g * n, n);
        char *o = (char *)out + (size_t)(g0 * d) * (bf16 ? 2 : 4);
        if (d == 64 && gb == 3) values_i8(s, sums, v, n, 64, 3, o, bf16);
        else if (d == 128 && gb == 4) values_i8(s, sums, v, n, 128, 4, o, bf16);
        else values_i8(s, sums, v, n, d, gb, o, bf16);
    }
}

/* A position's int8 values and group scales from float32 `x` [d]: per group, scale = max |x| / 127 (1 where that
 * is 0), values round(x / scale) (nearest even) within -127 .. 127 -- the operations kvrag.kv.int8kv.quantize runs in
 * torch, so the same bytes. */
static void put_i8(const float *x, int64_t d, int8_t *y) {
    const int64_t gs = i8_group(d);
    for (int64_t g0 = 0; g0 < d; g0 += gs) {
        float amax = 0.0f;
        for (int64_t j = g0; j < g0 + gs; j++) {
            float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
        }
        float scale = amax / 127.0f;
        scale = scale > 0.0f ? scale : 1.0f;
        for (int64_t j = g0; j < g0 + gs; j++) {
            float r = nearbyintf(x[j] / scale);
            y[j] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
        memcpy(y + d + 4 * (g0 / gs), &scale, sizeof scale);
    }
}

/* The same function in plain C, one query head at a time, its sums in double (in key / dimension order; libm's
 * exp; `kv`: float32, bfloat16 or int8 keys and values): any x86 CPU, for testing the bfloat16 and float32 callers where the SIMD paths cannot run
 * (kvrag_row_attention_portable). Its results differ from the SIMD paths' in the last bits; like theirs, an item's
 * never depend on the other items of a call. */
static float load_el(int bf16, const void *p, int64_t i) {
    return bf16 ? widen_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* element j of position t of float32 (kv 0), bfloat16 (1) or int8 (2: times the position's scale) K/V */
static float load_kv(int kv, const void *p, int64_t t, int64_t j, int64_t d) {
    if (kv == 2) {
        const int8_t *pos = (const int8_t *)p + t * i8_width(d);
        return (float)pos[j] * i8_scale(pos, d, j / i8_group(d));
    }
    return load_el(kv, p, t * d + j);
}

static void head_portable(int bf16, int kv, const void *q, int64_t qh, const void *k, const void *v, int64_t n, int64_t d,
                          int heads, float scale, void *out, float *s) {
    for (int g = 0; g < heads; g++) {
        float mx = -INFINITY;
        double l = 0.0;
        for (int64_t t = 0; t < n; t++) {
            double acc = 0.0;
            for (int64_t j = 0; j < d; j++) acc += (double)load_el(bf16, q, g * qh + j) * load_kv(kv, k, t, j, d);
            s[t] = (float)(acc * scale);
            mx = s[t] > mx ? s[t] : mx;
        }
        for (int64_t t = 0; t < n; t++) {
            s[t] = (float)exp((double)s[t] - mx);
            l += s[t];
        }
        for (int64_t j = 0; j < d; j++) {
            double acc = 0.0;
            for (int64_t t = 0; t < n; t++) acc += (double)s[t] * load_kv(kv, v, t, j, d);
            if (bf16) ((uint16_t *)out)[g * d + j] = round_bf16((float)(acc / l));
            else ((float *)out)[g * d + j] = (float)(acc / l);
        }
    }
}

static int portable = 0; /* 1: every call takes head_portable (kvrag_row_attention_portable) */

/* Force (1) or release (0) the portable path for every later call in the process. */
void kvrag_row_attention_portable(int on) { portable = on; }

/* One (query, KV head) item: the KV head's `groups` query heads (`q_head` elements apart) over n keys / values,
 * into `out` [groups, d], in the queries' dtype. Returns 0, or -1 when out of memory for the scores. */
static int attend_head(int mode, const void *q, int64_t q_head, const void *k, const void *v, int64_t n, int64_t d,
                       int groups, float scale, void *out) {
    float *s = malloc(sizeof(float) * (size_t)(groups < GB ? groups : GB) * (size_t)n);
    if (!s) return -1;
    if (portable)
        head_portable(Q_BF16(mode), IS_I8(mode) ? 2 : mode != MODE_F32, q, q_head, k, v, n, d, groups, scale, out, s);
    else if (IS_I8(mode))
        head_i8(mode == MODE_BF16_I8KV, q, q_head, (const int8_t *)k, (const int8_t *)v, n, d, groups, scale, out, s);
    else if (mode == MODE_BF16)
        head_bf16((const uint16_t *)q, q_head, (const uint16_t *)k, (const uint16_t *)v, n, d, groups, scale,
                  (uint16_t *)out, s);
    else
        head_f32_any((const float *)q, q_head, k, v, n, d, groups, scale, (float *)out, s, mode == MODE_F32_BF16KV);
    free(s);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------ entry */

/* mode: MODE_BF16 (needs AVX512-BF16; d even), MODE_F32 or MODE_F32_BF16KV (need AVX2 + FMA; d a multiple of 8),
 * MODE_F32_I8KV or MODE_BF16_I8KV (need AVX512-F/BW/DQ/VL; d a multiple of 16; positions i8_width(d) bytes
 * apart).
 * Work items (entry, KV head) are split between `threads` OpenMP threads. Returns 0, or -1 when out of memory. */
int kvrag_row_attention(int mode, const int64_t *entries, int64_t count, int64_t heads, int64_t kv_heads, int64_t d,
                        int64_t q_head, float scale, int threads) {
    const int64_t groups = heads / kv_heads, items = count * kv_heads;
    const size_t el = Q_BF16(mode) ? 2 : 4, kvel = IS_I8(mode) ? 1 : mode == MODE_F32 ? 4 : 2;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && items > 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t *e = entries + (it / kv_heads) * 6, h = it % kv_heads;
        const char *q = (const char *)(intptr_t)e[0] + (size_t)(h * groups * q_head) * el;
        const char *k = (const char *)(intptr_t)e[1] + (size_t)(h * e[3]) * kvel;
        const char *v = (const char *)(intptr_t)e[2] + (size_t)(h * e[3]) * kvel;
        char *out = (char *)(intptr_t)e[5] + (size_t)(h * groups * d) * el;
        if (attend_head(mode, q, q_head, k, v, e[4], d, (int)groups, scale, out))
            failed = 1;
    }
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------------------- RoPE, K/V write, attention */

/* Rounding to bfloat16 as torch does it (nearest even; a NaN stays a NaN). */
static inline uint16_t round_bf16(float f) {
    union { float f; uint32_t u; } b = {.f = f};
    if ((b.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((b.u >> 16) | 0x40u);
    return (uint16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

static inline float widen_bf16(uint16_t h) {
    union { uint32_t u; float f; } b = {.u = (uint32_t)h << 16};
    return b.f;
}

/* transformers' `x * cos + rotate_half(x) * sin` (rotate_half(x) = cat(-x[d/2:], x[:d/2])) for `heads` heads of d
 * elements, `x` heads `xs` elements apart, written d apart into `y`: every product and the sum rounded to the
 * dtype, as torch's three element-wise operations round them. Not inlined, compiled without a target attribute and
 * with contraction off (NO_CONTRACT): a product and a sum never become one fused multiply-add. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_CONTRACT __attribute__((noinline, optimize("fp-contract=off")))
#else
#define NO_CONTRACT __attribute__((noinline)) /* clang contracts within one expression only, and none has both */
#endif
NO_CONTRACT static void rope_f32(const float *x, int64_t xs, int64_t heads, int64_t d, const float *c,
                                 const float *s, float *y, int64_t ys) {
    const int64_t h2 = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        const float *a = x + h * xs;
        float *o = y + h * ys;
        for (int64_t j = 0; j < h2; j++) {
            float p = a[j] * c[j], r = -a[j + h2] * s[j];
            o[j] = p + r;
        }
        for (int64_t j = h2; j < d; j++) {
            float p = a[j] * c[j], r = a[j - h2] * s[j];
            o[j] = p + r;
        }
    }
}

NO_CONTRACT static void rope_bf16(const uint16_t *x, int64_t xs, int64_t heads, int64_t d, const uint16_t *c,
                                  const uint16_t *s, uint16_t *y, int64_t ys) {
    const int64_t h2 = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *a = x + h * xs;
        uint16_t *o = y + h * ys;
        for (int64_t j = 0; j < d; j++) {
            float rot = j < h2 ? -widen_bf16(a[j + h2]) : widen_bf16(a[j - h2]);
            float p = widen_bf16(round_bf16(widen_bf16(a[j]) * widen_bf16(c[j])));
            float r = widen_bf16(round_bf16(rot * widen_bf16(s[j])));
            o[j] = round_bf16(p + r);
        }
    }
}

/* The other RoPE layouts, `mode` bits: ROPE_PAIRS -- interleaved pairs (Cohere: rotate_half(x) = (-x[2i+1], x[2i])
 * at (2i, 2i+1)); ROPE_WIDE -- bfloat16 heads rotated in float32 with float32 tables, rounded once at the end (the
 * model's `q.float() * cos + rotate_half(q.float()) * sin`, or bf16 heads times float32 tables); mode >> 8 -- partial
 * rotary: only the first (mode >> 8) dimensions rotated (tables of that width), the rest passed as they are (0: all
 * d). Each product and the sum rounded to float32 as torch's operations round them (contraction off), then to the
 * heads' dtype (bfloat16 without ROPE_WIDE: each product and the sum rounded to bfloat16, as rope_bf16). */
#define ROPE_PAIRS 1
#define ROPE_WIDE 2
NO_CONTRACT static void rope_other(const void *x, int64_t xs, int64_t heads, int64_t d, const void *c, const void *s,
                                   void *y, int64_t ys, int bf16, int mode) {
    const int64_t rd = (mode >> 8) ? (mode >> 8) : d, h2 = rd / 2;
    const int pairs = mode & ROPE_PAIRS, wide = (mode & ROPE_WIDE) || !bf16;
    const size_t el = bf16 ? 2 : 4;
    for (int64_t h = 0; h < heads; h++) {
        if (rd < d) /* the pass-through dimensions */
            memcpy((char *)y + (size_t)(h * ys + rd) * el, (const char *)x + (size_t)(h * xs + rd) * el,
                   (size_t)(d - rd) * el);
        for (int64_t j = 0; j < rd; j++) {
            int64_t src = pairs ? ((j & 1) ? j - 1 : j + 1) : (j < h2 ? j + h2 : j - h2);
            int neg = pairs ? !(j & 1) : j < h2;
            float a, b, cj, sj;
            if (bf16) {
                a = widen_bf16(((const uint16_t *)x)[h * xs + j]);
                b = widen_bf16(((const uint16_t *)x)[h * xs + src]);
            } else {
                a = ((const float *)x)[h * xs + j];
                b = ((const float *)x)[h * xs + src];
            }
            if (wide) {
                cj = ((const float *)c)[j];
                sj = ((const float *)s)[j];
            } else {
                cj = widen_bf16(((const uint16_t *)c)[j]);
                sj = widen_bf16(((const uint16_t *)s)[j]);
            }
            float rot = neg ? -b : b;
            float p = a * cj, r = rot * sj;
            if (bf16 && !wide) {
                p = widen_bf16(round_bf16(p));
                r = widen_bf16(round_bf16(r));
            }
            float o = p + r;
            if (bf16)
                ((uint16_t *)y)[h * ys + j] = round_bf16(o);
            else
                ((float *)y)[h * ys + j] = o;
        }
    }
}

/* One layer's attention for the queries of a decode or verify step, from the layer's fused q/k/v products on:
 * for each query i (row i of `qkv`: q [heads, d] | k [kv_heads, d] | v [kv_heads, d], `qkv_row` elements apart;
 * its cos / sin rows `cs_row` apart), RoPE on q and k; k and v written at the query's position p of its buffer;
 * then the query attends over positions start .. p of that buffer, as kvrag_row_attention computes it, into
 * `out` [count, heads, d]. `qbuf` [count, heads, d] receives the rotated queries. `cos` NULL: a layer without RoPE
 * (q and k used as they are). `rope`: 0, or ROPE_PAIRS / ROPE_WIDE bits (rope_other; with ROPE_WIDE the tables
 * are float32 whatever the heads' dtype).
 *
 * Entries: int64 [count, 5] = (address of the layer's keys at head 0 position 0, of its values, elements between
 * K/V heads, p, start). A verify step's queries of one row read the keys the row's earlier queries write, so all
 * writes finish before any query attends. Returns 0, or -1 when out of memory. */
int kvrag_rope_attend(int mode, const int64_t *entries, int64_t count, const void *qkv, int64_t qkv_row,
                      const void *cos, const void *sin, int64_t cs_row, int64_t heads, int64_t kv_heads, int64_t d,
                      float scale, void *qbuf, void *out, int threads, int rope) {
    const int64_t groups = heads / kv_heads, items = count * kv_heads;
    const int bf16 = Q_BF16(mode), i8 = IS_I8(mode);
    const int64_t pd = i8 ? i8_width(d) : d; /* elements between positions */
    const size_t el = bf16 ? 2 : 4, kvel = i8 ? 1 : mode == MODE_F32 ? 4 : 2, cel = (rope & ROPE_WIDE) ? 4 : el;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t i = it / kv_heads, h = it % kv_heads, *e = entries + i * 5;
            const char *row = (const char *)qkv + (size_t)(i * qkv_row) * el;
            const char *c = cos ? (const char *)cos + (size_t)(i * cs_row) * cel : NULL;
            const char *s = sin ? (const char *)sin + (size_t)(i * cs_row) * cel : NULL;
            const char *qx = row + (size_t)(h * groups * d) * el;
            const char *kx = row + (size_t)((heads + h) * d) * el;
            const char *vx = row + (size_t)((heads + kv_heads + h) * d) * el;
            char *qy = (char *)qbuf + (size_t)((i * heads + h * groups) * d) * el;
            const size_t at = (size_t)(h * e[2] + e[3] * pd) * kvel;
            char *ky = (char *)(intptr_t)e[0] + at, *vy = (char *)(intptr_t)e[1] + at;
            /* K/V narrower than the queries (bfloat16 under float32, or int8): the rotated key in the queries' dtype
             * first (kf, or kh for bfloat16 queries), then rounded or quantized as it is written */
            const int narrow = i8 || mode == MODE_F32_BF16KV;
            float kf[narrow ? d : 1], vf[i8 ? d : 1];
            uint16_t kh[i8 && bf16 ? d : 1];
            char *kd = !narrow ? ky : bf16 ? (char *)kh : (char *)kf;
            if (!cos) { /* a layer without RoPE: q and k as they are */
                memcpy(qy, qx, (size_t)(groups * d) * el);
                memcpy(kd, kx, (size_t)d * el);
            } else if (rope) {
                rope_other(qx, d, groups, d, c, s, qy, d, bf16, rope);
                rope_other(kx, d, 1, d, c, s, kd, d, bf16, rope);
            } else if (bf16) {
                rope_bf16((const uint16_t *)qx, d, groups, d, (const uint16_t *)c, (const uint16_t *)s,
                          (uint16_t *)qy, d);
                rope_bf16((const uint16_t *)kx, d, 1, d, (const uint16_t *)c, (const uint16_t *)s, (uint16_t *)kd, d);
            } else {
                rope_f32((const float *)qx, d, groups, d, (const float *)c, (const float *)s, (float *)qy, d);
                rope_f32((const float *)kx, d, 1, d, (const float *)c, (const float *)s, (float *)kd, d);
            }
            if (mode == MODE_F32_BF16KV) { /* float32 k and v, rounded to bfloat16 as they are written */
                for (int64_t j = 0; j < d; j++) {
                    ((uint16_t *)ky)[j] = round_bf16(kf[j]);
                    ((uint16_t *)vy)[j] = round_bf16(((const float *)vx)[j]);
                }
                continue;
            }
            if (!i8) {
                memcpy(vy, vx, (size_t)d * el);
                continue;
            }
            for (int64_t j = 0; j < d; j++) { /* widened exactly */
                if (bf16) kf[j] = widen_bf16(kh[j]);
                vf[j] = bf16 ? widen_bf16(((const uint16_t *)vx)[j]) : ((const float *)vx)[j];
            }
            put_i8(kf, d, (int8_t *)ky);
            put_i8(vf, d, (int8_t *)vy);
        }
        /* the loop's closing barrier: every K/V is written before any query attends. Head-major: a verify step's
         * positions of one row attend over the same KV head one after the other, while it is in cache. */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t i = it % count, h = it / count, *e = entries + i * 5;
            const char *q = (const char *)qbuf + (size_t)((i * heads + h * groups) * d) * el;
            const size_t at = (size_t)(h * e[2] + e[4] * pd) * kvel;
            const char *k = (const char *)(intptr_t)e[0] + at, *v = (const char *)(intptr_t)e[1] + at;
            char *o = (char *)out + (size_t)((i * heads + h * groups) * d) * el;
            if (attend_head(mode, q, d, k, v, e[3] - e[4] + 1, d, (int)groups, scale, o))
                failed = 1;
        }
    }
    return failed ? -1 : 0;
}

int kvrag_row_attention_abi(void) { return 7; }
