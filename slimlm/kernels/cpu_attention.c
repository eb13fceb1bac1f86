// Paged decode attention for CPUs, fp32 or bf16 cache (fp32 arithmetic): one query per sequence, keys and values read in place
// through the block table (no gathered copy), each KV head read once for its whole query group (GQA).
//
// Why not torch: a decode step's attention is dozens of tiny batched matmuls whose per-call and per-batch
// overhead dwarfs the arithmetic (measured: ~1.6 ms per layer at 32 sequences of 131 tokens, against
// ~0.1 ms of memory traffic). Here one OpenMP task per (sequence, KV head) computes all scores of its
// query group, a softmax, and the weighted sum of values, with AVX-512 along the head dimension.
#ifdef __AVX512F__  // cpu_attention_avx2.c otherwise
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>

#define MAX_GROUP 16
#define MAX_DIM 256

// 16 cache values as fp32: bf16 is the top half of an fp32, so widening is a shift
static inline __m512 load16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline float dot(const float *a, const void *b, int64_t d, int bf16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16((const char *)b + i * (bf16 ? 2 : 4), bf16), acc);
    return _mm512_reduce_add_ps(acc);
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

// q, out [S, Hq, D] fp32; caches [blocks, block_size, Hkv, D] fp32 or (bf16 = 1) bf16; tables [S, width].
// D a multiple of 16, <= MAX_DIM; Hq / Hkv <= MAX_GROUP. Returns 0, or -1 when a task got no score buffer.
int slimlm_paged_decode(const float *q, const void *k_cache, const void *v_cache, int bf16, const int32_t *tables,
                        int64_t width, const int32_t *seq_lens, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                        int64_t block_size, float scale, float *out, int nthreads) {
    const int64_t G = Hq / Hkv, elem = bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nthreads)
    for (int64_t s = 0; s < S; s++) {
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t L = seq_lens[s];
            float *scores = malloc(sizeof(float) * G * L);
            if (!scores) {
                failed = 1;
                continue;
            }
            const float *qh = q + (s * Hq + h * G) * D;
            float top[MAX_GROUP], total[MAX_GROUP];
            for (int64_t g = 0; g < G; g++) top[g] = -INFINITY;
            for (int64_t t0 = 0; t0 < L; t0 += block_size) {  // block by block: no division per token
                const char *k = (const char *)k_cache +
                                ((int64_t)tables[s * width + t0 / block_size] * block_size * Hkv + h) * D * elem;
                for (int64_t t = t0; t < t0 + block_size && t < L; t++, k += Hkv * D * elem) {
                    for (int64_t g = 0; g < G; g++) {
                        const float x = dot(qh + g * D, k, D, bf16) * scale;
                        scores[g * L + t] = x;
                        if (x > top[g]) top[g] = x;
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *row = scores + g * L;
                const __m512 shift = _mm512_set1_ps(top[g]);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t t = 0; t < L; t += 16) {
                    const __mmask16 m = L - t >= 16 ? 0xFFFF : (__mmask16)((1u << (L - t)) - 1);
                    const __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), shift));
                    _mm512_mask_storeu_ps(row + t, m, p);
                    sum = _mm512_mask_add_ps(sum, m, sum, p);
                }
                total[g] = _mm512_reduce_add_ps(sum);
            }
            __m512 acc[MAX_GROUP][MAX_DIM / 16];
            for (int64_t g = 0; g < G; g++)
                for (int64_t i = 0; i < D / 16; i++) acc[g][i] = _mm512_setzero_ps();
            for (int64_t t0 = 0; t0 < L; t0 += block_size) {
                const char *v = (const char *)v_cache +
                                ((int64_t)tables[s * width + t0 / block_size] * block_size * Hkv + h) * D * elem;
                for (int64_t t = t0; t < t0 + block_size && t < L; t++, v += Hkv * D * elem) {
                    for (int64_t g = 0; g < G; g++) {
                        const __m512 p = _mm512_set1_ps(scores[g * L + t]);
                        for (int64_t i = 0; i < D / 16; i++)
                            acc[g][i] = _mm512_fmadd_ps(p, load16(v + 16 * i * elem, bf16), acc[g][i]);
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                const __m512 inv = _mm512_set1_ps(1.f / total[g]);
                float *o = out + (s * Hq + h * G + g) * D;
                for (int64_t i = 0; i < D / 16; i++) _mm512_storeu_ps(o + 16 * i, _mm512_mul_ps(acc[g][i], inv));
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}
#endif
