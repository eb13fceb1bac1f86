// The one interface between slimlm's C files: which kernels a build holds (from the target's instruction sets,
// gcc's -march), what a KV cache holds, and the functions one file calls in another. Every C file includes it,
// so a definition that drifts from its declaration does not compile; cpu_attention.py's KINDS is checked
// against the enum (tests/kernels/test_cpu_library.py).
#ifndef SLIMLM_KERNELS_H
#define SLIMLM_KERNELS_H
#include <stdint.h>

// The bf16 GEMM (cpu_gemm.c) needs the bf16 dot product (AVX-512 BF16) and VBMI's byte permute, which gathers
// 4-bit codes into pairs. Cooper Lake has the first without the second: it runs the AVX-512 fp32 loops, as
// AVX-512 CPUs without BF16 do.
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define SLIMLM_BF16_GEMM 1
#endif

// What a KV cache holds: the step's float dtype, 8-bit codes with a scale per head, or 4-bit rows
// (formats/kv_int4.py); cpu_attention.KINDS maps torch dtypes to these.
enum { KIND_F32, KIND_BF16, KIND_INT8, KIND_FP8, KIND_INT4 };

// cpu_gemm.c (AVX-512) or cpu_gemm_avx2.c (AVX2): y = x · Wᵀ with W packed (packed.py)
void slimlm_quant_matmul(int bits, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                         const uint16_t *scales, const uint8_t *zeros, int64_t nblocks, int64_t group, float *y,
                         int nthreads);
#ifdef SLIMLM_BF16_GEMM
int slimlm_quant_matmul_bf16(int bits, const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                             const uint16_t *scales, const uint8_t *zeros, int64_t nblocks, int64_t group,
                             void *y, int64_t y_cols, int y_bf16, int64_t code_rows, int nthreads);
int slimlm_quant_matmul_amx(int bits, const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                            const uint16_t *scales, const uint8_t *zeros, int64_t nblocks, int64_t group,
                            void *y, int64_t y_cols, int y_bf16, int nthreads);  // only where AMX was built
#else
int slimlm_quant_matmul_i8(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scales,
                           const uint8_t *zeros, int64_t nblocks, int64_t group, float *y, int nthreads);
#endif
int slimlm_paged_decode(const float *q, const void *k_cache, const void *v_cache, int kind, const float *k_scale,
                        const float *v_scale, const int32_t *tables, int64_t width, const int32_t *seq_lens, int64_t S,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, float scale, int amx, float *out,
                        int nthreads);  // cpu_attention.c / cpu_attention_avx2.c: one decode query per sequence

#endif
