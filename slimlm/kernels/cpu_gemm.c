// Quantized GEMM for CPUs: y[M, N] = x[M, K] · W[N, K]ᵀ with W in the layout of slimlm/kernels/packed.py.
//
// Why this exists: on a CPU a decode step is bound by the bytes it reads, and torch's own int4/int8
// weight-only kernels are slower here than a dense bf16 matmul. This loop reads each packed weight byte
// once per block of MB rows of x, widens 16 codes per instruction to fp32 with AVX-512, applies the group's
// scale and zero point with one fused multiply-subtract and accumulates into MB×4 registers that span the
// 64 output features of one block. No horizontal sums: lanes run along N, the loop runs along K.
//
// Built on first use by slimlm/kernels/cpu_library.py (gcc -O3 -march=native -fopenmp) together with its
// AVX2 twin (cpu_gemm_avx2.c); each file compiles to nothing on the other ISA. With neither, the build fails
// and the dispatcher uses the PyTorch path. OpenMP resolves to the libgomp torch already loaded.
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "slimlm's CPU kernels need AVX-512, or AVX2 with FMA and F16C (the PyTorch path runs without them)"
#endif

#ifdef __AVX512F__
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "slimlm_kernels.h"

#define BN 64  // output features per block (packed.BLOCK_N)
#define MB 6   // rows of x per register tile: 24 accumulators (4 gave 0.85x the GFLOP/s from 32 rows)

int slimlm_vector_bits(void) { return 512; }

// The codes `AHEAD` bytes past c asked into L2 now: as many as one step of the loops below reads at c (at
// most 64 bytes of 4-bit codes, 128 of 8-bit, 256 of dense bf16 or fp32 weights). The hardware prefetcher
// alone restarts at every weight block (18–36 KB apart per thread) and ramps up slowly: the default model's GEMMs at one row read 7 GB/s without
// this and ~10 with it (of the ~15 that two cores could stream on the EPYC). Past a block's end it fetches
// the next block, where the thread goes next. Into L2 (T1), not L1: an L1 prefetch holds one of the core's
// few fill buffers for a whole trip to memory, and on the Sapphire Rapids host 8B-shaped layers at one row,
// read from memory, ran 1.08× (4-bit) and 1.10× (8-bit) faster with T1 than with T0 (no prefetch: 0.43×).
#define AHEAD 4096
static inline __attribute__((always_inline)) void prefetch_codes(int bits, const uint8_t *c) {
    for (int b = 0; b < (bits == 32 ? 256 : 16 * bits); b += 64) _mm_prefetch((const char *)c + AHEAD + b, _MM_HINT_T1);
}

static inline __attribute__((always_inline)) void
weights_at(int bits, const uint8_t *c, const __m512 s[4], const __m512 zs[4], __m512 w[4]) {
    if (bits == 32) {  // dense fp32 weights (packed.pack_dense), as they are
        for (int i = 0; i < 4; i++) w[i] = _mm512_loadu_ps(c + 64 * i);
        return;
    }
    if (bits == 4) {
        // byte j: feature j in the low nibble, feature j + 32 in the high one
        const __m256i b = _mm256_loadu_si256((const __m256i *)c);
        const __m256i mask = _mm256_set1_epi8(0x0F);
        const __m256i lo = _mm256_and_si256(b, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)));
        w[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)));
        w[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1)));
    } else {
        for (int i = 0; i < 4; i++)
            w[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * i))));
    }
    for (int i = 0; i < 4; i++) w[i] = _mm512_fmsub_ps(w[i], s[i], zs[i]);  // code·s − zero·s
}

// One group's 64 scales, and scale · (zero + offset), of the features of a block (scales, zeros at the group).
static inline __attribute__((always_inline)) void
group_scales(const uint16_t *scales, const uint8_t *zeros, float offset, __m512 s[4], __m512 zs[4]) {
    for (int i = 0; i < 4; i++) {
        s[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 16 * i)));
        const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zeros + 16 * i))));
        zs[i] = _mm512_mul_ps(_mm512_add_ps(z, _mm512_set1_ps(offset)), s[i]);
    }
}

static inline __attribute__((always_inline)) void
tile(int bits, int rows, const float *x, int64_t K, int64_t group, const uint8_t *codes,
     const uint16_t *scales, const uint8_t *zeros, float *y, int64_t N) {
    const int64_t row_bytes = BN * bits / 8;
    __m512 acc[MB][4];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / group; g++) {
        __m512 s[4], zs[4];  // dense fp32 weights (bits 32, one group) have none
        if (bits != 32) group_scales(scales + g * BN, zeros + g * BN, 0.0f, s, zs);
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
            __m512 w[4];
            prefetch_codes(bits, codes + k * row_bytes);
            weights_at(bits, codes + k * row_bytes, s, zs, w);
            for (int r = 0; r < rows; r++) {
                const __m512 xb = _mm512_set1_ps(x[r * K + k]);
                for (int i = 0; i < 4; i++) acc[r][i] = _mm512_fmadd_ps(xb, w[i], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(y + r * N + 16 * i, acc[r][i]);
}

// Weight blocks [b0, b1) dequantized, written k-major into out [K, (b1 − b0)·BN] as bf16 (rounded to nearest
// even, as torch rounds): the large-M path of bf16 x on CPUs without the bf16 dot product hands this to torch's
// bf16 matmul, which beats any FMA loop once x has more than a few rows.
void slimlm_dequantize(int bits, int64_t K, const uint8_t *codes, const uint16_t *scales, const uint8_t *zeros,
                       int64_t b0, int64_t b1, int64_t group, uint16_t *out, int nthreads) {
    const int64_t G = K / group, row_bytes = BN * bits / 8, width = (b1 - b0) * BN;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t nb = b0; nb < b1; nb++) {
        for (int64_t g = 0; g < G; g++) {
            __m512 s[4], zs[4];
            group_scales(scales + (nb * G + g) * BN, zeros + (nb * G + g) * BN, 0.0f, s, zs);
            for (int64_t k = g * group; k < (g + 1) * group; k++) {
                __m512 w[4];
                weights_at(bits, codes + (nb * K + k) * row_bytes, s, zs, w);
                const int64_t at = k * width + (nb - b0) * BN;
                for (int i = 0; i < 4; i++) {
                    __m512i u = _mm512_castps_si512(w[i]);
                    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
                    _mm256_storeu_si256((__m256i *)(out + at + 16 * i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
                }
            }
        }
    }
}

#ifdef SLIMLM_BF16_GEMM
// bf16 x: GEMMs on the bf16 dot-product unit (vdpbf16ps: 32 multiply-adds an instruction, the fastest
// arithmetic here). Its operand is a register of 16 dwords whose halves hold one output feature's weights at
// inputs k (low) and k + 1 (high): "pairs" below. Two ways to feed it, because what costs most changes with
// the number of rows M:
//
// Few rows (code tiles): unpacking weights, not multiplying them, is the cost. So the codes go into the dot
// product as they are: a 4-bit code c becomes bf16(1 + c/16) with two bit operations (c in the mantissa of
// 1.0), an 8-bit code bf16(c) through one integer conversion (exact: 8 significant bits). A segment of inputs
// inside one group is summed that way and the group's scale and zero point are applied once per segment
// instead of once per weight (4-bit: offset 16, 8-bit: 0):
//     y += scale · Σ x·(c + offset)  −  scale · (zero + offset) · Σ x            (Σ x precomputed per segment)
// The offset makes the sums run larger than the result, which costs fp32 bits: 1 + c/16 rather than the
// plain trick's 128 + c keeps that 8× smaller, and the result as accurate as torch's fp32 matmul.
// Every tile of ≤ 4 rows unpacks its own codes (they stay in cache between tiles). Weights are exact.
//
// Many rows (weight tiles): the dot products are the cost, and the per-segment correction would add ~10%.
// So each chunk of one weight block is dequantized once into a buffer of bf16 weights (rounded to
// nearest even, as torch rounds) and tiles of 6 rows read it: the inner loop of a dense bf16 GEMM.
//
// Dense bf16 weights (bits 16, packed.pack_dense) are stored as those pairs already: both ways read them in
// place, with no scales (torch's own bf16 matmul reads one row of x at 18-30 GB/s here, about half of what
// the weight bytes allow).
#define KC 1024       // inputs per chunk: KC/2 pairs × 64 features × 4 bytes = 128 KB of buffer, in L2.
                      // Fewer chunks mean fewer reloads of y's tiles, whose rows (N·4 bytes apart, often a
                      // multiple of 64 KB) collide in the caches: chunks of 256 halved lm_head's speed.
#define CODE_ROWS 4   // rows per code tile: 16 accumulators, 4 pairs and the unpacking temporaries
#define WEIGHT_ROWS 6 // rows per weight tile: 24 accumulators and 4 pairs of the 32 registers

// Codes of weight rows k and k + 1 (at c) as four registers of bf16 pairs, features 16i..16i+15 in w[i].
static inline __attribute__((always_inline)) void code_pairs(int bits, const uint8_t *c, __m512i w[4]) {
    if (bits == 16) {  // dense bf16 weights, stored as the pairs themselves
        for (int i = 0; i < 4; i++) w[i] = _mm512_loadu_si512(c + 64 * i);
    } else if (bits == 4) {
        // byte j of a row: feature j in the low nibble, j + 32 in the high one. Dword l of t gathers the
        // bytes of features l and l + 16 at k (bytes 0, 1) and at k + 1 (bytes 2, 3).
        static const uint8_t gather[64] = {
            0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
            6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
            12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
        const __m512i t = _mm512_permutexvar_epi8(_mm512_loadu_si512(gather), _mm512_loadu_si512(c));
        // a code c at bits 3-6 of 0x3F80 is bf16(1 + c/16), exactly; (shifted t & field) | one: 0xEA = (A & B) | C
        const __m512i field = _mm512_set1_epi32(0x00780078), one = _mm512_set1_epi32(0x3F803F80);
        w[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi32(t, 3), field, one, 0xEA);
        w[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(t, 5), field, one, 0xEA);
        w[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(t, 1), field, one, 0xEA);
        w[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(t, 9), field, one, 0xEA);
    } else {
        // a small integer's fp32 bits end in 16 zeros, so its top half is its exact bf16
        for (int i = 0; i < 4; i++) {
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * i))));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + BN + 16 * i))));
            w[i] = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16), _mm512_castps_si512(hi));
        }
    }
}

static inline __attribute__((always_inline)) void
dot_pair(int rows, const uint16_t *x, int64_t K, const __m512i w[4], __m512 acc[][4]) {
    for (int r = 0; r < rows; r++) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + r * K));  // x[r, k], x[r, k+1]
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)w[i], xb);
    }
}

// y[rows, 64] (+)= x[rows, k0 : k0 + kc] · W[block, k0 : k0 + kc]ᵀ from the codes, segment by segment.
// xs: Σ x of each segment (stride xs_stride per row).
static inline __attribute__((always_inline)) void
code_tile(int bits, int rows, const uint16_t *x, int64_t K, int64_t group, int64_t seg, const uint8_t *codes,
          const uint16_t *scales, const uint8_t *zeros, int64_t k0, int64_t kc, const float *xs,
          int64_t xs_stride, float *y, int64_t N) {
    // 4-bit pairs hold 1 + c/16 = (16 + c)/16, 8-bit ones c
    const float offset = bits == 4 ? 16.0f : 0.0f;
    const __m512 unit = _mm512_set1_ps(bits == 4 ? 16.0f : 1.0f);
    // One or two rows: a second set of sums takes every other pair of inputs. Each sum waits on its last
    // dot product (~6 cycles), so one set of four ran at ~40 GB/s of codes a core, below what memory delivers.
    const int sets = rows <= 2 ? 2 : 1;
    for (int64_t sk = k0; sk < k0 + kc; sk += seg) {
        __m512 acc[WEIGHT_ROWS][4], other[2][4];  // CASES also instantiates 5 and 6 rows, which code tiles never run
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
        for (int r = 0; sets == 2 && r < rows; r++)
            for (int i = 0; i < 4; i++) other[r][i] = _mm512_setzero_ps();
        for (int64_t k = sk; k < sk + seg; k += 2 * sets) {
            __m512i w[4];
            prefetch_codes(bits, codes + k * (BN * bits / 8));
            code_pairs(bits, codes + k * (BN * bits / 8), w);
            dot_pair(rows, x + k, K, w, acc);
            if (sets == 2 && k + 2 < sk + seg) {
                prefetch_codes(bits, codes + (k + 2) * (BN * bits / 8));
                code_pairs(bits, codes + (k + 2) * (BN * bits / 8), w);
                dot_pair(rows, x + k + 2, K, w, other);
            }
        }
        for (int r = 0; sets == 2 && r < rows; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_add_ps(acc[r][i], other[r][i]);
        if (bits == 16) {  // y += acc
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < 4; i++) {
                    const __m512 v = sk == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * N + 16 * i);
                    _mm512_storeu_ps(y + r * N + 16 * i, _mm512_add_ps(acc[r][i], v));
                }
            continue;
        }
        // y += scale · unit · acc − scale · (zero + offset) · Σx
        const int64_t g = sk / group;
        __m512 s[4], zs[4];
        group_scales(scales + g * BN, zeros + g * BN, offset, s, zs);
        for (int r = 0; r < rows; r++) {
            const __m512 sum = _mm512_set1_ps(xs[r * xs_stride + sk / seg]);
            for (int i = 0; i < 4; i++) {
                const __m512 v = sk == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * N + 16 * i);
                const __m512 scaled = _mm512_fmadd_ps(acc[r][i], _mm512_mul_ps(s[i], unit), v);
                _mm512_storeu_ps(y + r * N + 16 * i, _mm512_fnmadd_ps(zs[i], sum, scaled));
            }
        }
    }
}

// Inputs [k0, k0 + kc) of one weight block, dequantized into buf as bf16 pairs (rounded to nearest even).
// Two rows of codes k, k + 1 make eight fp32 registers with one byte permute: lane L of register r takes the
// code of row k + L%2, feature f = 32·(r/4) + 8·(r%4) + L/2, from byte r%4 of its dword (4-bit: nibble r/4).
// Two bit operations put the code c in the mantissa of 1.0, which reads as v = 1 + c/u exactly (u = 16 or
// 256), and one fused multiply-subtract makes the weight: s·(c − z) = (u·s)·v − s·(u + z) (the rounding of
// s·(u + z) stays far below the bf16 rounding that follows). Registers 2i and 2i + 1 then convert together
// into pair register i (features 16i..16i+15) in order: one permute per two rows of codes, none after it.
static inline __attribute__((always_inline)) void
dequantize_chunk(int bits, int64_t group, const uint8_t *codes, const uint16_t *scales, const uint8_t *zeros,
                 int64_t k0, int64_t kc, __m512i *buf) {
    const float u = bits == 4 ? 16.0f : 256.0f;
    const int64_t row_bytes = BN * bits / 8;
    // byte b of dword `lane`: row lane % 2's byte 8b + lane/2 (8-bit: of half 0; half 1 is 32 bytes on)
    static const uint8_t gather4[64] = {
        0, 8, 16, 24, 32, 40, 48, 56, 1, 9, 17, 25, 33, 41, 49, 57, 2, 10, 18, 26, 34, 42, 50, 58, 3, 11,
        19, 27, 35, 43, 51, 59, 4, 12, 20, 28, 36, 44, 52, 60, 5, 13, 21, 29, 37, 45, 53, 61, 6, 14, 22, 30,
        38, 46, 54, 62, 7, 15, 23, 31, 39, 47, 55, 63};
    static const uint8_t gather8[64] = {
        0, 8, 16, 24, 64, 72, 80, 88, 1, 9, 17, 25, 65, 73, 81, 89, 2, 10, 18, 26, 66, 74, 82, 90, 3, 11,
        19, 27, 67, 75, 83, 91, 4, 12, 20, 28, 68, 76, 84, 92, 5, 13, 21, 29, 69, 77, 85, 93, 6, 14, 22, 30,
        70, 78, 86, 94, 7, 15, 23, 31, 71, 79, 87, 95};
    const __m512i g0 = _mm512_loadu_si512(bits == 4 ? gather4 : gather8);
    const __m512i g1 = _mm512_add_epi8(g0, _mm512_set1_epi8(32));
    const __m512i field = _mm512_set1_epi32(bits == 4 ? 0x00780000 : 0x007F8000);
    const __m512i one = _mm512_set1_epi32(0x3F800000);
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // lane L: feature L/2
    __m512 scale[8], offset[8];
    for (int64_t k = k0; k < k0 + kc; k += 2) {
        if (k == k0 || k % group == 0) {  // groups are even: a pair never straddles two
            const uint16_t *sg = scales + k / group * BN;
            const uint8_t *zg = zeros + k / group * BN;
            for (int r = 0; r < 8; r++) {
                const int f = 32 * (r / 4) + 8 * (r % 4);
                const __m512 sf = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + f)))));
                const __m512 zf = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zg + f))))));
                scale[r] = _mm512_mul_ps(sf, _mm512_set1_ps(u));
                offset[r] = _mm512_mul_ps(sf, _mm512_add_ps(zf, _mm512_set1_ps(u)));
            }
        }
        const uint8_t *c = codes + k * row_bytes;
        prefetch_codes(bits, c);
        __m512i t0, t1;
        if (bits == 4) {
            t0 = t1 = _mm512_permutexvar_epi8(g0, _mm512_loadu_si512(c));
        } else {
            const __m512i lo = _mm512_loadu_si512(c), hi = _mm512_loadu_si512(c + 64);
            t0 = _mm512_permutex2var_epi8(lo, g0, hi), t1 = _mm512_permutex2var_epi8(lo, g1, hi);
        }
        __m512 w[8];
        for (int r = 0; r < 8; r++) {
            // the code's bits to the mantissa's top (4-bit: 22..19, 8-bit: 22..15), then (t & field) | one
            const int at = bits == 4 ? 8 * (r % 4) + 4 * (r / 4) : 8 * (r % 4), to = bits == 4 ? 19 : 15;
            const __m512i t = bits == 4 || r < 4 ? t0 : t1;
            const __m512i moved = at <= to ? _mm512_slli_epi32(t, to - at) : _mm512_srli_epi32(t, at - to);
            const __m512 v = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(moved, field, one, 0xEA));
            w[r] = _mm512_fmsub_ps(v, scale[r], offset[r]);
        }
        for (int i = 0; i < 4; i++)
            buf[(k - k0) / 2 * 4 + i] = (__m512i)_mm512_cvtne2ps_pbh(w[2 * i + 1], w[2 * i]);
    }
}

// y[rows, 64] (+)= x[rows, k0 : k0 + kc] · the dequantized chunk in buf.
static inline __attribute__((always_inline)) void
weight_tile(int rows, const uint16_t *x, int64_t K, int64_t k0, int64_t kc, const __m512i *buf, float *y,
            int64_t N) {
    __m512 acc[WEIGHT_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * N + 16 * i);
    for (int64_t k = k0; k < k0 + kc; k += 2) dot_pair(rows, x + k, K, buf + (k - k0) / 2 * 4, acc);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(y + r * N + 16 * i, acc[r][i]);
}

// A narrow layer has too few weight blocks to keep every thread busy, or a count the threads do not share
// evenly (9 blocks on 2 threads: 5 and 4): then the rows are split too (into this many parts, each at least
// `unit` rows), and a block whose parts go to two threads is unpacked by both.
static inline int64_t row_parts(int64_t nblocks, int64_t rows, int64_t unit, int nthreads) {
    int64_t parts = 1;
    while ((nblocks * parts < 4 * nthreads || nblocks * parts % nthreads != 0) && 2 * parts * unit <= rows) parts *= 2;
    return parts;
}

// Rows [m, m1) in tiles of at most `most` rows, as even as possible (7 rows: 4 + 3, not 6 + 1: a tile of
// one row waits on its accumulators' latency). Returns the next tile's rows.
static inline int64_t tile_rows(int64_t m, int64_t m1, int64_t most) {
    const int64_t left = m1 - m, tiles = (left + most - 1) / most;
    return (left + tiles - 1) / tiles;
}

// Literal bits and rows: each case compiles to its own unrolled loop with the tile in registers.
#define CODE_TILE(B, R) code_tile(B, R, x + m * K, K, group, seg, c, s, z, k0, kc, xs + m * S, S, acc + (m - m0) * BN, BN)
#define WEIGHT_TILE(R) weight_tile(R, x + m * K, K, k0, kc, wt, acc + (m - m0) * BN, BN)
#define CASES(TILE, ...)                                                                                  \
    switch (rows) {                                                                                       \
        case 1: TILE(__VA_ARGS__ 1); break;                                                               \
        case 2: TILE(__VA_ARGS__ 2); break;                                                               \
        case 3: TILE(__VA_ARGS__ 3); break;                                                               \
        case 4: TILE(__VA_ARGS__ 4); break;                                                               \
        case 5: TILE(__VA_ARGS__ 5); break;                                                               \
        default: TILE(__VA_ARGS__ 6);                                                                     \
    }

// Rows [m0, m1) of one block's fp32 results (acc, 64 per row) into y: its first `cols` columns from
// column c0 on, as fp32 or rounded to bf16 (nearest even).
static inline void write_block(const float *acc, int64_t m0, int64_t m1, void *y, int64_t y_cols, int y_bf16,
                               int64_t c0) {
    const int64_t cols = y_cols - c0 < BN ? y_cols - c0 : BN;
    const __mmask16 tail = (__mmask16)((1u << (cols % 16)) - 1);
    for (int64_t m = m0; m < m1; m++) {
        const float *a = acc + (m - m0) * BN;
        for (int64_t i = 0; i < cols; i += 16) {
            const __mmask16 mask = cols - i >= 16 ? (__mmask16)0xFFFF : tail;
            const __m512 v = _mm512_loadu_ps(a + i);
            if (y_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + m * y_cols + c0 + i, mask, (__m256i)_mm512_cvtneps_pbh(v));
            else
                _mm512_mask_storeu_ps((float *)y + m * y_cols + c0 + i, mask, v);
        }
    }
}

// The code tiles' segments: inputs inside one group and one chunk, of even length.
static inline int64_t segment(int64_t group) {
    int64_t seg = group < KC ? group : KC;
    while (group % seg != 0 || seg % 2 != 0) seg--;
    return seg;
}

// Σ x over each segment of each of the M rows of x [M, K]: a new [M, K / seg] array, or NULL.
static float *segment_sums(const uint16_t *x, int64_t M, int64_t K, int64_t seg) {
    const int64_t S = K / seg;
    float *xs = malloc(sizeof(float) * M * S);
    for (int64_t m = 0; xs != NULL && m < M; m++)
        for (int64_t j = 0; j < S; j++) {
            float sum = 0.0f;
            for (int64_t k = j * seg; k < (j + 1) * seg; k++) {
                const uint32_t word = (uint32_t)x[m * K + k] << 16;  // bf16 -> fp32: the same top half
                float v;
                memcpy(&v, &word, sizeof v);
                sum += v;
            }
            xs[m * S + j] = sum;
        }
    return xs;
}

// y[M, y_cols] = x[M, K] bf16 · Wᵀ, as fp32 or bf16 (y_bf16), code tiles up to `code_rows` rows of x and
// weight tiles above. K and the group size must be even. Returns -1 if out of memory.
int slimlm_quant_matmul_bf16(int bits, const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                             const uint16_t *scales, const uint8_t *zeros, int64_t nblocks, int64_t group,
                             void *y, int64_t y_cols, int y_bf16, int64_t code_rows, int nthreads) {
    const int64_t G = K / group;
    const int codes_only = M <= code_rows;
    const int64_t seg = segment(group), S = K / seg, chunk = KC / seg * seg;
    float *xs = NULL;  // Σ x over each segment, per row (code tiles of codes only)
    if (codes_only && bits != 16 && (xs = segment_sums(x, M, K, seg)) == NULL) return -1;
    const int64_t parts = row_parts(nblocks, M, CODE_ROWS, nthreads), part_rows = (M + parts - 1) / parts;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(|| : failed)
    {
        // per thread: the results of one block's rows until the last chunk (then written to y, in y's dtype,
        // without the padding), and the dequantized chunk of the weight tiles
        float *acc = aligned_alloc(64, sizeof(float) * BN * part_rows);
        __m512i *buf = codes_only || bits == 16 ? NULL : aligned_alloc(64, sizeof(__m512i) * KC / 2 * 4);
        failed = acc == NULL || (!codes_only && bits != 16 && buf == NULL);
#pragma omp for collapse(2) schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            for (int64_t part = 0; part < parts; part++) {
                if (failed) continue;
                const int64_t m0 = part * part_rows, m1 = part == parts - 1 ? M : m0 + part_rows;
                const uint8_t *c = codes + nb * K * (BN * bits / 8);
                const uint16_t *s = scales + nb * G * BN;
                const uint8_t *z = zeros + nb * G * BN;
                for (int64_t k0 = 0; k0 < K; k0 += chunk) {
                    const int64_t kc = K - k0 < chunk ? K - k0 : chunk;
                    if (codes_only) {
                        for (int64_t m = m0, rows; m < m1; m += rows) {
                            rows = tile_rows(m, m1, CODE_ROWS);
                            if (bits == 4) { CASES(CODE_TILE, 4,) }
                            else if (bits == 8) { CASES(CODE_TILE, 8,) }
                            else { CASES(CODE_TILE, 16,) }
                        }
                    } else {
                        const __m512i *wt = bits == 16 ? (const __m512i *)(c + k0 * (BN * bits / 8)) : buf;
                        if (bits != 16) dequantize_chunk(bits, group, c, s, z, k0, kc, buf);
                        for (int64_t m = m0, rows; m < m1; m += rows) {
                            rows = tile_rows(m, m1, WEIGHT_ROWS);
                            CASES(WEIGHT_TILE,)
                        }
                    }
                }
                write_block(acc, m0, m1, y, y_cols, y_bf16, nb * BN);
            }
        }
        free(buf);
        free(acc);
    }
    free(xs);
    return failed ? -1 : 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Many rows on a CPU with AMX: the weight tiles above, with the dot products on the AMX tile unit
// (tdpbf16ps: a 16×32 tile of x times a 16-pair × 16-feature tile of weights, 8192 multiply-adds an
// instruction). The dequantized chunk in buf already has the tile unit's weight layout: row p of a weight
// tile is pair p (inputs k0 + 2p, k0 + 2p + 1) of 16 features, 256 bytes from the next. One tile product
// serves 16 rows of x for about the time the AVX-512 loops spend on one, and the weights are unpacked once
// per call: from a handful of rows on, this reads 4 or 8 bits a weight where a dense bf16 matmul reads 16.
#include <sys/syscall.h>
#include <unistd.h>

#define TM 16  // rows of a tile
#define TK 32  // inputs of a tile (16 pairs)
#define KC_DENSE 256  // dense bf16 weights: inputs per chunk, so that a block's chunk (32 KB) stays in L1

// Linux hands out the tile registers only to a process that asks. Returns 1 if they are usable.
int slimlm_amx_ready(void) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

// Eight tiles of 16 rows × 64 bytes; which hold results, x and weights, each loop below says (and the prompt
// attention's, cpu_attention.c).
// A constant, not a local filled in a loop: gcc treats _tile_loadconfig's operand as unread and dropped the
// loop's stores once this function was no longer inlined (ldtilecfg then faults on the garbage).
void configure_tiles(void) {
    static const struct tile_config config = {.palette = 1,
                                              .bytes_per_row = {64, 64, 64, 64, 64, 64, 64, 64},
                                              .rows = {TM, TM, TM, TM, TM, TM, TM, TM}};
    _tile_loadconfig(&config);
}

// tmm0-3, the results, from the fp32 rows at a0..a3 (64 floats apart), or zero on a block's first chunk.
static inline void amx_results_start(float *a0, float *a1, float *a2, float *a3, int first) {
    if (first) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
        _tile_loadd(0, a0, 4 * BN); _tile_loadd(1, a1, 4 * BN); _tile_loadd(2, a2, 4 * BN); _tile_loadd(3, a3, 4 * BN);
    }
}

static inline void amx_results_store(float *a0, float *a1, float *a2, float *a3) {
    _tile_stored(0, a0, 4 * BN); _tile_stored(1, a1, 4 * BN); _tile_stored(2, a2, 4 * BN); _tile_stored(3, a3, 4 * BN);
}

// The inputs [k0, k0 + kc) of one weight block unpacked into buf for the tile unit, with zero pairs up to a
// whole tile step (x's padding inputs are zero, but 0 · garbage may not be). A literal `bits` for each
// width: the compiler keeps this function out of line, and a variable `bits` left its shifts and selects
// to run time.
static void dequantize_tiles(int bits, int64_t group, const uint8_t *codes, const uint16_t *scales,
                             const uint8_t *zeros, int64_t k0, int64_t kc, __m512i *buf) {
    if (bits == 4) dequantize_chunk(4, group, codes, scales, zeros, k0, kc, buf);
    else dequantize_chunk(8, group, codes, scales, zeros, k0, kc, buf);
    memset(buf + kc / 2 * 4, 0, sizeof(__m512i) * ((kc + TK - 1) / TK * TK - kc) / 2 * 4);
}

// The results of x's row tiles at m and m + TM (acc rows 64 floats apart) for inputs [0, kc) of the chunk in
// buf: tmm0-3 hold them for two of the block's four feature tiles at a time, tmm4-5 x, tmm6-7 weights.
static inline void amx_two_row_tiles(const uint16_t *x, int64_t stride, int64_t kc, const __m512i *buf, float *acc,
                                     int first) {
    for (int i = 0; i < 4; i += 2) {
        float *c0 = acc + 16 * i, *c1 = acc + TM * BN + 16 * i;
        amx_results_start(c0, c0 + 16, c1, c1 + 16, first);
        for (int64_t k = 0; k < kc; k += TK) {
            _tile_loadd(4, x + k * TM, 64);
            _tile_loadd(5, x + TM * stride + k * TM, 64);
            _tile_loadd(6, buf + k / 2 * 4 + i, 4 * 64);
            _tile_loadd(7, buf + k / 2 * 4 + i + 1, 4 * 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        amx_results_store(c0, c0 + 16, c1, c1 + 16);
    }
}

// One row tile: tmm0-3 hold all four feature tiles' results, tmm4 x, tmm5-7 weights (tmm5 twice a step).
// One tile step (TK inputs): x's tile at x, the four weight tiles from w.
static inline void amx_row_step(const uint16_t *x, const __m512i *w) {
    _tile_loadd(4, x, 64);
    _tile_loadd(5, w, 4 * 64); _tile_loadd(6, w + 1, 4 * 64); _tile_loadd(7, w + 2, 4 * 64);
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, w + 3, 4 * 64);
    _tile_dpbf16ps(3, 4, 5);
}

static inline void amx_row_tile(const uint16_t *x, int64_t kc, const __m512i *buf, float *acc, int first) {
    amx_results_start(acc, acc + 16, acc + 32, acc + 48, first);
    for (int64_t k = 0; k < kc; k += TK) amx_row_step(x + k * TM, buf + k / 2 * 4);
    amx_results_store(acc, acc + 16, acc + 32, acc + 48);
}

// A single row tile over all of K: the weights are unpacked one tile step (TK inputs) at a time, just before
// the tile unit multiplies them, so that the AVX-512 unpacking and the tile unit run side by side, and the
// results stay in tmm0-3 throughout. buf: a ring of RING steps, so unpacking never waits for a tile load.
#define RING 4
static void amx_streamed_row_tile(int bits, int64_t group, const uint8_t *codes, const uint16_t *scales,
                                  const uint8_t *zeros, int64_t K, const uint16_t *x, __m512i *buf,
                                  float *acc) {
    amx_results_start(acc, acc + 16, acc + 32, acc + 48, 1);
    for (int64_t k = 0; k < K; k += TK) {
        __m512i *w = buf + k / TK % RING * (TK / 2 * 4);
        dequantize_tiles(bits, group, codes, scales, zeros, k, K - k < TK ? K - k : TK, w);
        amx_row_step(x + k * TM, w);
    }
    amx_results_store(acc, acc + 16, acc + 32, acc + 48);
}

// The same single row tile from the codes as they are: each tile step's weights are the code tiles' exact
// pairs (bf16 1 + c/16, or c), which take half the unpacking work of dequantized weights, and the tile unit's
// sums take each segment's scale and zero point as the code tiles' do. So a step of up to 16 rows costs about
// what one row's code tile costs. rows: x's real rows (acc gets those); xs: Σ x per segment, S a row;
// seg a multiple of TK.
static inline __attribute__((always_inline)) void
amx_code_tile(int bits, int64_t group, int64_t seg, const uint8_t *codes, const uint16_t *scales,
              const uint8_t *zeros, int64_t K, const uint16_t *x, int64_t rows, const float *xs,
              int64_t S, __m512i *buf, float *acc) {
    const float offset = bits == 4 ? 16.0f : 0.0f;  // 4-bit pairs hold (16 + c)/16, 8-bit ones c
    const __m512 unit = _mm512_set1_ps(bits == 4 ? 16.0f : 1.0f);
    const int64_t row_bytes = BN * bits / 8;
    float sums[TM * BN] __attribute__((aligned(64)));  // one segment's raw sums, from the result tiles
    for (int64_t sk = 0; sk < K; sk += seg) {
        amx_results_start(sums, sums + 16, sums + 32, sums + 48, 1);
        for (int64_t k = sk; k < sk + seg; k += TK) {
            __m512i *w = buf + k / TK % RING * (TK / 2 * 4);
            for (int64_t p = 0; p < TK / 2; p++) {
                prefetch_codes(bits, codes + (k + 2 * p) * row_bytes);
                code_pairs(bits, codes + (k + 2 * p) * row_bytes, w + 4 * p);
            }
            amx_row_step(x + k * TM, w);
        }
        amx_results_store(sums, sums + 16, sums + 32, sums + 48);
        __m512 s[4], zs[4];
        group_scales(scales + sk / group * BN, zeros + sk / group * BN, offset, s, zs);
        for (int64_t r = 0; r < rows; r++) {  // acc += scale · unit · sums − scale · (zero + offset) · Σx
            const __m512 sum = _mm512_set1_ps(xs[r * S + sk / seg]);
            for (int i = 0; i < 4; i++) {
                float *a = acc + r * BN + 16 * i;
                const __m512 v = sk == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(a);
                const __m512 scaled = _mm512_fmadd_ps(_mm512_loadu_ps(sums + r * BN + 16 * i), _mm512_mul_ps(s[i], unit), v);
                _mm512_storeu_ps(a, _mm512_fnmadd_ps(zs[i], sum, scaled));
            }
        }
    }
}

// amx_code_tile with a literal `bits` (as dequantize_tiles, for the same reason)
static void amx_code_row_tile(int bits, int64_t group, int64_t seg, const uint8_t *codes, const uint16_t *scales,
                              const uint8_t *zeros, int64_t K, const uint16_t *x, int64_t rows,
                              const float *xs, int64_t S, __m512i *buf, float *acc) {
    if (bits == 4) amx_code_tile(4, group, seg, codes, scales, zeros, K, x, rows, xs, S, buf, acc);
    else amx_code_tile(8, group, seg, codes, scales, zeros, K, x, rows, xs, S, buf, acc);
}

// For each of n blocks b: acc + b·acc_step [rows, 64] (+)= x[rows, 0 : kc] · the chunk in buf + b·buf_step;
// rows a multiple of TM, x in tiles (slimlm_quant_matmul_amx), its row tiles TM · stride bf16 apart. Row tiles
// outermost: their x tiles stay in cache while every block multiplies them.
static void amx_chunk(int64_t rows, const uint16_t *x, int64_t stride, int64_t kc, const __m512i *buf,
                      int64_t buf_step, float *acc, int64_t acc_step, int64_t n, int first) {
    for (int64_t b = 0; b < n; b++) {
        int64_t m = 0;
        for (; m + 2 * TM <= rows; m += 2 * TM)
            amx_two_row_tiles(x + m * stride, stride, kc, buf + b * buf_step, acc + b * acc_step + m * BN, first);
        if (m < rows) amx_row_tile(x + m * stride, kc, buf + b * buf_step, acc + b * acc_step + m * BN, first);
    }
}

// Weight blocks a thread takes together: one, unless x is too large to stay in L2 (half of a Sapphire Rapids
// core's 2 MB) while each block reads all of it; then up to four, which read it once for all of them, as long
// as every thread still gets a couple of groups.
static inline int64_t amx_group(int64_t M, int64_t K, int64_t nblocks, int nthreads) {
    int64_t n = 1;
    while (n < 4 && M * K * 2 > (1 << 20) && nblocks / (2 * n) >= 2 * nthreads) n *= 2;
    return n;
}

// y[M, y_cols] = x[M, K] bf16 · Wᵀ on the tile unit, as fp32 or bf16 (y_bf16). K and the group size must be
// even; for dense bf16 weights (bits 16, read in place) K a multiple of TK. Returns -1 if out of memory.
int slimlm_quant_matmul_amx(int bits, const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                            const uint16_t *scales, const uint8_t *zeros, int64_t nblocks, int64_t group,
                            void *y, int64_t y_cols, int y_bf16, int nthreads) {
    // x copied into tiles, with zero rows up to whole tiles and zero inputs up to whole tile steps: each TM × TK
    // tile 1 KB in one piece, a row tile's tiles one after another (the tile at rows m, inputs k starts at
    // m·Kp + k·TM). A tile load then reads 16 consecutive cache lines, where 16 rows of x lie 2·K bytes apart
    // (16 pages for a down_proj's K of 8960).
    const int64_t G = K / group, Mp = (M + TM - 1) / TM * TM, Kp = (K + TK - 1) / TK * TK;
    uint16_t *xp = aligned_alloc(64, sizeof(uint16_t) * Mp * Kp);
    if (xp == NULL) return -1;
    // (One 64-byte move per tile row, by all threads: 9 MB for 512 rows of a down_proj.)
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < Mp; m++)
        for (int64_t k = 0; k < Kp; k += TK) {
            const int64_t n = m < M ? (K - k < TK ? K - k : TK) : 0;
            const __mmask32 real = n == TK ? ~(__mmask32)0 : ((__mmask32)1 << n) - 1;
            uint16_t *tile_row = xp + (m - m % TM) * Kp + k * TM + m % TM * TK;
            _mm512_store_si512(tile_row, _mm512_maskz_loadu_epi16(real, x + m * K + k));
        }
    const int64_t parts = row_parts(nblocks, Mp, TM, nthreads), part_rows = (Mp / TM + parts - 1) / parts * TM;
    const int64_t together = parts == 1 ? amx_group(Mp, Kp, nblocks, nthreads) : 1;
    // one row tile of codes (amx_code_row_tile) where the segments are whole tile steps: Σ x per segment
    const int64_t seg = segment(group), S = K / seg;
    float *xs = NULL;
    if (Mp == TM && bits != 16 && seg % TK == 0 && (xs = segment_sums(x, M, K, seg)) == NULL) {
        free(xp);
        return -1;
    }
    const int64_t groups = (nblocks + together - 1) / together, buf_step = KC / 2 * 4, acc_step = BN * part_rows;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(|| : failed)
    {
        float *acc = aligned_alloc(64, sizeof(float) * acc_step * together);
        __m512i *buf = aligned_alloc(64, sizeof(__m512i) * buf_step * together);
        failed = acc == NULL || buf == NULL;
        if (!failed) configure_tiles();
#pragma omp for collapse(2) schedule(static)
        for (int64_t gb = 0; gb < groups; gb++) {
            for (int64_t part = 0; part < parts; part++) {
                const int64_t m0 = part * part_rows, m1 = m0 + part_rows < Mp ? m0 + part_rows : Mp;
                const int64_t nb0 = gb * together, n = nblocks - nb0 < together ? nblocks - nb0 : together;
                if (failed || m0 >= M) continue;
                const int64_t step = bits == 16 ? KC_DENSE : KC;
                for (int64_t k0 = 0; m1 - m0 > TM && k0 < K; k0 += step) {
                    const int64_t kc = K - k0 < step ? K - k0 : step;
                    const __m512i *wt = buf;  // dense bf16 weights are read in place (K a multiple of TK)
                    if (bits == 16) wt = (const __m512i *)(codes + (nb0 * K + k0) * (BN * 2));
                    for (int64_t b = 0; bits != 16 && b < n; b++)
                        dequantize_tiles(bits, group, codes + (nb0 + b) * K * (BN * bits / 8),
                                         scales + (nb0 + b) * G * BN, zeros + (nb0 + b) * G * BN, k0, kc,
                                         buf + b * buf_step);
                    amx_chunk(m1 - m0, xp + m0 * Kp + k0 * TM, Kp, (kc + TK - 1) / TK * TK, wt,
                              bits == 16 ? K * 2 : buf_step, acc, acc_step, n, k0 == 0);
                }
                for (int64_t nb = nb0; nb < nb0 + n; nb++) {
                    float *a = acc + (nb - nb0) * acc_step;
                    if (m1 - m0 == TM && bits == 16)
                        amx_row_tile(xp + m0 * Kp, K, (const __m512i *)(codes + nb * K * (BN * 2)), a, 1);
                    else if (m1 - m0 == TM && xs != NULL)
                        amx_code_row_tile(bits, group, seg, codes + nb * K * (BN * bits / 8), scales + nb * G * BN,
                                          zeros + nb * G * BN, K, xp + m0 * Kp, M - m0, xs + m0 * S, S, buf, a);
                    else if (m1 - m0 == TM)
                        amx_streamed_row_tile(bits, group, codes + nb * K * (BN * bits / 8), scales + nb * G * BN,
                                              zeros + nb * G * BN, K, xp + m0 * Kp, buf, a);
                    write_block(a, m0, m1 < M ? m1 : M, y, y_cols, y_bf16, nb * BN);
                }
            }
        }
        if (!failed) _tile_release();
        free(buf);
        free(acc);
    }
    free(xs);
    free(xp);
    return failed ? -1 : 0;
}
#endif

#endif

// Literal `bits` and `rows` let the compiler specialise and unroll each tile (registers, not memory).
#define TILE(B, R) tile(B, R, xr, K, group, c, s, z, yr, N)

void slimlm_quant_matmul(int bits, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                         const uint16_t *scales, const uint8_t *zeros, int64_t nblocks, int64_t group,
                         float *y, int nthreads) {
    const int64_t N = nblocks * BN, G = K / group, mblocks = (M + MB - 1) / MB;
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
            if (bits == 4) {
                switch (rows) {
                    case 1: TILE(4, 1); break;
                    case 2: TILE(4, 2); break;
                    case 3: TILE(4, 3); break;
                    case 4: TILE(4, 4); break;
                    case 5: TILE(4, 5); break;
                    default: TILE(4, 6);
                }
            } else if (bits == 32) {
                switch (rows) {
                    case 1: TILE(32, 1); break;
                    case 2: TILE(32, 2); break;
                    case 3: TILE(32, 3); break;
                    case 4: TILE(32, 4); break;
                    case 5: TILE(32, 5); break;
                    default: TILE(32, 6);
                }
            } else {
                switch (rows) {
                    case 1: TILE(8, 1); break;
                    case 2: TILE(8, 2); break;
                    case 3: TILE(8, 3); break;
                    case 4: TILE(8, 4); break;
                    case 5: TILE(8, 5); break;
                    default: TILE(8, 6);
                }
            }
        }
    }
}
#endif
