/* De-quantization of GGUF (ggml) blocks into float32 rows, for kvrag.kv.gguf_quant's dense products.
 *
 * Each type computes exactly what gguf.quants.dequantize (numpy) computes: the same float32 products and
 * differences in the same order, one operation at a time (no fused multiply-add: fp-contract is off for these
 * functions, and each rounding step is its own statement), so the floats are the same bits. Types: Q4_0, Q4_1,
 * Q8_0, Q4_K, Q5_K, Q6_K (block layouts as in ggml-common.h). target_clones builds an AVX512 / AVX2 copy beside the
 * baseline one and the loader picks the best the CPU has; all copies give the same bits (no contraction, no
 * reassociation).
 *
 * kvrag_dequant (below) writes float32 rows, or bfloat16 rows rounded as torch rounds, straight into the caller's
 * buffer (the model's scratch). kvrag_dequant_dot multiplies a few input rows by the weight without writing it out:
 * each weight row de-quantized a chunk at a time into a stack buffer and multiplied there (decode-sized products of
 * the types that have no int4 form), Q6_K in AVX-512 registers where the CPU has them, with the same bits. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define KVRAG_DEQUANT_ABI 5
#define QK_K 256

enum { T_Q4_0 = 0, T_Q4_1 = 1, T_Q8_0 = 2, T_Q4_K = 3, T_Q5_K = 4, T_Q6_K = 5 };

int kvrag_dequant_abi(void) { return KVRAG_DEQUANT_ABI; }

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default"), optimize("fp-contract=off")))
#elif defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((optimize("fp-contract=off")))
#else
#define CLONES
#endif

static inline float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  /* subnormal half: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void k_scale_min(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int i = 0; i < 4; i++) {
        sc[i] = s[i] & 0x3F;
        mn[i] = s[4 + i] & 0x3F;
        sc[4 + i] = (uint8_t)((s[8 + i] & 0x0F) | ((s[i] >> 2) & 0x30));
        mn[4 + i] = (uint8_t)((s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30));
    }
}

CLONES static void row_q4_0(const uint8_t *restrict b, int64_t blocks, float *restrict out) {
    for (int64_t i = 0; i < blocks; i++, b += 18, out += 32) {
        float d = f16(b);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((b[2 + j] & 15) - 8);
            out[16 + j] = d * (float)((b[2 + j] >> 4) - 8);
        }
    }
}

CLONES static void row_q4_1(const uint8_t *restrict b, int64_t blocks, float *restrict out) {
    for (int64_t i = 0; i < blocks; i++, b += 20, out += 32) {
        float d = f16(b), m = f16(b + 2);
        for (int j = 0; j < 16; j++) {
            float lo = d * (float)(b[4 + j] & 15), hi = d * (float)(b[4 + j] >> 4);
            out[j] = lo + m;
            out[16 + j] = hi + m;
        }
    }
}

CLONES static void row_q8_0(const uint8_t *restrict b, int64_t blocks, float *restrict out) {
    for (int64_t i = 0; i < blocks; i++, b += 34, out += 32) {
        float d = f16(b);
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)b[2 + j] * d;
    }
}

/* Q4_K / Q5_K: w = (d * sc) * q - (dmin * m) per 32-weight sub-block. */
static inline __attribute__((always_inline)) void k_block(const uint8_t *restrict b, float *restrict out, const int five) {
    float d = f16(b), dmin = f16(b + 2);
    uint8_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = five ? b + 48 : b + 16;
    for (int s = 0; s < 8; s++) {
        float ds = d * (float)sc[s], dm = dmin * (float)mn[s];
        const uint8_t *q = qs + (s / 2) * 32;
        const int shift = (s & 1) * 4;
        float *y = out + s * 32;
        for (int j = 0; j < 32; j++) {
            int v = (q[j] >> shift) & 15;
            if (five) v |= ((qh[j] >> s) & 1) << 4;
            float p = ds * (float)v;
            y[j] = p - dm;
        }
    }
}

CLONES static void row_q4_k(const uint8_t *restrict b, int64_t blocks, float *restrict out) {
    for (int64_t i = 0; i < blocks; i++) k_block(b + i * 144, out + i * QK_K, 0);
}

CLONES static void row_q5_k(const uint8_t *restrict b, int64_t blocks, float *restrict out) {
    for (int64_t i = 0; i < blocks; i++) k_block(b + i * 176, out + i * QK_K, 1);
}

/* Q6_K: w = (d * sc) * (q - 32) per 16-weight sub-block; q = a low nibble | 2 high bits << 4. Each half of 128
 * weights: ql[0..63] low nibbles then high nibbles, qh[0..31] four 2-bit fields (as ggml's dequantize_row_q6_K). */
CLONES static void row_q6_k(const uint8_t *restrict b, int64_t blocks, float *restrict out) {
    for (int64_t i = 0; i < blocks; i++, b += 210, out += QK_K) {
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = f16(b + 208), ds[16];
        for (int s = 0; s < 16; s++) ds[s] = d * (float)sc[s];
        for (int c = 0; c < 2; c++) {
            const uint8_t *ql = b + c * 64, *qh = b + 128 + c * 32;
            float *y = out + c * 128;
            const float *dc = ds + c * 8;
            for (int h = 0; h < 2; h++)
                for (int l = h * 16; l < h * 16 + 16; l++) {
                    y[l] = dc[h] * (float)((int)((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
                    y[l + 32] = dc[h + 2] * (float)((int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    y[l + 64] = dc[h + 4] * (float)((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    y[l + 96] = dc[h + 6] * (float)((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
        }
    }
}

static const int64_t BLOCK_WEIGHTS[] = {32, 32, 32, QK_K, QK_K, QK_K}, BLOCK_BYTES[] = {18, 20, 34, 144, 176, 210};

static void row_f32(int type, const uint8_t *b, int64_t blocks, float *out) {
    switch (type) {
    case T_Q4_0: row_q4_0(b, blocks, out); break;
    case T_Q4_1: row_q4_1(b, blocks, out); break;
    case T_Q8_0: row_q8_0(b, blocks, out); break;
    case T_Q4_K: row_q4_k(b, blocks, out); break;
    case T_Q5_K: row_q5_k(b, blocks, out); break;
    default: row_q6_k(b, blocks, out); break;
    }
}

/* float32 -> bfloat16, round to nearest even (torch's conversion; weights are finite). */
CLONES static void to_bf16(const float *src, int64_t count, uint16_t *dst) {
    for (int64_t i = 0; i < count; i++) {
        uint32_t v;
        memcpy(&v, src + i, 4);
        dst[i] = (uint16_t)((v + 0x7FFFu + ((v >> 16) & 1u)) >> 16);
    }
}

#define CHUNK 4096 /* weights de-quantized at a time into a stack buffer on the bfloat16 route */

static void row(int type, const uint8_t *b, int64_t columns, void *out, int bf16) {
    if (!bf16) {
        row_f32(type, b, columns / BLOCK_WEIGHTS[type], (float *)out);
        return;
    }
    float tmp[CHUNK];
    const int64_t per = CHUNK / BLOCK_WEIGHTS[type];
    for (int64_t c = 0; c < columns; c += CHUNK) {
        int64_t n = columns - c < CHUNK ? columns - c : CHUNK, blocks = n / BLOCK_WEIGHTS[type];
        row_f32(type, b + (c / CHUNK) * per * BLOCK_BYTES[type], blocks, tmp);
        to_bf16(tmp, n, (uint16_t *)out + c);
    }
}

#define DOT_ROWS 16 /* input rows kvrag_dequant_dot takes at once (kvrag.kv.quant.MAX_ROWS) */
#define LANES 16

/* y[m * n + r] = sum over k of w[r][k] * x[m * columns + k] for weight rows r0 <= r < r1, m < rows: weight row r
 * de-quantized CHUNK weights at a time (the floats row_f32 computes) into a stack buffer, multiplied and added into
 * LANES float32 partial sums per input row (lane j takes the weights j, j + LANES, ...), which are then added in
 * lane order. Each output depends only on its own input row and weight row, whatever the other rows. */
CLONES static void dot_rows(int type, const uint8_t *blocks, int64_t r0, int64_t r1, int64_t n, int64_t row_bytes,
                            int64_t columns, const float *x, int64_t rows, float *y) {
    float tmp[CHUNK], acc[DOT_ROWS][LANES];
    const int64_t per = CHUNK / BLOCK_WEIGHTS[type];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *b = blocks + r * row_bytes;
        memset(acc, 0, sizeof(acc));
        for (int64_t c = 0; c < columns; c += CHUNK) {
            int64_t len = columns - c < CHUNK ? columns - c : CHUNK;
            row_f32(type, b + (c / CHUNK) * per * BLOCK_BYTES[type], len / BLOCK_WEIGHTS[type], tmp);
            for (int64_t m = 0; m < rows; m++) {
                const float *xm = x + m * columns + c;
                float *a = acc[m];
                for (int64_t k = 0; k < len; k += LANES)
                    for (int j = 0; j < LANES; j++) {
                        float p = tmp[k + j] * xm[k + j];
                        a[j] = a[j] + p;
                    }
            }
        }
        for (int64_t m = 0; m < rows; m++) {
            float s = 0.0f;
            for (int j = 0; j < LANES; j++) s = s + acc[m][j];
            y[m * n + r] = s;
        }
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX512_Q6K 1
#define PREFETCH 4096 /* bytes of blocks ahead of the one being decoded that a Q6_K product asks for */
/* dot_rows for Q6_K with AVX-512 registers: 16 weights at a time de-quantized in a vector -- (float)(q - 32) times
 * the sub-block's d * sc, one rounding each, as row_q6_k computes them -- and multiplied and added (no fused
 * multiply-add) into lane j of each input row's accumulator for weights j, j + 16, ...: the same floats, lanes and
 * order as dot_rows, so the same bits. */
__attribute__((target("avx512f"), optimize("fp-contract=off"))) static void dot_rows_q6k_avx512(const uint8_t *blocks, int64_t r0, int64_t r1,
                                                                   int64_t n, int64_t row_bytes, int64_t columns,
                                                                   const float *x, int64_t rows, float *y) {
    const __m512i low4 = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *b = blocks + r * row_bytes;
        __m512 acc[DOT_ROWS];
        for (int64_t m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t i = 0; i < columns / QK_K; i++, b += 210) {
            for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)b + PREFETCH + l, _MM_HINT_T0);
            const int8_t *sc = (const int8_t *)(b + 192);
            float d = f16(b + 208);
            for (int c = 0; c < 2; c++) {
                const uint8_t *ql = b + c * 64, *qh = b + 128 + c * 32;
                __m512i hv[2], la[2], lb[2];
                for (int h = 0; h < 2; h++) {
                    hv[h] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + h * 16)));
                    la[h] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + h * 16)));
                    lb[h] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 32 + h * 16)));
                }
                for (int j = 0; j < 4; j++)  /* weights in ascending order: lanes add as dot_rows adds them */
                    for (int h = 0; h < 2; h++) {
                        __m512i lo = j == 0 ? _mm512_and_si512(la[h], low4) : j == 1 ? _mm512_and_si512(lb[h], low4)
                                     : j == 2 ? _mm512_srli_epi32(la[h], 4) : _mm512_srli_epi32(lb[h], 4);
                        __m512i hi = _mm512_and_si512(_mm512_srli_epi32(hv[h], 2 * j), two);
                        __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), off);
                        float scale = d * (float)sc[c * 8 + h + 2 * j];
                        __m512 w = _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(q));
                        const int64_t k = i * QK_K + c * 128 + j * 32 + h * 16;
                        for (int64_t m = 0; m < rows; m++)
                            acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(w, _mm512_loadu_ps(x + m * columns + k)));
                    }
            }
        }
        for (int64_t m = 0; m < rows; m++) {
            float lanes[LANES], s = 0.0f;
            _mm512_storeu_ps(lanes, acc[m]);
            for (int j = 0; j < LANES; j++) s = s + lanes[j];
            y[m * n + r] = s;
        }
    }
}

/* dot_rows for Q6_K on bfloat16 input rows, with AVX512-BF16: a block's 6-bit values decoded 64 at a time in byte
 * lanes and looked up as the bfloat16 numbers q - 32 (exact), each 32 of them multiplied by the row's 32 inputs with
 * one VDPBF16PS (products exact, pairs added in float32), then times their two sub-blocks' d * sc (lanes 0-7 the
 * first 16 weights', 8-15 the second's) with a fused multiply-add into one of two accumulators a row (alternating
 * 32-weight pieces), added in a fixed order at the end. A row's output depends only on its own inputs, whatever the
 * other rows. Not the bits of dot_rows: a product of its own, chosen only for bfloat16 inputs (exact in float32, so
 * no input is rounded). */
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define BF16_ROWS 4     /* input rows a pass over the weight rows keeps in registers */
BF16_TARGET static inline __attribute__((always_inline)) void q6k_bf16_pass(
    const uint8_t *blocks, int64_t r0, int64_t r1, int64_t row_bytes, int64_t n, int64_t columns, const uint16_t *x,
    float *y, const int rows) {
    uint16_t table[64];
    for (int i = 0; i < 64; i++) {
        float f = (float)(i - 32);
        uint32_t v;
        memcpy(&v, &f, 4);
        table[i] = (uint16_t)(v >> 16); /* small integers: exact in bfloat16 */
    }
    const __m512i lut_lo = _mm512_loadu_si512(table), lut_hi = _mm512_loadu_si512(table + 32);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3);
    __m512i pair[8]; /* lanes 0-7: sub-block 2p, 8-15: 2p + 1 */
    for (int p = 0; p < 8; p++)
        pair[p] = _mm512_set_epi32(2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                   2 * p + 1, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *b = blocks + r * row_bytes;
        __m512 acc[BF16_ROWS][2];
        for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (int64_t i = 0; i < columns / QK_K; i++, b += 210) {
            for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)b + PREFETCH + l, _MM_HINT_T0);
            const __m512 scales = _mm512_mul_ps(
                _mm512_set1_ps(f16(b + 208)),
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
            for (int c = 0; c < 2; c++) {
                const __m512i a = _mm512_loadu_si512(b + c * 64);
                const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + c * 32));
                const __m512i ha = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
                const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(h, 4)),
                                                      _mm256_srli_epi16(h, 6), 1);
                const __m512i q[2] = {
                    _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_slli_epi16(_mm512_and_si512(ha, m2), 4)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4),
                                    _mm512_slli_epi16(_mm512_and_si512(hb, m2), 4))};
                for (int j = 0; j < 4; j++) { /* weights c * 128 + 32 j .. + 31 */
                    const __m256i part = j & 1 ? _mm512_extracti64x4_epi64(q[j >> 1], 1)
                                               : _mm512_castsi512_si256(q[j >> 1]);
                    const __m512i w = _mm512_permutex2var_epi16(lut_lo, _mm512_cvtepu8_epi16(part), lut_hi);
                    const __m512 s = _mm512_permutexvar_ps(pair[c * 4 + j], scales);
                    const int64_t k = i * QK_K + c * 128 + j * 32;
                    for (int m = 0; m < rows; m++) {
                        const __m512i xv = _mm512_loadu_si512(x + m * columns + k);
                        const __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w, (__m512bh)xv);
                        acc[m][j & 1] = _mm512_fmadd_ps(p, s, acc[m][j & 1]);
                    }
                }
            }
        }
        for (int m = 0; m < rows; m++) y[m * n + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
    }
}

/* dot_rows for Q6_K on bfloat16 inputs (above), up to BF16_ROWS input rows a pass over the weight rows. */
BF16_TARGET static void dot_rows_q6k_bf16(const uint8_t *blocks, int64_t r0, int64_t r1, int64_t row_bytes,
                                          int64_t n, int64_t columns, const uint16_t *x, int64_t rows, float *y) {
    for (int64_t m = 0; m < rows; m += BF16_ROWS) {
        const uint16_t *xm = x + m * columns;
        float *ym = y + m * n;
        switch (rows - m < BF16_ROWS ? rows - m : BF16_ROWS) {
        case 1: q6k_bf16_pass(blocks, r0, r1, row_bytes, n, columns, xm, ym, 1); break;
        case 2: q6k_bf16_pass(blocks, r0, r1, row_bytes, n, columns, xm, ym, 2); break;
        case 3: q6k_bf16_pass(blocks, r0, r1, row_bytes, n, columns, xm, ym, 3); break;
        default: q6k_bf16_pass(blocks, r0, r1, row_bytes, n, columns, xm, ym, 4); break;
        }
    }
}
#endif

static void dot_range(int type, const uint8_t *blocks, int64_t r0, int64_t r1, int64_t n, int64_t row_bytes,
                      int64_t columns, const void *x, int64_t rows, float *y, int bf16) {
#ifdef HAVE_AVX512_Q6K
    if (bf16) {
        dot_rows_q6k_bf16(blocks, r0, r1, row_bytes, n, columns, (const uint16_t *)x, rows, y);
        return;
    }
    if (type == T_Q6_K && __builtin_cpu_supports("avx512f")) {
        dot_rows_q6k_avx512(blocks, r0, r1, n, row_bytes, columns, (const float *)x, rows, y);
        return;
    }
#endif
    dot_rows(type, blocks, r0, r1, n, row_bytes, columns, (const float *)x, rows, y);
}

static int dot(int type, const uint8_t *blocks, int64_t n, int64_t row_bytes, int64_t columns, const void *x,
               int64_t rows, float *y, int threads, int bf16) {
    if (type < T_Q4_0 || type > T_Q6_K || rows < 1 || rows > DOT_ROWS || columns % LANES
        || columns % BLOCK_WEIGHTS[type]) return -1;
#ifdef _OPENMP
    if (threads > 1 && n >= 64 * threads) {
#pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), k = omp_get_num_threads();
            int64_t lo = n * t / k, hi = n * (t + 1) / k;
            dot_range(type, blocks, lo, hi, n, row_bytes, columns, x, rows, y, bf16);
        }
        return 0;
    }
#else
    (void)threads;
#endif
    dot_range(type, blocks, 0, n, n, row_bytes, columns, x, rows, y, bf16);
    return 0;
}

/* y [rows, n] = x [rows, columns] (float32) times the transposed weight of n rows of ``type`` blocks (row r at blocks
 * + r * row_bytes); columns a multiple of LANES and of the block, rows at most DOT_ROWS. threads > 1 splits the
 * weight rows between OpenMP threads. 0, or -1: an unknown type or shape. */
int kvrag_dequant_dot(int type, const uint8_t *blocks, int64_t n, int64_t row_bytes, int64_t columns, const float *x,
                      int64_t rows, float *y, int threads) {
    return dot(type, blocks, n, row_bytes, columns, x, rows, y, threads, 0);
}

/* kvrag_dequant_dot on bfloat16 input rows (dot_rows_q6k_bf16): Q6_K only, on a CPU with AVX512-BF16; -1 elsewhere
 * (the caller then takes the float32 product). */
int kvrag_dequant_dot_bf16(int type, const uint8_t *blocks, int64_t n, int64_t row_bytes, int64_t columns,
                           const uint16_t *x, int64_t rows, float *y, int threads) {
#ifdef HAVE_AVX512_Q6K
    if (type == T_Q6_K && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl"))
        return dot(type, blocks, n, row_bytes, columns, x, rows, y, threads, 1);
#endif
    (void)type, (void)blocks, (void)n, (void)row_bytes, (void)columns, (void)x, (void)rows, (void)y, (void)threads;
    return -1;
}

/* rows x columns weights of ``type`` (row r's blocks at blocks + r * row_bytes) into out: float32, or bfloat16
 * when bf16 (rounded as torch rounds). threads > 1 splits the rows between OpenMP threads. 0, or -1: unknown type. */
int kvrag_dequant(int type, const uint8_t *blocks, int64_t rows, int64_t row_bytes, int64_t columns, void *out,
                  int bf16, int threads) {
    if (type < T_Q4_0 || type > T_Q6_K) return -1;
    const int64_t esize = bf16 ? 2 : 4;
#ifdef _OPENMP
    if (threads > 1 && rows >= 2 * threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < rows; r++) row(type, blocks + r * row_bytes, columns, (char *)out + r * columns * esize, bf16);
        return 0;
    }
#else
    (void)threads;
#endif
    for (int64_t r = 0; r < rows; r++) row(type, blocks + r * row_bytes, columns, (char *)out + r * columns * esize, bf16);
    return 0;
}
