/* kvrag's int4 weight-only product for decode-sized inputs on x86 CPUs with AVX512-BF16.
 *
 *   out[m, n] = bf16( sum_k x[m, k] * w[n, k] ),   w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],  g = k / 32
 *
 * x and out are bfloat16 rows (kvrag_int4_mm_f32: float32 rows and outputs around the same product); q is 4-bit,
 * scale / zero bfloat16 -- the weight torch's _weight_int4pack_mm_for_cpu
 * multiplies by, in a layout of its own (kvrag/kv/int4_kernel.py packs it):
 *
 *   for each tile of 16 outputs, for each group of 32 inputs: 8 chunks of 32 bytes, then 16 scales and 16 zeros
 *   (bf16). Byte j of chunk c holds, for output n = j / 2 and kk = j % 2, q[n, 32 g + 4 c + kk] in its low nibble
 *   and q[n, 32 g + 4 c + 2 + kk] in its high nibble.
 *
 * A nibble q turns into the bfloat16 number 128 + q by OR-ing it into 0x4300 (128 = 0x4300 in bf16, and 128..255
 * step 1 are exact), so one VDPBF16PS multiplies 32 weights by 2 broadcast inputs for 16 outputs. Per group:
 *   sum_k x w = scale * sum_k x (128 + q) + (zero - 136 scale) * sum_k x.
 * The weights are decoded once per tile and group for up to ROWS input rows, so a batch of 8 rows reads and decodes
 * the weights once (torch's kernel decodes them per row). Each row's arithmetic is the same whatever the other rows
 * are: a row's outputs do not depend on the batch it is in.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define GROUP 32
#define TILE 16
#define ROWS 8
#define CHUNKS (GROUP / 4)
#define GROUP_BYTES (CHUNKS * 32 + TILE * 2 * 2)

#define TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

TARGET static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The rows' per-group input sums, fp32, in the order the kernel adds them: sums[m * groups + g]. */
TARGET static void group_sums(const uint16_t *x, int64_t rows,
                                                                              int64_t k, float *sums) {
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    int64_t groups = k / GROUP;
    for (int64_t m = 0; m < rows; m++) {
        for (int64_t g = 0; g < groups; g++) {
            __m512i xv = _mm512_loadu_si512((const void *)(x + m * k + g * GROUP));
            __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xv, ones);
            sums[m * groups + g] = _mm512_reduce_add_ps(s);
        }
    }
}

/* rows m0 .. m0 + R - 1 against tiles t .. t + TT - 1, for every t in [t0, t1) stepping by TT. Several tiles at
 * once give the one- and two-row cases independent chains of VDPBF16PS (its latency, not its throughput, bounds a
 * single chain); every output's own sum is added in the same order whatever R and TT are. */
static inline __attribute__((always_inline)) TARGET void block(const uint16_t *x, int64_t m0, int64_t k,
                                                               const uint8_t *w, int64_t n, const float *sums,
                                                               uint16_t *out, int64_t t0, int64_t t1, const int R,
                                                               const int TT) {
    const __m512i low = _mm512_set1_epi16(0x000F);
    const __m512i bias = _mm512_set1_epi16(0x4300);
    const int64_t groups = k / GROUP;
    const int64_t tile_bytes = groups * GROUP_BYTES;
    for (int64_t t = t0; t + TT <= t1; t += TT) {
        __m512 tot[R][TT];
        for (int r = 0; r < R; r++)
            for (int u = 0; u < TT; u++) tot[r][u] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m512 acc[R][TT];
            for (int r = 0; r < R; r++)
                for (int u = 0; u < TT; u++) acc[r][u] = _mm512_setzero_ps();
            for (int c = 0; c < CHUNKS; c++) {
                __m512i lo[TT], hi[TT];
                for (int u = 0; u < TT; u++) {
                    const uint8_t *wg = w + (t + u) * tile_bytes + g * GROUP_BYTES;
                    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wg + c * 32)));
                    lo[u] = _mm512_ternarylogic_epi32(b, low, bias, 0xEA); /* (b & low) | bias */
                    hi[u] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), low, bias, 0xEA);
                }
                for (int r = 0; r < R; r++) {
                    const uint16_t *xr = x + (m0 + r) * k + g * GROUP + 4 * c;
                    uint32_t x01, x23;
                    memcpy(&x01, xr, 4);
                    memcpy(&x23, xr + 2, 4);
                    __m512bh b01 = (__m512bh)_mm512_set1_epi32((int)x01);
                    __m512bh b23 = (__m512bh)_mm512_set1_epi32((int)x23);
                    for (int u = 0; u < TT; u++) {
                        acc[r][u] = _mm512_dpbf16_ps(acc[r][u], b01, (__m512bh)lo[u]);
                        acc[r][u] = _mm512_dpbf16_ps(acc[r][u], b23, (__m512bh)hi[u]);
                    }
                }
            }
            for (int u = 0; u < TT; u++) {
                const uint16_t *sz = (const uint16_t *)(w + (t + u) * tile_bytes + g * GROUP_BYTES + CHUNKS * 32);
                __m512 scale = bf16x16_to_f32(sz);
                __m512 zero = bf16x16_to_f32(sz + TILE);
                __m512 off = _mm512_fmadd_ps(_mm512_set1_ps(-136.0f), scale, zero);
                for (int r = 0; r < R; r++) {
                    tot[r][u] = _mm512_fmadd_ps(acc[r][u], scale, tot[r][u]);
                    tot[r][u] = _mm512_fmadd_ps(off, _mm512_set1_ps(sums[(m0 + r) * groups + g]), tot[r][u]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int u = 0; u < TT; u++) {
                __m256i o = (__m256i)_mm512_cvtneps_pbh(tot[r][u]);
                _mm256_storeu_si256((__m256i *)(out + (m0 + r) * n + (t + u) * TILE), o);
            }
    }
}

#define DEFINE_BLOCK(R, TT)                                                                                       \
    TARGET static void block_##R(const uint16_t *x, int64_t m0, int64_t k, const uint8_t *w, int64_t n,          \
                                 const float *sums, uint16_t *out, int64_t t0, int64_t t1) {                      \
        int64_t full = t0 + (t1 - t0) / TT * TT;                                                                  \
        block(x, m0, k, w, n, sums, out, t0, full, R, TT);                                                        \
        block(x, m0, k, w, n, sums, out, full, t1, R, 1);                                                         \
    }

DEFINE_BLOCK(1, 4)
DEFINE_BLOCK(2, 4)
DEFINE_BLOCK(3, 2)
DEFINE_BLOCK(4, 2)
DEFINE_BLOCK(5, 1)
DEFINE_BLOCK(6, 1)
DEFINE_BLOCK(7, 1)
DEFINE_BLOCK(8, 1)

typedef void (*block_fn)(const uint16_t *, int64_t, int64_t, const uint8_t *, int64_t, const float *, uint16_t *,
                         int64_t, int64_t);
static const block_fn BLOCKS[ROWS + 1] = {0, block_1, block_2, block_3, block_4, block_5, block_6, block_7, block_8};

/* ---- AMX: the same product with the tile unit, for CPUs with AMX-BF16 ----
 * Per tile of 16 outputs and group of 32 inputs, the 8 chunks decode into one B tile (16 rows of input pairs x 16
 * outputs x 2, VNNI order: exactly the lo / hi registers above, pair p = row p), the rows' 32 inputs of the group
 * are the A tile (up to 16 rows, read in place), one TDPBF16PS gives the group's [rows, 16] sums, and the group's
 * scale and offset are applied as above. Every row runs the same instructions whatever the row count, so a row's
 * outputs do not depend on its batch; they differ in the last bf16 bit from the VDPBF16PS path's now and then,
 * and a process uses one path for every call. */
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))

struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

AMX_TARGET static void amx_config(int64_t rows) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    /* tmm0, tmm3, tmm5: C (rows x 16 fp32); tmm1: A (rows x 32 bf16); tmm2, tmm4, tmm6: B (16 pairs x 32 bf16) */
    for (int i = 0; i < 7; i++) {
        cfg.rows[i] = (i == 2 || i == 4 || i == 6) ? 16 : (uint8_t)rows;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

AMX_TARGET static inline __attribute__((always_inline)) void amx_decode(const uint8_t *wg, uint16_t *btile) {
    const __m512i low = _mm512_set1_epi16(0x000F);
    const __m512i bias = _mm512_set1_epi16(0x4300);
    for (int c = 0; c < CHUNKS; c++) {
        __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wg + c * 32)));
        _mm512_store_si512((void *)(btile + (2 * c) * 32), _mm512_ternarylogic_epi32(b, low, bias, 0xEA));
        _mm512_store_si512((void *)(btile + (2 * c + 1) * 32),
                           _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), low, bias, 0xEA));
    }
}

AMX_TARGET static inline __attribute__((always_inline)) void amx_epilogue(const uint8_t *wg, const float *ctile,
                                                                          __m512 *tot, int64_t rows,
                                                                          const float *sums, int64_t m0,
                                                                          int64_t groups, int64_t g) {
    const uint16_t *sz = (const uint16_t *)(wg + CHUNKS * 32);
    __m512 scale = bf16x16_to_f32(sz);
    __m512 zero = bf16x16_to_f32(sz + TILE);
    __m512 off = _mm512_fmadd_ps(_mm512_set1_ps(-136.0f), scale, zero);
    for (int r = 0; r < rows; r++) {
        tot[r] = _mm512_fmadd_ps(_mm512_load_ps(ctile + r * 16), scale, tot[r]);
        tot[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(sums[(m0 + r) * groups + g]), tot[r]);
    }
}

AMX_TARGET static inline __attribute__((always_inline)) void amx_store(const __m512 *tot, int64_t rows,
                                                                       uint16_t *out, int64_t m0, int64_t n,
                                                                       int64_t t) {
    for (int r = 0; r < rows; r++) {
        __m256i o = (__m256i)_mm512_cvtneps_pbh(tot[r]);
        _mm256_storeu_si256((__m256i *)(out + (m0 + r) * n + t * TILE), o);
    }
}

/* Three tiles of outputs at a time (tile registers are not renamed: three independent chains keep the unit busy);
 * a remainder of one or two tiles runs the same steps with the others left out. */
AMX_TARGET static void amx_rows(const uint16_t *x, int64_t m0, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
                                const float *sums, uint16_t *out, int64_t t0, int64_t t1) {
    const int64_t groups = k / GROUP;
    const int64_t tile_bytes = groups * GROUP_BYTES;
    __attribute__((aligned(64))) uint16_t b0[16 * 32], b1[16 * 32], b2[16 * 32];
    __attribute__((aligned(64))) float c0[16 * 16], c1[16 * 16], c2[16 * 16];
    amx_config(rows);
    for (int64_t t = t0; t < t1; t += 3) {
        int nt = t1 - t < 3 ? (int)(t1 - t) : 3;
        __m512 tot0[16], tot1[16], tot2[16];
        for (int r = 0; r < rows; r++) tot0[r] = tot1[r] = tot2[r] = _mm512_setzero_ps();
        const uint8_t *w0 = w + t * tile_bytes, *w1 = w0 + tile_bytes, *w2 = w1 + tile_bytes;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t go = g * GROUP_BYTES;
            _tile_loadd(1, x + m0 * k + g * GROUP, k * 2);
            amx_decode(w0 + go, b0);
            _tile_zero(0);
            _tile_loadd(2, b0, 64);
            _tile_dpbf16ps(0, 1, 2);
            if (nt > 1) {
                amx_decode(w1 + go, b1);
                _tile_zero(3);
                _tile_loadd(4, b1, 64);
                _tile_dpbf16ps(3, 1, 4);
            }
            if (nt > 2) {
                amx_decode(w2 + go, b2);
                _tile_zero(5);
                _tile_loadd(6, b2, 64);
                _tile_dpbf16ps(5, 1, 6);
            }
            _tile_stored(0, c0, 64);
            amx_epilogue(w0 + go, c0, tot0, rows, sums, m0, groups, g);
            if (nt > 1) {
                _tile_stored(3, c1, 64);
                amx_epilogue(w1 + go, c1, tot1, rows, sums, m0, groups, g);
            }
            if (nt > 2) {
                _tile_stored(5, c2, 64);
                amx_epilogue(w2 + go, c2, tot2, rows, sums, m0, groups, g);
            }
        }
        amx_store(tot0, rows, out, m0, n, t);
        if (nt > 1) amx_store(tot1, rows, out, m0, n, t + 1);
        if (nt > 2) amx_store(tot2, rows, out, m0, n, t + 2);
    }
    _tile_release();
}

/* Linux: a process must ask for the AMX state before its first tile instruction (oneDNN asks too). 1: granted. */
int kvrag_int4_amx_init(void) {
    unsigned long bitmask = 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 0;
    if (syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &bitmask)) return 0;
    return (bitmask & (1UL << 18)) != 0;
}

/* ---- portable: the same product in plain C (path 2), for testing the callers on any x86 CPU ----
 * Per output and group: acc = sum_k x (128 + q) in float32 (each bf16 x bf16 product exact), then
 * tot = fma(acc, scale, tot), tot = fma(zero - 136 scale, sum_k x, tot), rounded to bfloat16 -- the SIMD paths'
 * formula with the sums in k order, so its outputs differ from theirs in the last bit now and then. */
static inline float p_widen(uint16_t h) {
    union { uint32_t u; float f; } b = {.u = (uint32_t)h << 16};
    return b.f;
}

static inline uint16_t p_round(float f) { /* torch's vectorized conversion: nearest even, NaN -> 0xFFFF */
    union { float f; uint32_t u; } b = {.f = f};
    if (f != f) return 0xFFFF;
    return (uint16_t)((b.u + 0x7FFFu + ((b.u >> 16) & 1u)) >> 16);
}

static void portable_sums(const uint16_t *x, int64_t rows, int64_t k, float *sums) {
    const int64_t groups = k / GROUP;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int i = 0; i < GROUP; i++) s += p_widen(x[m * k + g * GROUP + i]);
            sums[m * groups + g] = s;
        }
}

static void portable_tiles(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
                           const float *sums, uint16_t *out, int64_t t0, int64_t t1) {
    const int64_t groups = k / GROUP, tile_bytes = groups * GROUP_BYTES;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t m = 0; m < rows; m++)
            for (int o = 0; o < TILE; o++) {
                float tot = 0.0f;
                for (int64_t g = 0; g < groups; g++) {
                    const uint8_t *wg = w + t * tile_bytes + g * GROUP_BYTES;
                    const uint16_t *xg = x + m * k + g * GROUP;
                    float acc = 0.0f;
                    for (int c = 0; c < CHUNKS; c++)
                        for (int kk = 0; kk < 2; kk++) {
                            uint8_t b = wg[c * 32 + 2 * o + kk];
                            acc += p_widen(xg[4 * c + kk]) * (float)(128 + (b & 15));
                            acc += p_widen(xg[4 * c + 2 + kk]) * (float)(128 + (b >> 4));
                        }
                    const uint16_t *sz = (const uint16_t *)(wg + CHUNKS * 32);
                    float scale = p_widen(sz[o]), zero = p_widen(sz[TILE + o]);
                    tot = fmaf(acc, scale, tot);
                    tot = fmaf(fmaf(-136.0f, scale, zero), sums[m * groups + g], tot);
                }
                out[m * n + t * TILE + o] = p_round(tot);
            }
}

static void run_tiles(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n, const float *sums,
                      uint16_t *out, int64_t t0, int64_t t1, int amx) {
    if (amx == 2) {
        portable_tiles(x, rows, k, w, n, sums, out, t0, t1);
        return;
    }
    if (amx) {
        for (int64_t m0 = 0; m0 < rows; m0 += 16)
            amx_rows(x, m0, rows - m0 < 16 ? rows - m0 : 16, k, w, n, sums, out, t0, t1);
        return;
    }
    for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
        int64_t r = rows - m0 < ROWS ? rows - m0 : ROWS;
        BLOCKS[r](x, m0, k, w, n, sums, out, t0, t1);
    }
}

/* out [rows, n] = x [rows, k] @ w^T. amx: 1 the tile unit's path (after kvrag_int4_amx_init), 2 the portable one,
 * 0 VDPBF16PS.
 * threads > 1 splits the output tiles between that many OpenMP threads (the runtime torch loaded, when built with
 * -fopenmp): each output is computed the same way whatever the split. Returns 0, or -1 when out of memory. */
int kvrag_int4_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n, uint16_t *out, int amx,
                  int threads) {
    float stack_sums[16 * 64];
    float *sums = rows * (k / GROUP) <= 16 * 64 ? stack_sums : malloc(sizeof(float) * rows * (k / GROUP));
    if (!sums) return -1;
    if (amx == 2) portable_sums(x, rows, k, sums);
    else group_sums(x, rows, k, sums);
    int64_t tiles = n / TILE;
#ifdef _OPENMP
    if (threads > 1 && tiles >= 6 * threads) {
#pragma omp parallel num_threads(threads)
        {
            int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
            int64_t per = (tiles + nt - 1) / nt;
            per = (per + 2) / 3 * 3; /* whole groups of three tiles (the AMX path's step) */
            int64_t a = id * per, b = a + per < tiles ? a + per : tiles;
            if (a < b) run_tiles(x, rows, k, w, n, sums, out, a, b, amx);
        }
    } else
#else
    (void)threads;
#endif
        run_tiles(x, rows, k, w, n, sums, out, 0, tiles, amx);
    if (sums != stack_sums) free(sums);
    return 0;
}

/* float32 rows in, float32 out, for a float32 model: the rows rounded to bfloat16 as torch's vectorized conversion
 * rounds them (to nearest even by integer arithmetic; NaN -> 0xFFFF), kvrag_int4_mm, its bfloat16 outputs widened
 * -- the same bits as converting around kvrag_int4_mm in torch, without two tensor operations per product. The
 * counts converted are multiples of 16 (k is one of 32, n one of 16). */
TARGET static void to_bf16(const float *src, int64_t count, uint16_t *dst) {
    const __m512i ones = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0xFFFF);
    for (int64_t i = 0; i + 16 <= count; i += 16) {
        __m512 f = _mm512_loadu_ps(src + i);
        __m512i v = _mm512_castps_si512(f);
        __m512i t = _mm512_add_epi32(_mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 16), ones), bias), v);
        t = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_ORD_Q), nan, _mm512_srli_epi32(t, 16));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtusepi32_epi16(t));
    }
}

TARGET static void to_f32(const uint16_t *src, int64_t count, float *dst) {
    for (int64_t i = 0; i + 16 <= count; i += 16) _mm512_storeu_ps(dst + i, bf16x16_to_f32(src + i));
}

int kvrag_int4_mm_f32(const float *xf, int64_t rows, int64_t k, const uint8_t *w, int64_t n, float *outf, int amx,
                      int threads) {
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)(rows * k + rows * n));
    if (!x) return -1;
    uint16_t *out = x + rows * k;
    if (amx == 2)
        for (int64_t i = 0; i < rows * k; i++) x[i] = p_round(xf[i]);
    else
        to_bf16(xf, rows * k, x);
    int rc = kvrag_int4_mm(x, rows, k, w, n, out, amx, threads);
    if (rc == 0 && amx == 2)
        for (int64_t i = 0; i < rows * n; i++) outf[i] = p_widen(out[i]);
    else if (rc == 0)
        to_f32(out, rows * n, outf);
    free(x);
    return rc;
}

int kvrag_int4_abi(void) { return 6; }
