// Paged attention for CPUs over an fp32, bf16 or 8-bit (int8, fp8 e4m3; a scale per KV head) cache, with fp32
// sums: decode (one query per sequence) and, further down, prompt chunks. Keys and values are read in place
// through the block table (no gathered copy), each KV head once for its whole query group (GQA).
//
// Why not torch: a decode step's attention is dozens of tiny batched matmuls whose per-call and per-batch
// overhead dwarfs the arithmetic (measured: ~1.6 ms per layer at 32 sequences of 131 tokens, against
// ~0.1 ms of memory traffic). Here one OpenMP task per sequence (or per part of its tokens, when the
// sequences are few) computes the scores of all its queries, a softmax, and the weighted sums of values.
// Scores go 16 tokens at a time: on the AMX tile unit where queries are exact in bf16 and the cache holds
// bf16 or 8-bit codes, else each token's lanes summed by one shuffle tree for all 16 (sum16), with the bf16
// dot product where keys and queries are bf16; values with AVX-512 along the head dimension.
#ifdef __AVX512F__  // cpu_attention_avx2.c otherwise
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "slimlm_kernels.h"

#define MAX_HEADS 128  // query heads
#define MAX_DIM 256
#define MAX_PARTS 16   // parts a sequence splits into at most
#define PART 256       // a sequence splits into ceil(L / PART) equal parts, at most MAX_PARTS (parts of 64
                      // tokens made a decode step of 32 × 512 tokens 1.15× slower: more tasks and merges)

// What a cache holds: fp32, bf16, or 8-bit codes (int8, fp8 e4m3) with a scale per KV head
#define ELEM(kind) ((kind) == KIND_F32 ? 4 : (kind) == KIND_BF16 ? 2 : 1)  // bytes per value (not KIND_INT4)
// bytes of one KV head's vector in a token's row: a 4-bit cache's is D/2 bytes of codes, then fp16 step and
// minimum (formats/kv_int4.py: element d < D/2 in byte d's low nibble, element D/2 + d in its high nibble)
#define HEAD_BYTES(kind, D) ((kind) == KIND_INT4 ? (D) / 2 + 4 : (D) * ELEM(kind))

// The 128 fp8 e4m3 magnitudes as bf16, exactly: m·2⁻⁹ for the subnormals, else the exponent and mantissa moved
// up 4 bits with 120 more exponent bias; the NaN code (never written) as 480, as load16 reads it.
static const uint16_t FP8_BF16[128] __attribute__((aligned(64))) = {
    0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60, 0x3C80, 0x3C90, 0x3CA0, 0x3CB0, 0x3CC0, 0x3CD0, 0x3CE0, 0x3CF0,
    0x3D00, 0x3D10, 0x3D20, 0x3D30, 0x3D40, 0x3D50, 0x3D60, 0x3D70, 0x3D80, 0x3D90, 0x3DA0, 0x3DB0, 0x3DC0, 0x3DD0, 0x3DE0, 0x3DF0,
    0x3E00, 0x3E10, 0x3E20, 0x3E30, 0x3E40, 0x3E50, 0x3E60, 0x3E70, 0x3E80, 0x3E90, 0x3EA0, 0x3EB0, 0x3EC0, 0x3ED0, 0x3EE0, 0x3EF0,
    0x3F00, 0x3F10, 0x3F20, 0x3F30, 0x3F40, 0x3F50, 0x3F60, 0x3F70, 0x3F80, 0x3F90, 0x3FA0, 0x3FB0, 0x3FC0, 0x3FD0, 0x3FE0, 0x3FF0,
    0x4000, 0x4010, 0x4020, 0x4030, 0x4040, 0x4050, 0x4060, 0x4070, 0x4080, 0x4090, 0x40A0, 0x40B0, 0x40C0, 0x40D0, 0x40E0, 0x40F0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4190, 0x41A0, 0x41B0, 0x41C0, 0x41D0, 0x41E0, 0x41F0,
    0x4200, 0x4210, 0x4220, 0x4230, 0x4240, 0x4250, 0x4260, 0x4270, 0x4280, 0x4290, 0x42A0, 0x42B0, 0x42C0, 0x42D0, 0x42E0, 0x42F0,
    0x4300, 0x4310, 0x4320, 0x4330, 0x4340, 0x4350, 0x4360, 0x4370, 0x4380, 0x4390, 0x43A0, 0x43B0, 0x43C0, 0x43D0, 0x43E0, 0x43F0,
};

// 32 fp8 e4m3 codes (x: one a 16-bit lane) as bf16, exactly: the magnitude's entry in FP8_BF16 (two 64-entry
// permutes, which read an index's low 6 bits only, and a select on bit 6: 7 instructions per 32 values, where
// the arithmetic took 10) and the sign bit moved up 8.
static inline __attribute__((always_inline)) __m512i fp8_bf16(__m512i x) {
    const __m512i t0 = _mm512_load_si512(FP8_BF16), t1 = _mm512_load_si512(FP8_BF16 + 32);
    const __m512i t2 = _mm512_load_si512(FP8_BF16 + 64), t3 = _mm512_load_si512(FP8_BF16 + 96);
    const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)),
                                              _mm512_permutex2var_epi16(t0, x, t1), _mm512_permutex2var_epi16(t2, x, t3));
    return _mm512_ternarylogic_epi32(_mm512_slli_epi16(x, 8), _mm512_set1_epi16((short)0x8000), v, 0xEA);  // (A & B) | C
}

// 16 cache values as fp32 (before any scale). bf16 is the top half of an fp32, so widening is a shift. An fp8
// e4m3 byte's exponent and mantissa, moved up by 20 bits, are a float's with 120 less exponent bias, so
// adding 120 to the exponent makes the value; the subnormals (exponent 0) are m·2⁻⁹. The NaN codes (0x7F,
// 0xFF) would read as ±480: a cache written by quantized_kv never holds them (it saturates at ±448). Not
// through FP8_BF16: with 16 values a call, the table's 32-lane permutes made an fp8 step slower (158.8 against
// 138.5 ms, kv_cache.py decode at batch 8, one run each).
static inline __attribute__((always_inline)) __m512 load16(const void *p, int kind) {
    if (kind == KIND_F32) return _mm512_loadu_ps(p);
    if (kind == KIND_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    if (kind == KIND_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const __m512i x = _mm512_cvtepu8_epi32(bytes), em = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
    const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 small = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.f / 512));
    const __m512 v = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)), normal, small);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// r[j] = Σ of a[j]'s 16 lanes, for 16 vectors at once: three rounds of pairwise shuffles and adds (45
// instructions where 16 separate horizontal sums take ~130).
static inline __m512 sum16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int k = 0; k < 8; k++)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of a[2k] = x, a[2k+1] = y
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int m = 0; m < 4; m++) {  // per 128-bit lane: that lane's sums of a[4m..4m+3]
        const __m512d x = _mm512_castps_pd(b[2 * m]), y = _mm512_castps_pd(b[2 * m + 1]);
        c[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // the four 128-bit lanes of each c[m] added: lane m of the result
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

// The lanes of q·k (q fp32, k the cache's; summed by the caller): one fused multiply-add per 16 values.
static inline __attribute__((always_inline)) __m512 dot_lanes(const float *q, const void *k, int64_t d, int kind) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16((const char *)k + i * ELEM(kind), kind), acc);
    return acc;
}

// A 4-bit row's 32 codes from 16 bytes: the low nibbles (elements i..i+15) and the high ones (D/2 + i..).
static inline __attribute__((always_inline)) void load_nibbles(const char *p, __m512 *lo, __m512 *hi) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4));
}

// The lanes of q·codes for a 4-bit row (q·x̂ = step·(q·codes) + lo·Σq: the caller applies step and lo).
static inline __attribute__((always_inline)) __m512 dot_lanes_int4(const float *q, const char *k, int64_t d) {
    __m512 acc = _mm512_setzero_ps(), lo, hi;
    for (int64_t i = 0; i < d / 2; i += 16) {
        load_nibbles(k + i, &lo, &hi);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), lo, acc);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d / 2 + i), hi, acc);
    }
    return acc;
}

// A 4-bit row's step and minimum (the fp16 pair after its D/2 code bytes).
static inline __attribute__((always_inline)) void row_meta(const char *row, int64_t d, float *step, float *lo) {
    uint16_t h[2];
    memcpy(h, row + d / 2, sizeof h);
    *step = _cvtsh_ss(h[0]), *lo = _cvtsh_ss(h[1]);
}

// The steps and minima of up to 16 rows (rows[j] + at), widened together: one conversion each for all 16
// (per row, two scalar conversions cost more than the row's codes did, measured at batch 8). Lanes past n: 0.
static inline __attribute__((always_inline)) void rows_meta(const char *const *rows, int64_t n, int64_t at,
                                                            int64_t d, __m512 *step, __m512 *lo) {
    uint16_t s[16] = {0}, m[16] = {0};
    for (int64_t j = 0; j < n; j++) memcpy(s + j, rows[j] + at + d / 2, 2), memcpy(m + j, rows[j] + at + d / 2 + 2, 2);
    *step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
    *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)m));
}

#ifdef __AVX512BF16__
static inline int bf16_exact(float x) {  // whether x converts to bf16 and back unchanged
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0xFFFF) == 0;
}

// The same for a bf16 cache and a query that is exactly bf16 (a bf16 model's): qp holds the query as bf16
// pairs, and the keys go into the bf16 dot product as they are stored, 32 values an instruction, products exact.
static inline __m512 dot_lanes_bf16(const __m512bh *qp, const uint16_t *k, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + i), qp[i / 32]);
    if (i < d)  // d is a multiple of 16: a last 16 values
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, k + i), qp[i / 32]);
    return acc;
}
#endif

// Where token t's K or V rows (all KV heads, side by side) lie in a cache, through the sequence's block table.
// This and the next always inlined: as plain inline functions gcc kept them out of the hot loops (1.2× slower).
static inline __attribute__((always_inline)) const char *token_row(const void *cache, const int32_t *table,
                                                                   int64_t t, int64_t block_size, int64_t row_bytes) {
    return (const char *)cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row_bytes;
}

// Asks for a row ahead of its use: the blocks lie anywhere in the pool, so the hardware prefetchers lose the
// stream at every block boundary.
static inline __attribute__((always_inline)) void prefetch_bytes(const char *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
}

// e^x for x <= 0, to float precision: 2^(x·log2 e) split into an integer power n, applied exactly with
// scalef, and a fraction f in [-0.5, 0.5] whose 2^f is Cephes' exp2f polynomial. Scalar expf here would
// cost more than all the rest of the kernel.
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));  // e^-100 is 0 in this sum anyway
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// r[i][j] = r[j][i] for 16 registers of 16 dwords
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++)
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);
    }
}

#ifdef __AVX512BF16__
// n 8-bit codes (n a multiple of 32) as bf16, exactly: int8 through fp32, fp8 by fp8_bf16
static inline __attribute__((always_inline)) void widen_bf16(const void *src, int64_t n, int kind, uint16_t *dst) {
    for (int64_t i = 0; i < n; i += 32) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)((const uint8_t *)src + i));
        if (kind == KIND_INT8) {
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
            _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        } else {
            _mm512_storeu_si512(dst + i, fp8_bf16(_mm512_cvtepu8_epi16(bytes)));
        }
    }
}

// The value sums (value_block, below) for an fp8 cache under a bf16 model (queries exact in bf16): two keys at
// a time through the bf16 dot product, their values widened to bf16 (exactly) and interleaved, their weights
// rounded to bf16 (as the tile unit's prompt path rounds them; such a model's output is bf16 anyway). Widening
// fp8 to bf16 does 32 values for what widening 16 to fp32 costs, and it bounds this loop (a W4 step with fp8 KV
// at 32 × 512 tokens: 66 -> 43 ms, measured). int8 widens to fp32 in two instructions: value_block stays faster.
static inline __attribute__((always_inline)) void value_pairs(const char *const *v, int64_t n, int64_t at,
                                                              const float *p, int64_t L, int64_t G, int64_t D,
                                                              int kind, float *o) {
    const __m512i lo = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006,
                                         0x270007, 0x280008, 0x290009, 0x2A000A, 0x2B000B, 0x2C000C, 0x2D000D,
                                         0x2E000E, 0x2F000F);  // words a0 b0 a1 b1 ...: two keys' value d
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    __m512 acc[G][D / 16];
    uint32_t w[G][8];  // each query's weights of keys 2k, 2k + 1 as a bf16 pair (zero past n)
    for (int64_t g = 0; g < G; g++) {
        for (int64_t i = 0; i < D / 16; i++) acc[g][i] = _mm512_loadu_ps(o + g * D + 16 * i);
        const __mmask16 valid = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        _mm256_storeu_si256((__m256i *)w[g], (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, p + g * L)));
    }
    uint16_t a[MAX_DIM], b[MAX_DIM];
    for (int64_t j = 0; j < n; j += 2) {
        widen_bf16(v[j] + at, D, kind, a);
        if (j + 1 < n) widen_bf16(v[j + 1] + at, D, kind, b);
        else memset(b, 0, sizeof(uint16_t) * D);  // not the slot past the end: it may hold a NaN
        __m512i pair[MAX_DIM / 16];
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const __m512i x = _mm512_loadu_si512(a + d0), y = _mm512_loadu_si512(b + d0);
            pair[d0 / 16] = _mm512_permutex2var_epi16(x, lo, y), pair[d0 / 16 + 1] = _mm512_permutex2var_epi16(x, hi, y);
        }
        for (int64_t g = 0; g < G; g++) {
            const __m512bh weights = (__m512bh)_mm512_set1_epi32((int)w[g][j / 2]);
            for (int64_t i = 0; i < D / 16; i++) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], (__m512bh)pair[i], weights);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < D / 16; i++) _mm512_storeu_ps(o + g * D + 16 * i, acc[g][i]);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
void configure_tiles(void);  // cpu_gemm.c: eight tiles of 16 rows × 64 bytes

// The scores of tokens [t0, t0 + L) (t0 a multiple of 16, as the block size is) on the tile unit, for queries
// that are exact in bf16 (q as fp32 [Hq, D]): 16 tokens at a time, Sᵀ [16 tokens][Hq] = Σ_h K_h · Q_hᵀ, where
// K_h's 16 rows are read in place (one block holds them, `row` bytes apart) and Q_hᵀ, the right operand, holds
// KV head h's G queries in their columns and zeros elsewhere. The same results as the bf16 dot products of
// attend (exact products, fp32 sums), for ~6 tile instructions per 16 tokens instead of ~900 vector ones.
// Written to scores [Hq, L] (scaled), with each query's largest in top. An 8-bit cache's 16 rows are widened
// to bf16 first (exactly), into kb. qb: scratch of Hkv·D·16 bf16, kb of 16·Hkv·D.
static inline __attribute__((always_inline)) void
amx_scores(const float *q, const void *k_cache, int kind, const float *k_scale, const int32_t *table, int64_t t0,
           int64_t L, int64_t Hq, int64_t G, int64_t D, int64_t Hkv, int64_t block_size, float scale, float *scores,
           float *top, uint16_t *qb, uint16_t *kb) {
    const int64_t row = Hkv * D * ELEM(kind), stride = kind == KIND_BF16 ? row : Hkv * D * 2;
    memset(qb, 0, sizeof(uint16_t) * Hkv * D * 16);
    for (int64_t g = 0; g < Hq; g++)  // row p of block d0 of head h: dimensions d0 + 2p, d0 + 2p + 1 per column
        for (int64_t d = 0; d < D; d++) {
            uint32_t u;
            memcpy(&u, q + g * D + d, sizeof u);
            qb[g / G * D * 16 + d / 32 * 512 + d % 32 / 2 * 32 + 2 * g + d % 2] = (uint16_t)(u >> 16);
        }
    float st[16 * 16] __attribute__((aligned(64)));
    configure_tiles();
    for (int64_t c = 0; c < L; c += 16) {
        const int64_t n = L - c < 16 ? L - c : 16;
        const char *k = token_row(k_cache, table, t0 + c, block_size, row);
        if (c + 16 < L)
            prefetch_bytes(token_row(k_cache, table, t0 + c + 16, block_size, row), (L - c - 16 < 16 ? L - c - 16 : 16) * row);
        if (kind != KIND_BF16) {  // rows past n stay as they were: their scores are masked out
            for (int64_t j = 0; j < n; j++) widen_bf16(k + j * row, Hkv * D, kind, kb + j * Hkv * D);
            k = (const char *)kb;
        }
        _tile_zero(0);
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t d0 = 0; d0 < D; d0 += 32) {
                _tile_loadd(1, k + (h * D + d0) * 2, stride);
                _tile_loadd(2, qb + h * D * 16 + d0 * 16, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
        _tile_stored(0, st, 64);
        __m512i r[16];  // rows past n hold whatever the block's later slots do: masked out below
        for (int64_t t = 0; t < 16; t++) r[t] = _mm512_load_si512(st + 16 * t);
        transpose16(r);  // r[g]: query g's 16 scores
        const __mmask16 valid = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        for (int64_t g = 0; g < Hq; g++) {
            const __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(r[g]), _mm512_set1_ps(k_scale ? scale * k_scale[g / G] : scale));
            _mm512_mask_storeu_ps(scores + g * L + c, valid, x);
            top[g] = fmaxf(top[g], _mm512_mask_reduce_max_ps(valid, x));
        }
    }
    _tile_release();
}
#endif

// o [G, D] += Σ_j p[g·L + j] · V_j for one KV head's G queries over n tokens (rows v[j], the head at byte `at`):
// the sums held in registers across the tokens when G and D are literals (a runtime-sized array of them stays
// in memory: a load and a store around every multiply-add, measured 2× slower with an fp8 cache).
static inline __attribute__((always_inline)) void value_block(const char *const *v, int64_t n, int64_t at,
                                                              const float *p, int64_t L, int64_t G, int64_t D,
                                                              int kind, float *o) {
    __m512 acc[G][D / 16];
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < D / 16; i++) acc[g][i] = _mm512_loadu_ps(o + g * D + 16 * i);
    float shift[G];  // a 4-bit cache: Σ_j p·lo_j, the part of Σ p·x̂ every element shares (x̂ = step·code + lo)
    float steps[16] __attribute__((aligned(64))), los[16] __attribute__((aligned(64)));
    for (int64_t g = 0; g < G; g++) shift[g] = 0.f;
    if (kind == KIND_INT4) {
        __m512 st, lo;
        rows_meta(v, n, at, D, &st, &lo);
        _mm512_store_ps(steps, st), _mm512_store_ps(los, lo);
    }
    for (int64_t j = 0; j < n; j++) {
        __m512 vr[MAX_DIM / 16];  // the head's values, widened once for its G queries
        float step = 1.f, lo = 0.f;
        if (kind == KIND_INT4) {
            for (int64_t i = 0; i < D / 32; i++) load_nibbles(v[j] + at + 16 * i, &vr[i], &vr[D / 32 + i]);
            step = steps[j], lo = los[j];
        } else {
            for (int64_t i = 0; i < D / 16; i++) vr[i] = load16(v[j] + at + 16 * i * ELEM(kind), kind);
        }
        for (int64_t g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(p[g * L + j] * step);
            for (int64_t i = 0; i < D / 16; i++) acc[g][i] = _mm512_fmadd_ps(w, vr[i], acc[g][i]);
            if (kind == KIND_INT4) shift[g] += p[g * L + j] * lo;
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < D / 16; i++)
            _mm512_storeu_ps(o + g * D + 16 * i,
                             kind == KIND_INT4 ? _mm512_add_ps(acc[g][i], _mm512_set1_ps(shift[g])) : acc[g][i]);
}

// Tokens [t0, t1) of one sequence, all KV heads, for its Hq queries (q [Hq, D]): each query's scores (into
// scores, Hq·(t1 − t0) floats), softmax and weighted sum of values. With part == NULL the sums are divided
// through into out [Hq, D]; otherwise out gets them undivided, part[g] the largest score of query g and
// part[Hq + g] the sum of e^(score − largest), so that the parts of a sequence merge (merge_parts).
// Token-major: a token's rows of all KV heads lie side by side in the cache and are read as one run (1.2–1.4×
// over a pass per head, measured). Always inlined with a literal D where the caller can (64, 128): the dot
// products and the value rows then unroll into registers (1.3× on the scores, measured).
static inline __attribute__((always_inline)) void
attend(const float *q, const void *k_cache, const void *v_cache, int kind, const float *k_scale, const float *v_scale,
       const int32_t *table, int64_t t0, int64_t t1, int64_t Hq, int64_t G, int64_t D, int64_t Hkv, int64_t block_size,
       float scale, float *scores, float *out, float *part, int amx, uint16_t *qb, uint16_t *kb) {
    const int64_t head = HEAD_BYTES(kind, D), row = Hkv * head, L = t1 - t0;
    float top[MAX_HEADS], total[MAX_HEADS], qsum[MAX_HEADS];
    for (int64_t g = 0; kind == KIND_INT4 && g < Hq; g++) {  // Σq: a 4-bit key's minimum times it
        qsum[g] = 0.f;
        for (int64_t d = 0; d < D; d++) qsum[g] += q[g * D + d];
    }
    for (int64_t g = 0; g < Hq; g++) top[g] = -INFINITY;
    int exact = 0;  // whether the queries are exact in bf16 (a bf16 model's), with a cache that bf16 holds exactly
#ifdef __AVX512BF16__
    __m512bh qp[Hq][(D + 31) / 32];  // the queries as bf16, in order, when that is exact
    exact = kind != KIND_F32 && kind != KIND_INT4;
    for (int64_t i = 0; exact && i < Hq * D; i++) exact = bf16_exact(q[i]);
    for (int64_t g = 0; exact && g < Hq; g++)
        for (int64_t i = 0; i < D; i += 32) {
            const float *x = q + g * D + i;
            const __m512 hi = D - i >= 32 ? _mm512_loadu_ps(x + 16) : _mm512_setzero_ps();
            qp[g][i / 32] = _mm512_cvtne2ps_pbh(hi, _mm512_loadu_ps(x));
        }
#endif
    // scores 16 tokens at a time: on the tile unit, or their keys' lanes, then one sum16 per query
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx && exact)
        amx_scores(q, k_cache, kind, k_scale, table, t0, L, Hq, G, D, Hkv, block_size, scale, scores, top, qb, kb);
#endif
    for (int64_t c = 0; c < L && !(amx && exact); c += 16) {
        const int64_t n = L - c < 16 ? L - c : 16;
        const char *k[16];
        for (int64_t j = 0; j < n; j++) {
            k[j] = token_row(k_cache, table, t0 + c + j, block_size, row);
            if (c + j + 16 < L) prefetch_bytes(token_row(k_cache, table, t0 + c + j + 16, block_size, row), row);
        }
        const __mmask16 valid = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        __m512 kstep = _mm512_setzero_ps(), klo = _mm512_setzero_ps();  // a 4-bit head's 16 steps and minima
        for (int64_t g = 0; g < Hq; g++) {
            const int64_t at = g / G * head;  // the query's KV head within a row
            __m512 lanes[16];
            if (kind == KIND_INT4) {  // scores = step·(q·codes) + lo·Σq, a token's step and lo to its lane
                if (g % G == 0) rows_meta(k, n, at, D, &kstep, &klo);  // once per KV head and 16 tokens
                for (int64_t j = 0; j < n; j++) lanes[j] = dot_lanes_int4(q + g * D, k[j] + at, D);
                for (int64_t j = n; j < 16; j++) lanes[j] = _mm512_setzero_ps();
                const __m512 dots = _mm512_fmadd_ps(kstep, sum16(lanes), _mm512_mul_ps(klo, _mm512_set1_ps(qsum[g])));
                const __m512 x = _mm512_mul_ps(dots, _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(scores + g * L + c, valid, x);
                top[g] = fmaxf(top[g], _mm512_mask_reduce_max_ps(valid, x));
                continue;
            }
            for (int64_t j = 0; j < 16; j++) {
#ifdef __AVX512BF16__
                if (exact && kind == KIND_BF16) {
                    lanes[j] = j < n ? dot_lanes_bf16(qp[g], (const uint16_t *)(k[j] + at), D) : _mm512_setzero_ps();
                    continue;
                }
#endif
                lanes[j] = j < n ? dot_lanes(q + g * D, k[j] + at, D, kind) : _mm512_setzero_ps();
            }
            const __m512 x = _mm512_mul_ps(sum16(lanes), _mm512_set1_ps(k_scale ? scale * k_scale[g / G] : scale));
            _mm512_mask_storeu_ps(scores + g * L + c, valid, x);
            top[g] = fmaxf(top[g], _mm512_mask_reduce_max_ps(valid, x));
        }
    }
    for (int64_t g = 0; g < Hq; g++) {
        float *r = scores + g * L;
        const __m512 shift = _mm512_set1_ps(top[g]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < L; t += 16) {
            const __mmask16 m = L - t >= 16 ? 0xFFFF : (__mmask16)((1u << (L - t)) - 1);
            const __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, r + t), shift));
            _mm512_mask_storeu_ps(r + t, m, p);
            sum = _mm512_mask_add_ps(sum, m, sum, p);
        }
        total[g] = _mm512_reduce_add_ps(sum);
    }
    // the value sums, 16 tokens at a time, into out (fp32 [Hq, D]), one KV head's G queries at a time
    for (int64_t i = 0; i < Hq * D; i++) out[i] = 0.f;
    for (int64_t c = 0; c < L; c += 16) {
        const int64_t n = L - c < 16 ? L - c : 16;
        const char *v[16];
        for (int64_t j = 0; j < n; j++) {
            v[j] = token_row(v_cache, table, t0 + c + j, block_size, row);
            if (c + j + 16 < L) prefetch_bytes(token_row(v_cache, table, t0 + c + j + 16, block_size, row), row);
        }
        for (int64_t h = 0; h < Hkv; h++) {
#ifdef __AVX512BF16__
#define VALUES(GROUP)                                                                                            \
    (exact && kind == KIND_FP8 ? value_pairs : value_block)(v, n, h * head, scores + h * G * L + c, L, GROUP, D,      \
                                                             kind, out + h * G * D)
#else
#define VALUES(GROUP) value_block(v, n, h * head, scores + h * G * L + c, L, GROUP, D, kind, out + h * G * D)
#endif
            switch (G) {  // literal group sizes: the sums stay in registers
                case 1: VALUES(1); break;
                case 2: VALUES(2); break;
                case 3: VALUES(3); break;
                case 4: VALUES(4); break;
                default: VALUES(G);
            }
#undef VALUES
        }
    }
    for (int64_t g = 0; g < Hq; g++) {
        // an 8-bit cache's scales: on the scores (q·(s·k) = s·(q·k)) and on the sums (Σ p·(s·v) = s·Σ p·v)
        const float unit = v_scale ? v_scale[g / G] : 1.f;
        const __m512 inv = _mm512_set1_ps(part ? unit : unit / total[g]);
        for (int64_t i = 0; i < D; i += 16) _mm512_storeu_ps(out + g * D + i, _mm512_mul_ps(_mm512_loadu_ps(out + g * D + i), inv));
    }
    if (part) memcpy(part, top, sizeof(float) * Hq), memcpy(part + Hq, total, sizeof(float) * Hq);
}

// One sequence's parts (undivided sums sums [parts, Hq, D], stats [parts, 2·Hq] as attend writes them) into
// out [Hq, D]: each part's sums rescaled by e^(its largest score − the largest of all).
static void merge_parts(const float *sums, const float *stats, int64_t parts, int64_t Hq, int64_t D, float *out) {
    for (int64_t g = 0; g < Hq; g++) {
        float top = -INFINITY, total = 0.f, weight[MAX_PARTS];
        for (int64_t p = 0; p < parts; p++) top = fmaxf(top, stats[p * 2 * Hq + g]);
        for (int64_t p = 0; p < parts; p++) {
            weight[p] = expf(stats[p * 2 * Hq + g] - top);
            total += weight[p] * stats[p * 2 * Hq + Hq + g];
        }
        for (int64_t i = 0; i < D; i += 16) {
            __m512 o = _mm512_setzero_ps();
            for (int64_t p = 0; p < parts; p++)
                o = _mm512_fmadd_ps(_mm512_set1_ps(weight[p]), _mm512_loadu_ps(sums + (p * Hq + g) * D + i), o);
            _mm512_storeu_ps(out + g * D + i, _mm512_div_ps(o, _mm512_set1_ps(total)));
        }
    }
}

// The parts a sequence of L tokens splits into (slimlm_paged_decode says why it depends on L alone)
static inline int64_t parts_of(int64_t L) {
    const int64_t parts = (L + PART - 1) / PART;
    return parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
}

// q, out [S, Hq, D] fp32; caches [blocks, block_size, Hkv, D] of `kind` (KIND_*), with k_scale, v_scale [Hkv]
// (NULL: 1) for 8-bit codes, or 4-bit rows [blocks, block_size, Hkv, D/2 + 4] (D a multiple of 32; q and out
// in the rows' rotated space: the caller rotates); tables [S, width]. D a multiple of 16, <= MAX_DIM; Hq <= MAX_HEADS. Returns 0, or
// -1 when out of memory.
// A task is one part of one sequence, all its KV heads: a sequence longer than PART tokens splits into parts
// of its tokens (as flash-decoding does; a multiple of 16 tokens each), merged after, so that one long sequence
// runs on every thread. How many parts is a function of the sequence's length alone (parts_of), never of the
// other sequences in the step or of the threads: a query's sums run in the same order however it is batched.
// With amx set (the caller has the tile unit: slimlm_amx_ready), a bf16 cache, queries exact in bf16, at most 16
// of them, D a multiple of 32 and blocks of a multiple of 16 tokens, the scores go through the tile unit.
int slimlm_paged_decode(const float *q, const void *k_cache, const void *v_cache, int kind, const float *k_scale,
                        const float *v_scale, const int32_t *tables, int64_t width, const int32_t *seq_lens, int64_t S,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, float scale, int amx, float *out,
                        int nthreads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    amx = amx && kind != KIND_F32 && kind != KIND_INT4 && Hq <= 16 && D % 32 == 0 && block_size % 16 == 0;
#else
    amx = 0;
#endif
    int64_t *first = malloc(sizeof(int64_t) * (S + 1));  // sequence s's parts are tasks first[s] .. first[s + 1] - 1
    if (!first) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < S; s++) first[s + 1] = first[s] + parts_of(seq_lens[s]);
    const int64_t tasks = first[S];
    int64_t *seq_of = malloc(sizeof(int64_t) * tasks);
    float *sums = NULL, *stats = NULL;  // every task's, when some sequence splits (its parts write there)
    if (tasks > S)
        sums = malloc(sizeof(float) * tasks * Hq * D), stats = malloc(sizeof(float) * tasks * 2 * Hq);
    if (!seq_of || (tasks > S && (!sums || !stats))) return free(first), free(seq_of), free(sums), free(stats), -1;
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = first[s]; t < first[s + 1]; t++) seq_of[t] = s;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t s = seq_of[task], L = seq_lens[s], parts = first[s + 1] - first[s], p = task - first[s];
        const int64_t span = ((L + parts - 1) / parts + 15) / 16 * 16;
        const int64_t t0 = p * span < L ? p * span : L, t1 = t0 + span < L ? t0 + span : L;
        float *scores = malloc(sizeof(float) * Hq * span + (amx ? sizeof(uint16_t) * Hkv * D * 16 * 2 : 0));
        if (!scores) {
            failed = 1;
            continue;
        }
        float *o = parts > 1 ? sums + task * Hq * D : out + s * Hq * D, *part = parts > 1 ? stats + task * 2 * Hq : NULL;
        // literal kinds and head sizes: each combination compiles to its own loops
#define ATTEND(KIND, DIM) attend(q + s * Hq * D, k_cache, v_cache, KIND, k_scale, v_scale, tables + s * width, t0, t1, \
                                 Hq, Hq / Hkv, DIM, Hkv, block_size, scale, scores, o, part, amx,                 \
                                 (uint16_t *)(scores + Hq * span), (uint16_t *)(scores + Hq * span) + Hkv * D * 16)
#define ATTEND_D(KIND)                                   \
    switch (D) {                                         \
        case 64: ATTEND(KIND, 64); break;                \
        case 128: ATTEND(KIND, 128); break;              \
        default: ATTEND(KIND, D);                        \
    }
        switch (kind) {
            case KIND_F32: ATTEND_D(KIND_F32) break;
            case KIND_BF16: ATTEND_D(KIND_BF16) break;
            case KIND_INT8: ATTEND_D(KIND_INT8) break;
            case KIND_INT4: ATTEND_D(KIND_INT4) break;
            default: ATTEND_D(KIND_FP8)
        }
#undef ATTEND_D
#undef ATTEND
        free(scores);
    }
    for (int64_t s = 0; !failed && s < S; s++)
        if (first[s + 1] - first[s] > 1)
            merge_parts(sums + first[s] * Hq * D, stats + first[s] * 2 * Hq, first[s + 1] - first[s], Hq, D,
                        out + s * Hq * D);
    free(first), free(seq_of), free(sums), free(stats);
    return failed ? -1 : 0;
}

// ---- Prompt chunks: flash attention over the paged cache ----
// A task is one sequence's tile of up to 16 consecutive queries and one KV head, for the G query heads that
// read it. Each query head's tile is held transposed (Qt [D][16]: one vector per dimension, a lane per query),
// so that scores, their softmax and the value sums all run 16 queries to a vector with no horizontal sums:
// for a key, 16 scores are D fused multiply-adds of Qt[d] by the key's d-th value broadcast. Keys and values
// go 16 tokens at a time, widened once to fp32 for the G heads, with the running maximum and exp-sum of
// flash attention, so no score row is ever stored. 2.3-6x the PyTorch path it replaced (batched matmuls and a
// masked softmax, one sequence at a time) on a 2-core Xeon: benchmarks/prompt_attention.py; with bf16 queries
// the tile unit takes the products (further down), 2.1-2.4x these loops.
#define TILE 16
#define AMX_CHUNK 32  // keys a chunk on the tile unit

// tokens [c, c + 16) of KV head h as fp32 rows [16][D]; tokens at or past `end` are zeros (their slots may
// hold anything: a NaN there times a zero weight would still be NaN). A 4-bit row decodes to code·step + lo.
static inline __attribute__((always_inline)) void widen_chunk(const void *cache, const int32_t *table, int64_t c,
                                                              int64_t end, int64_t h, int64_t D, int64_t Hkv,
                                                              int64_t block_size, int kind, float *dst) {
    const int64_t head = HEAD_BYTES(kind, D), row = Hkv * head;
    for (int64_t j = 0; j < TILE; j++) {
        const char *src = c + j < end ? token_row(cache, table, c + j, block_size, row) + h * head : NULL;
        if (kind == KIND_INT4 && src) {
            float step, lo;
            __m512 a, b;
            row_meta(src, D, &step, &lo);
            for (int64_t i = 0; i < D / 2; i += 16) {
                load_nibbles(src + i, &a, &b);
                _mm512_storeu_ps(dst + j * D + i, _mm512_fmadd_ps(a, _mm512_set1_ps(step), _mm512_set1_ps(lo)));
                _mm512_storeu_ps(dst + j * D + D / 2 + i, _mm512_fmadd_ps(b, _mm512_set1_ps(step), _mm512_set1_ps(lo)));
            }
            continue;
        }
        for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(dst + j * D + i, src ? load16(src + i * ELEM(kind), kind) : _mm512_setzero_ps());
    }
}

// The online softmax of one query head's tile over a chunk of N keys at c (s[j]: the scores of key c + j, a
// lane per query): the running maximum m and exp-sum l of each lane updated, s[j] replaced by its weights
// e^(s − m) (zero where the key does not count), and the factor by which earlier sums shrink returned.
// pos: each lane's query position; a key at position c + j counts for lanes at or past it, below `end`.
static inline __attribute__((always_inline)) __m512 softmax_chunk(__m512 *s, int64_t N, __m512i pos, int64_t c,
                                                                  int64_t end, __m512 *m, __m512 *l) {
    __mmask16 seen[2 * TILE];
    __m512 top = *m;
    for (int64_t j = 0; j < N; j++) {
        seen[j] = c + j < end ? _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32((int)(c + j))) : 0;
        top = _mm512_mask_max_ps(top, seen[j], top, s[j]);
    }
    const __m512 rescale = exp512(_mm512_sub_ps(*m, top));
    __m512 sum = _mm512_mul_ps(*l, rescale);
    for (int64_t j = 0; j < N; j++) {
        s[j] = _mm512_maskz_mov_ps(seen[j], exp512(_mm512_sub_ps(s[j], top)));
        sum = _mm512_add_ps(sum, s[j]);
    }
    *m = top, *l = sum;
    return rescale;
}

// One query head's tile against one chunk of 16 keys and values (kc, vc [16][D] fp32): the scores, their
// softmax, and the transposed sums ot [D][16] rescaled and added to.
static inline __attribute__((always_inline)) void
flash_chunk(const float *qt, const float *kc, const float *vc, int64_t D, __m512i pos, int64_t c, int64_t end,
            __m512 *m, __m512 *l, float *ot) {
    __m512 s[TILE];
    for (int64_t j = 0; j < TILE; j++) s[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 4)  // four dimensions a round: 16 chains of fused adds, one per key
        for (int64_t e = d; e < d + 4; e++) {
            const __m512 q = _mm512_loadu_ps(qt + e * TILE);
            for (int64_t j = 0; j < TILE; j++) s[j] = _mm512_fmadd_ps(q, _mm512_set1_ps(kc[j * D + e]), s[j]);
        }
    const __m512 rescale = softmax_chunk(s, TILE, pos, c, end, m, l);
    for (int64_t d = 0; d < D; d += 8) {  // eight dimensions a round: eight chains, so the adds overlap
        __m512 o[8];
        for (int64_t i = 0; i < 8; i++) o[i] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + i) * TILE), rescale);
        for (int64_t j = 0; j < TILE; j++)
            for (int64_t i = 0; i < 8; i++) o[i] = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vc[j * D + d + i]), o[i]);
        for (int64_t i = 0; i < 8; i++) _mm512_storeu_ps(ot + (d + i) * TILE, o[i]);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- The same on the AMX tile unit, for a bf16 cache and bf16 queries: chunks of 32 keys ----
// Scores transposed, Sᵀ [32 keys][16 queries] = K · Qᵀ: K's rows are the tile unit's left operand as stored
// (copied out of the blocks), and Qᵀ is laid out once per task as its right operand (rows of dimension pairs).
// The weights P then stay transposed, a lane per query, for the same softmax as above; the value sums, also
// transposed, are Oᵀ [D][16] += Vᵀ · Pᵀ, where Pᵀ's dimension pairs are two keys' weight vectors interleaved,
// and Vᵀ (the chunk's values transposed, once for the G query heads) is the left operand. The weights are
// rounded to bf16 for the tile unit, as flash attention on GPUs rounds them; sums stay fp32.

void configure_tiles(void);  // cpu_gemm.c: eight tiles of 16 rows × 64 bytes

// Keys [c, c + 32) of KV head h: kb [32][D] as bf16, and the values transposed into vt [D][32]; keys at or
// past `end` are zeros. An 8-bit cache's rows are widened to bf16 (exactly) first, its values into vw [32][D].
static inline __attribute__((always_inline)) void amx_load_chunk(const void *k_cache, const void *v_cache, int kind,
                                                                 const int32_t *table, int64_t c, int64_t end,
                                                                 int64_t h, int64_t D, int64_t Hkv,
                                                                 int64_t block_size, uint16_t *kb, uint16_t *vt,
                                                                 uint16_t *vw) {
    const int64_t elem = ELEM(kind), row = Hkv * D * elem;
    const uint16_t *vrow[AMX_CHUNK];  // each key's values as bf16; NULL past the end
    for (int64_t j = 0; j < AMX_CHUNK; j++) {
        const char *k = c + j < end ? token_row(k_cache, table, c + j, block_size, row) + h * D * elem : NULL;
        const char *v = c + j < end ? token_row(v_cache, table, c + j, block_size, row) + h * D * elem : NULL;
        if (!k) memset(kb + j * D, 0, D * 2), vrow[j] = NULL;
        else if (kind == KIND_BF16) memcpy(kb + j * D, k, D * 2), vrow[j] = (const uint16_t *)v;
        else widen_bf16(k, D, kind, kb + j * D), widen_bf16(v, D, kind, vw + j * D), vrow[j] = vw + j * D;
    }
    // dword (2p, d) pairs for the transposed values: keys 2p and 2p + 1 interleaved, 16 dimensions a register
    const __m512i lo = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006,
                                         0x270007, 0x280008, 0x290009, 0x2A000A, 0x2B000B, 0x2C000C, 0x2D000D,
                                         0x2E000E, 0x2F000F);  // words: a0 b0 a1 b1 ... (b = the second key)
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m512i pairs[2][16];  // [16 dimensions of d0's 32][key pair]
        for (int64_t p = 0; p < 16; p++) {
            __m512i v[2];
            for (int64_t i = 0; i < 2; i++) v[i] = vrow[2 * p + i] ? _mm512_loadu_si512(vrow[2 * p + i] + d0) : _mm512_setzero_si512();
            pairs[0][p] = _mm512_permutex2var_epi16(v[0], lo, v[1]);
            pairs[1][p] = _mm512_permutex2var_epi16(v[0], hi, v[1]);
        }
        for (int64_t half = 0; half < 2; half++) {
            transpose16(pairs[half]);  // now [dimension][key pair]
            for (int64_t i = 0; i < 16; i++) _mm512_storeu_si512(vt + (d0 + 16 * half + i) * AMX_CHUNK, pairs[half][i]);
        }
    }
}

// One query head's tile against the chunk in kb, vt: qb its Qᵀ as the right operand ([D/32][16][32] bf16).
// tmm0-1: the two halves of Sᵀ, then tmm0 a block of Oᵀ; tmm2-3: K, Vᵀ; tmm4: Qᵀ, then Pᵀ.
static inline __attribute__((always_inline)) void amx_flash_chunk(const uint16_t *qb, const uint16_t *kb,
                                                                  const uint16_t *vt, int64_t D, float scale,
                                                                  __m512i pos, int64_t c, int64_t end, __m512 *m,
                                                                  __m512 *l, float *ot, float *st, uint16_t *pb) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        _tile_loadd(4, qb + d0 * TILE, 64);
        _tile_loadd(2, kb + d0, 2 * D);
        _tile_loadd(3, kb + TILE * D + d0, 2 * D);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, st, 64);
    _tile_stored(1, st + TILE * TILE, 64);
    __m512 s[AMX_CHUNK];
    for (int64_t j = 0; j < AMX_CHUNK; j++) s[j] = _mm512_mul_ps(_mm512_loadu_ps(st + j * TILE), _mm512_set1_ps(scale));
    const __m512 rescale = softmax_chunk(s, AMX_CHUNK, pos, c, end, m, l);
    // Pᵀ as the right operand: row p holds keys 2p and 2p + 1 of every query lane, interleaved
    const __m512i interleave = _mm512_setr_epi32(0x100000, 0x110001, 0x120002, 0x130003, 0x140004, 0x150005,
                                                 0x160006, 0x170007, 0x180008, 0x190009, 0x1A000A, 0x1B000B,
                                                 0x1C000C, 0x1D000D, 0x1E000E, 0x1F000F);
    for (int64_t p = 0; p < TILE; p++)
        _mm512_storeu_si512(pb + p * 32, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * p + 1], s[2 * p])));
    if (_mm512_cmp_ps_mask(rescale, _mm512_set1_ps(1.f), _CMP_NEQ_UQ))  // a lane's maximum moved
        for (int64_t d = 0; d < D; d++) _mm512_storeu_ps(ot + d * TILE, _mm512_mul_ps(_mm512_loadu_ps(ot + d * TILE), rescale));
    _tile_loadd(4, pb, 64);
    for (int64_t d0 = 0; d0 < D; d0 += TILE) {
        _tile_loadd(0, ot + d0 * TILE, 64);
        _tile_loadd(3, vt + d0 * AMX_CHUNK, 64);
        _tile_dpbf16ps(0, 3, 4);
        _tile_stored(0, ot + d0 * TILE, 64);
    }
}

// Qᵀ of one query head's tile (rows [rows, D] bf16, `stride` elements apart) as the right operand: row p of
// block d0 holds dimensions d0 + 2p, d0 + 2p + 1 of each query (a dword per query: a transpose of the rows'
// dwords); lanes past `rows` zero.
static void amx_queries(const uint16_t *x, int64_t stride, int64_t rows, int64_t D, uint16_t *qb) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; i++) r[i] = i < rows ? _mm512_loadu_si512(x + i * stride + d0) : _mm512_setzero_si512();
        transpose16(r);
        for (int64_t p = 0; p < 16; p++) _mm512_storeu_si512(qb + (d0 / 2 + p) * 32, r[p]);
    }
}
#endif

// q, out [T, Hq, D] bf16 (bf16 = 1) or fp32; caches [blocks, block_size, Hkv, D] of `kind`, with k_scale,
// v_scale [Hkv] (NULL: 1) for 8-bit codes, or 4-bit rows (D a multiple of 32; q and out in their rotated space, as
// for decode); sequence s's queries are rows query_start[s] .. query_start[s + 1],
// the last of its seq_lens[s] cached tokens (causal). Sequences of at most skip_rows queries are skipped (the
// decode kernel takes them, a query at a time). D a multiple of 16, <= MAX_DIM; Hq / Hkv <= MAX_HEADS. With amx set (the
// caller has the tile unit: slimlm_amx_ready), bf16 queries, a cache bf16 holds exactly (not fp32) and D a
// multiple of 32, the chunks go through the tile unit. Returns 0, or -1 when out of memory.
int slimlm_paged_prefill(const void *q, const void *k_cache, const void *v_cache, int bf16, int kind,
                         const float *k_scale, const float *v_scale, const int32_t *tables, int64_t width,
                         const int32_t *seq_lens, const int32_t *query_start, int64_t S, int64_t Hq, int64_t Hkv,
                         int64_t D, int64_t block_size, float scale, int skip_rows, int amx, void *out,
                         int nthreads) {
    const int64_t G = Hq / Hkv, elem = bf16 ? 2 : 4;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    amx = amx && bf16 && kind != KIND_F32 && kind != KIND_INT4 && D % 32 == 0;
#else
    amx = 0;
#endif
    int64_t tasks = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t n = query_start[s + 1] - query_start[s];
        tasks += n > skip_rows ? (n + TILE - 1) / TILE * Hkv : 0;
    }
    int64_t *order = malloc(sizeof(int64_t) * 3 * (tasks ? tasks : 1));  // (s, tile, h) of each task
    if (!order) return -1;
    int64_t k = 0;
    for (int64_t s = 0; s < S; s++) {  // a sequence's last tiles first: they see the most keys
        const int64_t n = query_start[s + 1] - query_start[s];
        if (n <= skip_rows) continue;
        for (int64_t tile = (n + TILE - 1) / TILE - 1; tile >= 0; tile--)
            for (int64_t h = 0; h < Hkv; h++) order[k++] = s, order[k++] = tile, order[k++] = h;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t s = order[3 * task], tile = order[3 * task + 1], h = order[3 * task + 2];
        const int64_t n = query_start[s + 1] - query_start[s], L = seq_lens[s];
        const int64_t r0 = tile * TILE, rows = n - r0 < TILE ? n - r0 : TILE;
        const int64_t first = L - n + r0, end = first + rows;  // the tile's first query position; keys it sees
        const int32_t *table = tables + s * width;
        // fp32 Qᵀ, Oᵀ and the chunk's keys and values; or for the tile unit: bf16 Qᵀ, fp32 Oᵀ, the chunk's
        // keys and transposed values in bf16, the scores and the weights
        const int64_t floats = amx ? G * D * TILE + G * D * TILE / 2 + AMX_CHUNK * D * 3 / 2 + AMX_CHUNK * TILE * 3 / 2
                                   : 2 * G * D * TILE + 2 * TILE * D;
        float *buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        if (!buf) {
            failed = 1;
            continue;
        }
        float *ot = buf;
        memset(ot, 0, sizeof(float) * G * D * TILE);
        __m512 m[MAX_HEADS], l[MAX_HEADS];
        for (int64_t g = 0; g < G; g++) m[g] = _mm512_set1_ps(-INFINITY), l[g] = _mm512_setzero_ps();
        const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int)first),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        const char *q0 = (const char *)q + ((query_start[s] + r0) * Hq + h * G) * D * elem;  // head h·G, row r0
        const float scale_h = k_scale ? scale * k_scale[h] : scale;  // an 8-bit cache's scales, as in attend
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (amx) {
            uint16_t *qb = (uint16_t *)(ot + G * D * TILE), *kb = qb + G * D * TILE, *vt = kb + AMX_CHUNK * D;
            float *st = (float *)(vt + AMX_CHUNK * D);
            uint16_t *pb = (uint16_t *)(st + AMX_CHUNK * TILE), *vw = pb + AMX_CHUNK * TILE;
            for (int64_t g = 0; g < G; g++) amx_queries((const uint16_t *)q0 + g * D, Hq * D, rows, D, qb + g * D * TILE);
            configure_tiles();
            for (int64_t c = 0; c < end; c += AMX_CHUNK) {
                amx_load_chunk(k_cache, v_cache, kind, table, c, end, h, D, Hkv, block_size, kb, vt, vw);
                for (int64_t g = 0; g < G; g++)
                    amx_flash_chunk(qb + g * D * TILE, kb, vt, D, scale_h, pos, c, end, &m[g], &l[g],
                                    ot + g * D * TILE, st, pb);
            }
            _tile_release();
        }
#endif
        if (!amx) {
            float *qt = ot + G * D * TILE, *kc = qt + G * D * TILE, *vc = kc + TILE * D;
            memset(qt, 0, sizeof(float) * G * D * TILE);
            for (int64_t g = 0; g < G; g++)  // the queries transposed, scaled; lanes past the tile stay zero
                for (int64_t r = 0; r < rows; r++) {
                    const char *x = q0 + (r * Hq + g) * D * elem;
                    for (int64_t d = 0; d < D; d++) {
                        float v;
                        if (bf16) {
                            const uint32_t u = (uint32_t)((const uint16_t *)x)[d] << 16;
                            memcpy(&v, &u, sizeof v);
                        } else {
                            v = ((const float *)x)[d];
                        }
                        qt[(g * D + d) * TILE + r] = v * scale_h;
                    }
                }
            for (int64_t c = 0; c < end; c += TILE) {
                widen_chunk(k_cache, table, c, end, h, D, Hkv, block_size, kind, kc);
                widen_chunk(v_cache, table, c, end, h, D, Hkv, block_size, kind, vc);
                for (int64_t g = 0; g < G; g++) {
                    switch (D) {
                        case 64: flash_chunk(qt + g * D * TILE, kc, vc, 64, pos, c, end, &m[g], &l[g], ot + g * D * TILE); break;
                        default: flash_chunk(qt + g * D * TILE, kc, vc, D, pos, c, end, &m[g], &l[g], ot + g * D * TILE);
                    }
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {  // divided through, transposed back 16 dimensions at a time
            const float *o = ot + g * D * TILE;
            const __m512 inv = _mm512_div_ps(_mm512_set1_ps(v_scale ? v_scale[h] : 1.f), l[g]);
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                __m512i v[16];
                for (int64_t d = 0; d < 16; d++) v[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(o + (d0 + d) * TILE), inv));
                transpose16(v);  // v[r]: query r's dimensions d0..d0+15
                for (int64_t r = 0; r < rows; r++) {
                    char *y = (char *)out + ((query_start[s] + r0 + r) * Hq + h * G + g) * D * elem + d0 * elem;
                    if (bf16) {  // round to nearest even, as torch converts
                        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(v[r], 16), _mm512_set1_epi32(1));
                        const __m512i up = _mm512_add_epi32(v[r], _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
                        _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
                    } else {
                        _mm512_storeu_si512(y, v[r]);
                    }
                }
            }
        }
        free(buf);
    }
    free(order);
    return failed ? -1 : 0;
}

#endif
