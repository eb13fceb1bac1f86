// The quantized GEMM of cpu_gemm.c for CPUs with AVX2 and FMA but no AVX-512 (most AMD EPYC before Zen 4,
// many cloud x86 machines): same weight layout, same exported symbol, 8 lanes instead of 16.
//
// What differs and why: 16 vector registers instead of 32, so a register tile is one row of x across the 64
// output features of a block (8 accumulators) rather than four rows; and there is no fast bf16 matmul to
// hand large batches to (torch's bf16 matmul runs ~1 GFLOP/s on such CPUs), so the large-M path
// dequantizes slices to fp32 for torch's fp32 matmul (slimlm_dequantize).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>
#include "slimlm_kernels.h"

#define BN 64  // output features per block (packed.BLOCK_N)
#define MB 2   // rows of x per register tile: 2 × 8 accumulators, the most that stays in 16 registers

int slimlm_vector_bits(void) { return 256; }

// The 64 codes of one k-row of a block, as four runs of 16 in feature order.
static inline __attribute__((always_inline)) void codes_at(int bits, const uint8_t *c, __m128i parts[4]) {
    if (bits == 4) {
        // byte j: feature j in the low nibble, feature j + 32 in the high one
        const __m256i b = _mm256_loadu_si256((const __m256i *)c);
        const __m256i mask = _mm256_set1_epi8(0x0F);
        const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
        parts[0] = _mm256_castsi256_si128(lo);
        parts[1] = _mm256_extracti128_si256(lo, 1);
        parts[2] = _mm256_castsi256_si128(hi);
        parts[3] = _mm256_extracti128_si256(hi, 1);
    } else {
        for (int i = 0; i < 4; i++) parts[i] = _mm_loadu_si128((const __m128i *)(c + 16 * i));
    }
}

// Features 8i .. 8i+7 of that row as fp32: code·s − zero·s. One vector at a time, so that it is used at once
// and the accumulators keep the registers.
static inline __attribute__((always_inline)) __m256
weight_at(const __m128i parts[4], int i, const float *s, const float *zs) {
    const __m128i p = i % 2 ? _mm_srli_si128(parts[i / 2], 8) : parts[i / 2];
    const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p));
    return _mm256_fmsub_ps(code, _mm256_loadu_ps(s + 8 * i), _mm256_loadu_ps(zs + 8 * i));
}

// One group's scales and zero·scale as fp32, 64 of each (kept in L1, not registers).
static inline void group_params(const uint16_t *scales, const uint8_t *zeros, float s[BN], float zs[BN]) {
    for (int i = 0; i < BN; i += 8) {
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + i)));
        const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zeros + i))));
        _mm256_storeu_ps(s + i, sv);
        _mm256_storeu_ps(zs + i, _mm256_mul_ps(z, sv));
    }
}

// Per group, x·code is accumulated from the raw codes and the scale and zero point are applied once at the
// group's end: y += s·Σ x·code − s·zero·Σ x. That takes the multiply-subtract out of the inner loop, which
// is what bounds one row of x here (the weights stream at a fraction of memory bandwidth).
static inline __attribute__((always_inline)) void
tile(int bits, int rows, const float *x, int64_t K, int64_t group, const uint8_t *codes,
     const uint16_t *scales, const uint8_t *zeros, float *y, int64_t N) {
    const int64_t row_bytes = BN * bits / 8;
    __m256 acc[MB][8];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 8; i++) acc[r][i] = _mm256_setzero_ps();
    float s[BN], zs[BN];
    for (int64_t g = 0; g < K / group; g++) {
        group_params(scales + g * BN, zeros + g * BN, s, zs);
        __m256 part[MB][8];
        float xsum[MB];
        for (int r = 0; r < rows; r++) {
            xsum[r] = 0.f;
            for (int i = 0; i < 8; i++) part[r][i] = _mm256_setzero_ps();
        }
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
            __m128i parts[4];
            codes_at(bits, codes + k * row_bytes, parts);
            __m256 xb[MB];
            for (int r = 0; r < rows; r++) {
                xb[r] = _mm256_set1_ps(x[r * K + k]);
                xsum[r] += x[r * K + k];
            }
            for (int i = 0; i < 8; i++) {
                const __m128i p = i % 2 ? _mm_srli_si128(parts[i / 2], 8) : parts[i / 2];
                const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p));
                for (int r = 0; r < rows; r++) part[r][i] = _mm256_fmadd_ps(xb[r], code, part[r][i]);
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m256 xs = _mm256_set1_ps(xsum[r]);
            for (int i = 0; i < 8; i++) {
                acc[r][i] = _mm256_fmadd_ps(part[r][i], _mm256_loadu_ps(s + 8 * i), acc[r][i]);
                acc[r][i] = _mm256_fnmadd_ps(xs, _mm256_loadu_ps(zs + 8 * i), acc[r][i]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(y + r * N + 8 * i, acc[r][i]);
}

// Dense fp32 weights (packed.pack_dense: a block is [K][64] floats), so that an fp32 model's rows never go
// through torch's matmul, whose bits for a row depend on how many rows it multiplies. Each row's sums run over
// k in order, whatever rows share its tile.
static inline __attribute__((always_inline)) void
dense_tile(int rows, const float *x, int64_t K, const float *w, float *y, int64_t N) {
    __m256 acc[MB][8];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 8; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(w + (k + 8) * BN), _MM_HINT_T0);
        for (int r = 0; r < rows; r++) {
            const __m256 xb = _mm256_set1_ps(x[r * K + k]);
            for (int i = 0; i < 8; i++) acc[r][i] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w + k * BN + 8 * i), acc[r][i]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(y + r * N + 8 * i, acc[r][i]);
}

// ---- 4-bit weights times int8 activations (llama.cpp's way on AVX2: its Q4 × Q8 dot products) ----
//
// The fp32 loop above spends ~4 instructions per weight converting codes to floats, so one row of x runs at
// a fraction of memory bandwidth. Here x is quantized per run of XB inputs to int8 (x̂ = sx·q, |q| ≤ 127)
// and the codes multiply q as bytes: vpmaddubsw sums two code·q products into 16 bits, so 32 weights take one
// instruction. The result is exactly W·x̂ (W the dequantized weights), up to fp32 rounding.
//
// Four k-rows of a block are transposed in registers so that each 32-bit lane holds one feature's four codes
// (k..k+3): lane order within a register is features 4j..4j+3 (low 128 bits) and 16+4j..16+4j+3 (high), for
// j = 0..3, per half (features 0–31 from the low nibbles, 32–63 from the high ones).
#define XB 32  // inputs per activation scale: 8 steps of 4 rows, whose 16-bit sums stay below 2^15

// x [M, K] → q int8 [M, K], one scale per XB inputs and the scaled sum of each run's q (for the zero points).
// Runs are independent, so threads split a prompt's; a decode step's few rows take less time than waking the
// threads (a batch-1 step on Qwen2.5-1.5B: 8% slower with OMP_WAIT_POLICY=PASSIVE). Rounding is the scalar
// nearbyintf's (to even, MXCSR's default).
static void quantize_x(const float *x, int64_t M, int64_t K, int8_t *q, float *scale, float *qsum, int nthreads) {
    const __m256 sign = _mm256_set1_ps(-0.f);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= (1 << 16))
    for (int64_t b = 0; b < M * K / XB; b++) {
        const float *xb = x + b * XB;
        __m256 v[XB / 8], amax8 = _mm256_setzero_ps();
        for (int i = 0; i < XB / 8; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
        }
        float lanes[8], amax = 0.f;
        _mm256_storeu_ps(lanes, amax8);
        for (int i = 0; i < 8; i++) amax = fmaxf(amax, lanes[i]);
        const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256i sum = _mm256_setzero_si256();
        int32_t codes[XB];
        for (int i = 0; i < XB / 8; i++) {
            const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            sum = _mm256_add_epi32(sum, c);
            _mm256_storeu_si256((__m256i *)(codes + 8 * i), c);
        }
        int32_t sums[8], total = 0;
        _mm256_storeu_si256((__m256i *)sums, sum);
        for (int i = 0; i < 8; i++) total += sums[i];
        for (int i = 0; i < XB; i++) q[b * XB + i] = (int8_t)codes[i];
        scale[b] = s;
        qsum[b] = s * (float)total;
    }
}

static inline __attribute__((always_inline)) __m256 lanes_of(const float *v, int h, int j) {
    return _mm256_loadu2_m128(v + 32 * h + 16 + 4 * j, v + 32 * h + 4 * j);  // (high, low)
}

// The codes of inputs k..k+3 of a block (k-rows of BN/2 bytes from `codes`), half h, as the four registers
// whose 32-bit lanes each hold one feature's four codes.
static inline __attribute__((always_inline)) void transposed(const uint8_t *codes, int h, __m256i u[4]) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256i c[4];
    for (int i = 0; i < 4; i++) {
        c[i] = _mm256_loadu_si256((const __m256i *)(codes + i * (BN / 2)));
        c[i] = _mm256_and_si256(h ? _mm256_srli_epi16(c[i], 4) : c[i], mask);
    }
    const __m256i t0 = _mm256_unpacklo_epi8(c[0], c[1]), t1 = _mm256_unpackhi_epi8(c[0], c[1]);
    const __m256i t2 = _mm256_unpacklo_epi8(c[2], c[3]), t3 = _mm256_unpackhi_epi8(c[2], c[3]);
    u[0] = _mm256_unpacklo_epi16(t0, t2), u[1] = _mm256_unpackhi_epi16(t0, t2);
    u[2] = _mm256_unpacklo_epi16(t1, t3), u[3] = _mm256_unpackhi_epi16(t1, t3);
}

// R rows of x̂ against one 4-bit weight block: y[r][0..63] = Σ_k W[f, k]·x̂[r][k]. Each transposed group of
// codes is unpacked once and multiplied into every row (unpacking cost as much as the products: rows done one
// at a time made 5 rows 3.8× one). Every row goes through the same operations in the same order whatever R,
// so a row's result does not depend on the rows beside it. (8-bit codes stay with the fp32 loop: at one byte a
// weight it already reads at memory bandwidth, and vpmaddubsw would need them as two nibbles, which measured
// slower from two rows on.)
static inline __attribute__((always_inline)) void
tile_i8(const int R, const int8_t *q, const float *xs, const float *xsum, int64_t K, int64_t group,
        const uint8_t *codes, const uint16_t *scales, const uint8_t *zeros, float *y, int64_t N) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t runs = K / XB;  // x̂'s scales per row
    __m256 acc[2][8];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 8; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / group; g++) {
        float s[BN], zs[BN];
        group_params(scales + g * BN, zeros + g * BN, s, zs);
        __m256 part[2][8];
        float total[2] = {0.f, 0.f};  // Σ x̂ over the group, per row
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 8; i++) part[r][i] = _mm256_setzero_ps();
        for (int64_t b = g * group / XB; b < (g + 1) * group / XB; b++) {
            for (int r = 0; r < R; r++) total[r] += xsum[r * runs + b];
            for (int h = 0; h < 2; h++) {  // features 0–31 from the low nibbles, then 32–63 from the high ones
                __m256i sum16[2][4];
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < 4; j++) sum16[r][j] = _mm256_setzero_si256();
                for (int64_t k = b * XB; k < (b + 1) * XB; k += 4) {
                    __m256i u[4];
                    transposed(codes + k * (BN / 2), h, u);
                    for (int r = 0; r < R; r++) {
                        int32_t four;
                        __builtin_memcpy(&four, q + r * K + k, 4);
                        const __m256i xq = _mm256_set1_epi32(four);
                        for (int j = 0; j < 4; j++)
                            sum16[r][j] = _mm256_add_epi16(sum16[r][j], _mm256_maddubs_epi16(u[j], xq));
                    }
                }
                for (int r = 0; r < R; r++) {
                    const __m256 sx = _mm256_set1_ps(xs[r * runs + b]);
                    for (int j = 0; j < 4; j++) {
                        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[r][j], ones));
                        part[r][4 * h + j] = _mm256_fmadd_ps(dot, sx, part[r][4 * h + j]);
                    }
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 t = _mm256_set1_ps(total[r]);
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++) {
                    __m256 *a = &acc[r][4 * h + j];
                    *a = _mm256_fmadd_ps(part[r][4 * h + j], lanes_of(s, h, j), *a);
                    *a = _mm256_fnmadd_ps(t, lanes_of(zs, h, j), *a);
                }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++) {
                _mm_storeu_ps(y + r * N + 32 * h + 4 * j, _mm256_castps256_ps128(acc[r][4 * h + j]));
                _mm_storeu_ps(y + r * N + 32 * h + 16 + 4 * j, _mm256_extractf128_ps(acc[r][4 * h + j], 1));
            }
}

// ---- many rows: a block's codes transposed once per piece, then multiplied into every row ----
//
// tile_i8 transposes the codes for every pair of rows, which costs as much as the products; from PANEL_MIN_ROWS
// rows on, a piece of the block (up to PIECE inputs, 16 KB transposed: stays in L1) is transposed once into a
// buffer and every row tile reads it. The arithmetic is tile_i8's, operation for operation and in the same order
// (the same 16-bit sums, the same fp32 multiply-adds per run, then per group), so each row's result is
// bit-identical to the one tile_i8 gives it: the rows beside it and the loop chosen change nothing.
#define PIECE 256         // inputs transposed at a time (at most)
#define PANEL_ROWS 4      // rows per register tile, times PANEL_SUMS 16-bit sums: 8 registers, with 4 broadcasts
#define PANEL_SUMS 2      // (measured on Qwen2.5-1.5B's shapes: 3×4, 3×2 and 5×2 within 3% of this, all at 512 rows)
#define PANEL_MIN_ROWS 3  // from here on the panel loop (2 rows: tile_i8 1.15× faster; 3 rows 1.03–1.06× slower)

// R rows' 16-bit sums over the runs of inputs [k0, k0 + n), added into part [R][BN] (tile_i8's `part`
// registers, kept in memory so that a group may span pieces).
static inline __attribute__((always_inline)) void
panel_rows(const int R, const __m256i *u, const int8_t *q, const float *xs, int64_t K, int64_t k0, int64_t n,
           float *part) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = k0 / XB; b < (k0 + n) / XB; b++) {
        const __m256i *ub = u + (b * XB - k0) / 4 * 8;
        const int8_t *qb = q + b * XB;
        for (int hj = 0; hj < 8; hj += PANEL_SUMS) {  // PANEL_SUMS of the 8 registers of 4 features a pass
            __m256i sum16[PANEL_ROWS][PANEL_SUMS];
            for (int r = 0; r < R; r++)
                for (int j = 0; j < PANEL_SUMS; j++) sum16[r][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int i = 0; i < XB / 4; i++) {
                const __m256i *uk = ub + 8 * i + hj;
                __m256i xq[PANEL_ROWS];
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    __builtin_memcpy(&four, qb + r * K + 4 * i, 4);
                    xq[r] = _mm256_set1_epi32(four);
                }
                for (int j = 0; j < PANEL_SUMS; j++) {
                    const __m256i uj = _mm256_load_si256(uk + j);
                    for (int r = 0; r < R; r++) {
                        sum16[r][j] = _mm256_add_epi16(sum16[r][j], _mm256_maddubs_epi16(uj, xq[r]));
                        // keeps the sums in registers: gcc would otherwise reassociate the unrolled integer adds
                        // into a tree whose products spill to the stack
                        __asm__("" : "+x"(sum16[r][j]));
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256 sx = _mm256_set1_ps(xs[r * (K / XB) + b]);
                for (int j = 0; j < PANEL_SUMS; j++) {
                    float *p = part + r * BN + 8 * (hj + j);
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[r][j], ones));
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(dot, sx, _mm256_loadu_ps(p)));
                }
            }
        }
    }
}

// One block (codes, scales, zeros of block nb) against all M rows, into y's columns of that block.
static void panel_block(const int8_t *q, const float *xs, const float *xsum, int64_t M, int64_t K, int64_t group,
                        const uint8_t *codes, const uint16_t *scales, const uint8_t *zeros, float *y, int64_t N,
                        __m256i *u, float *part) {
    const int64_t runs = K / XB;
    int64_t piece = group <= PIECE ? group : XB;  // the longest run of whole XB's up to PIECE that tiles a group
    for (int64_t p = PIECE; p > XB && group > PIECE; p -= XB)
        if (group % p == 0) {
            piece = p;
            break;
        }
    for (int64_t r = 0; r < M; r++)
        for (int i = 0; i < BN; i++) y[r * N + i] = 0.f, part[r * BN + i] = 0.f;
    for (int64_t g = 0; g < K / group; g++) {
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += piece) {
            for (int64_t k = k0; k < k0 + piece; k += 4)
                for (int h = 0; h < 2; h++) transposed(codes + k * (BN / 2), h, u + ((k - k0) / 4) * 8 + 4 * h);
            int64_t r = 0;
            for (; r + PANEL_ROWS <= M; r += PANEL_ROWS)
                panel_rows(PANEL_ROWS, u, q + r * K, xs + r * runs, K, k0, piece, part + r * BN);
            switch (M - r) {  // literal row counts, so that each tile is unrolled into registers
            case 3: panel_rows(3, u, q + r * K, xs + r * runs, K, k0, piece, part + r * BN); break;
            case 2: panel_rows(2, u, q + r * K, xs + r * runs, K, k0, piece, part + r * BN); break;
            case 1: panel_rows(1, u, q + r * K, xs + r * runs, K, k0, piece, part + r * BN); break;
            }
        }
        float s[BN], zs[BN];
        group_params(scales + g * BN, zeros + g * BN, s, zs);
        for (int64_t r = 0; r < M; r++) {
            float total = 0.f;  // Σ x̂ over the group, added as tile_i8 adds it
            for (int64_t b = g * group / XB; b < (g + 1) * group / XB; b++) total += xsum[r * runs + b];
            const __m256 t = _mm256_set1_ps(total);
            float *yr = y + r * N;
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++) {
                    float *lo = yr + 32 * h + 4 * j, *hi = yr + 32 * h + 16 + 4 * j, *pp = part + r * BN + 8 * (4 * h + j);
                    __m256 a = _mm256_loadu2_m128(hi, lo);
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(pp), lanes_of(s, h, j), a);
                    a = _mm256_fnmadd_ps(t, lanes_of(zs, h, j), a);
                    _mm_storeu_ps(lo, _mm256_castps256_ps128(a));
                    _mm_storeu_ps(hi, _mm256_extractf128_ps(a, 1));
                    _mm256_storeu_ps(pp, _mm256_setzero_ps());
                }
        }
    }
}

// y [M, nblocks·BN] = x̂ · Wᵀ for 4-bit weights; K and the group size multiples of XB. Returns 1 when out of
// memory for the quantized x or a thread's buffers, 0 otherwise.
int slimlm_quant_matmul_i8(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scales,
                           const uint8_t *zeros, int64_t nblocks, int64_t group, float *y, int nthreads) {
    const int64_t N = nblocks * BN, G = K / group;
    int8_t *q = malloc(M * K);
    float *xs = malloc(sizeof(float) * M * K / XB), *xsum = malloc(sizeof(float) * M * K / XB);
    int failed = 0;
    if (!q || !xs || !xsum) {
        free(q), free(xs), free(xsum);
        return 1;
    }
    quantize_x(x, M, K, q, xs, xsum, nthreads);
    if (M >= PANEL_MIN_ROWS) {
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
        {
            __m256i *u = aligned_alloc(32, PIECE / 4 * 2 * 4 * sizeof(__m256i));
            float *part = malloc(sizeof(float) * M * BN);
            if (!u || !part) failed = 1;
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < nblocks; nb++)
                if (u && part)
                    panel_block(q, xs, xsum, M, K, group, codes + nb * K * (BN / 2), scales + nb * G * BN,
                                zeros + nb * G * BN, y + nb * BN, N, u, part);
            free(u), free(part);
        }
    } else {
        // n-blocks outermost: every row of x passes over a weight block while it is in cache, two rows a pass
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const uint8_t *c = codes + nb * K * (BN / 2);
            const uint16_t *sc = scales + nb * G * BN;
            const uint8_t *z = zeros + nb * G * BN;
            int64_t m = 0;
            for (; m + 2 <= M; m += 2)
                tile_i8(2, q + m * K, xs + m * K / XB, xsum + m * K / XB, K, group, c, sc, z, y + m * N + nb * BN, N);
            if (m < M)
                tile_i8(1, q + m * K, xs + m * K / XB, xsum + m * K / XB, K, group, c, sc, z, y + m * N + nb * BN, N);
        }
    }
    free(q), free(xs), free(xsum);
    return failed;
}

// Weight blocks [b0, b1) dequantized to fp32, written k-major into out [K, (b1 − b0)·BN].
void slimlm_dequantize(int bits, int64_t K, const uint8_t *codes, const uint16_t *scales,
                       const uint8_t *zeros, int64_t b0, int64_t b1, int64_t group, float *out,
                       int nthreads) {
    const int64_t G = K / group, row_bytes = BN * bits / 8, width = (b1 - b0) * BN;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t nb = b0; nb < b1; nb++) {
        for (int64_t g = 0; g < G; g++) {
            float s[BN], zs[BN];
            group_params(scales + (nb * G + g) * BN, zeros + (nb * G + g) * BN, s, zs);
            for (int64_t k = g * group; k < (g + 1) * group; k++) {
                __m128i parts[4];
                codes_at(bits, codes + (nb * K + k) * row_bytes, parts);
                float *o = out + k * width + (nb - b0) * BN;
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + 8 * i, weight_at(parts, i, s, zs));
            }
        }
    }
}

// Literal `bits` and `rows` let the compiler specialise and unroll each tile (registers, not memory).
#define TILE(B, R) tile(B, R, xr, K, group, c, s, z, yr, N)

void slimlm_quant_matmul(int bits, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                         const uint16_t *scales, const uint8_t *zeros, int64_t nblocks, int64_t group,
                         float *y, int nthreads) {
    const int64_t N = nblocks * BN, G = bits == 32 ? 0 : K / group, mblocks = (M + MB - 1) / MB;
    // n-blocks outermost: a thread sweeps all row blocks of x over one weight block while it is in cache.
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        for (int64_t mb = 0; mb < mblocks; mb++) {
            const int rows = M - mb * MB < MB ? (int)(M - mb * MB) : MB;
            const float *xr = x + mb * MB * K;
            float *yr = y + mb * MB * N + nb * BN;
            const uint8_t *c = codes + nb * K * (BN * bits / 8);
            const uint16_t *s = scales + nb * G * BN;
            const uint8_t *z = zeros + nb * G * BN;
            if (bits == 32) {
                const float *w = (const float *)codes + nb * K * BN;
                if (rows == 1) dense_tile(1, xr, K, w, yr, N); else dense_tile(2, xr, K, w, yr, N);
            } else if (bits == 4) {
                if (rows == 1) TILE(4, 1); else TILE(4, 2);
            } else {
                if (rows == 1) TILE(8, 1); else TILE(8, 2);
            }
        }
    }
}
#endif
