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
#include <immintrin.h>

#define BN 64  // output features per block (packed.BLOCK_N)
#define MB 4   // rows of x per register tile

int slimlm_vector_bits(void) { return 512; }

static inline __attribute__((always_inline)) void
weights_at(int bits, const uint8_t *c, const __m512 s[4], const __m512 zs[4], __m512 w[4]) {
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

static inline __attribute__((always_inline)) void
tile(int bits, int rows, const float *x, int64_t K, int64_t group, const uint8_t *codes,
     const uint16_t *scales, const uint8_t *zeros, float *y, int64_t N) {
    const int64_t row_bytes = BN * bits / 8;
    __m512 acc[MB][4];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / group; g++) {
        __m512 s[4], zs[4];
        for (int i = 0; i < 4; i++) {
            s[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * BN + 16 * i)));
            const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zeros + g * BN + 16 * i))));
            zs[i] = _mm512_mul_ps(z, s[i]);
        }
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
            __m512 w[4];
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

// Weight blocks [b0, b1) dequantized to bf16, written k-major into out [K, (b1 − b0)·BN]: the large-M path
// hands this to torch's bf16 matmul, which beats any FMA loop once x has more than a few rows.
void slimlm_dequantize(int bits, int64_t K, const uint8_t *codes, const uint16_t *scales,
                       const uint8_t *zeros, int64_t b0, int64_t b1, int64_t group, uint16_t *out,
                       int nthreads) {
    const int64_t G = K / group, row_bytes = BN * bits / 8, width = (b1 - b0) * BN;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t nb = b0; nb < b1; nb++) {
        for (int64_t g = 0; g < G; g++) {
            __m512 s[4], zs[4];
            for (int i = 0; i < 4; i++) {
                s[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + (nb * G + g) * BN + 16 * i)));
                const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zeros + (nb * G + g) * BN + 16 * i))));
                zs[i] = _mm512_mul_ps(z, s[i]);
            }
            for (int64_t k = g * group; k < (g + 1) * group; k++) {
                __m512 w[4];
                weights_at(bits, codes + (nb * K + k) * row_bytes, s, zs, w);
                uint16_t *o = out + k * width + (nb - b0) * BN;
                for (int i = 0; i < 4; i++) {
                    // round to nearest even, as torch's float -> bfloat16
                    __m512i u = _mm512_castps_si512(w[i]);
                    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
                    _mm256_storeu_si256((__m256i *)(o + 16 * i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
                }
            }
        }
    }
}
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
                    default: TILE(4, 4);
                }
            } else {
                switch (rows) {
                    case 1: TILE(8, 1); break;
                    case 2: TILE(8, 2); break;
                    case 3: TILE(8, 3); break;
                    default: TILE(8, 4);
                }
            }
        }
    }
}
#endif
