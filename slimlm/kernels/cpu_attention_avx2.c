// The paged decode attention of cpu_attention.c for CPUs with AVX2 and FMA but no AVX-512: same arguments,
// same exported symbol, the same one task per (sequence, KV head), 8 lanes instead of 16. AVX2 has no
// scalef or mask registers, so 2^n is built in the exponent bits and the ragged tail of a score row is
// handled with maskload/maskstore.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "slimlm_kernels.h"

#define MAX_GROUP 16
#define MAX_DIM 256

#define ELEM(kind) ((kind) == KIND_F32 ? 4 : (kind) == KIND_BF16 ? 2 : 1)
#define HEAD_BYTES(kind, D) ((kind) == KIND_INT4 ? (D) / 2 + 4 : (D) * ELEM(kind))

// 8 cache values as fp32 (before any scale), as cpu_attention.c's load16 widens them
static inline __attribute__((always_inline)) __m256 load8(const void *p, int kind) {
    if (kind == KIND_F32) return _mm256_loadu_ps(p);
    if (kind == KIND_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    if (kind == KIND_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m256i x = _mm256_cvtepu8_epi32(bytes), em = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 small = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.f / 512));
    const __m256 v = _mm256_blendv_ps(normal, small, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em)));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __attribute__((always_inline)) float dot(const float *a, const void *b, int64_t d, int kind) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // two chains: FMA latency, not throughput
    for (int64_t i = 0; i < d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8((const char *)b + i * ELEM(kind), kind), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8((const char *)b + (i + 8) * ELEM(kind), kind), acc1);
    }
    return sum8(_mm256_add_ps(acc0, acc1));
}

// A 4-bit row's 16 codes from 8 bytes: the low nibbles (elements i..i+7) and the high ones (D/2 + i..).
static inline __attribute__((always_inline)) void load_nibbles(const char *p, __m256 *lo, __m256 *hi) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
}

// q·x̂ for a 4-bit row: step·(q·codes) + lo·Σq (formats/kv_int4.py; the fp16 step and lo after the codes)
static inline __attribute__((always_inline)) float dot_int4(const float *q, const char *k, int64_t d, float qsum) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), lo, hi;
    for (int64_t i = 0; i < d / 2; i += 8) {
        load_nibbles(k + i, &lo, &hi);
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), lo, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d / 2 + i), hi, acc1);
    }
    uint16_t meta[2];
    memcpy(meta, k + d / 2, sizeof meta);
    return _cvtsh_ss(meta[0]) * sum8(_mm256_add_ps(acc0, acc1)) + _cvtsh_ss(meta[1]) * qsum;
}

// e^x for x <= 0, to float precision: 2^(x·log2 e) split into an integer power n, put into the exponent
// bits, and a fraction f in [-0.5, 0.5] whose 2^f is Cephes' exp2f polynomial. x is clamped at -87 so that
// 2^n stays a normal float (e^-87 ≈ 1.6e-38 against a largest term of 1: nothing in this sum).
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// q, out [S, Hq, D] fp32; caches [blocks, block_size, Hkv, D] fp32 or (bf16 = 1) bf16; tables [S, width].
// D a multiple of 16, <= MAX_DIM; Hq / Hkv <= MAX_GROUP. Returns 0, or -1 when a task got no score buffer.
// amx: unused (the AVX-512 kernel's tile path; no CPU with AMX lacks AVX-512). Cache kinds and scales as
// there.
static inline __attribute__((always_inline)) int
attend_head(const float *q, const void *k_cache, const void *v_cache, int kind, const float *k_scale,
            const float *v_scale, const int32_t *tables, int64_t width, const int32_t *seq_lens, int64_t s, int64_t h,
            int64_t Hq, int64_t G, int64_t D, int64_t Hkv, int64_t block_size, float scale, float *out) {
    const int64_t head = HEAD_BYTES(kind, D), L = seq_lens[s];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float *scores = malloc(sizeof(float) * G * L);
    if (!scores) return -1;
    const float *qh = q + (s * Hq + h * G) * D;
    if (k_scale) scale *= k_scale[h];
    float top[MAX_GROUP], total[MAX_GROUP], qsum[MAX_GROUP] = {0}, shift[MAX_GROUP] = {0};
    for (int64_t g = 0; g < G; g++) top[g] = -INFINITY;
    for (int64_t g = 0; kind == KIND_INT4 && g < G; g++)  // Σq: a 4-bit key's minimum times it
        for (int64_t d = 0; d < D; d++) qsum[g] += qh[g * D + d];
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {  // block by block: no division per token
        const char *k = (const char *)k_cache +
                        ((int64_t)tables[s * width + t0 / block_size] * block_size * Hkv + h) * head;
        for (int64_t t = t0; t < t0 + block_size && t < L; t++, k += Hkv * head) {
            for (int64_t g = 0; g < G; g++) {
                const float x = (kind == KIND_INT4 ? dot_int4(qh + g * D, k, D, qsum[g]) : dot(qh + g * D, k, D, kind))
                                * scale;
                scores[g * L + t] = x;
                if (x > top[g]) top[g] = x;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *row = scores + g * L;
        const __m256 shift = _mm256_set1_ps(top[g]);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < L; t += 8) {
            const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(L - t)), lane);
            const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(row + t, m), shift)),
                                           _mm256_castsi256_ps(m));
            _mm256_maskstore_ps(row + t, m, p);
            sum = _mm256_add_ps(sum, p);
        }
        total[g] = sum8(sum);
    }
    __m256 acc[MAX_GROUP][MAX_DIM / 8];
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < D / 8; i++) acc[g][i] = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const char *v = (const char *)v_cache +
                        ((int64_t)tables[s * width + t0 / block_size] * block_size * Hkv + h) * head;
        for (int64_t t = t0; t < t0 + block_size && t < L; t++, v += Hkv * head) {
            if (kind == KIND_INT4) {  // Σ p·x̂ = Σ (p·step)·code + Σ p·lo
                __m256 vr[MAX_DIM / 8];
                for (int64_t i = 0; i < D / 16; i++) load_nibbles(v + 8 * i, &vr[i], &vr[D / 16 + i]);
                uint16_t meta[2];
                memcpy(meta, v + D / 2, sizeof meta);
                const float step = _cvtsh_ss(meta[0]), lo = _cvtsh_ss(meta[1]);
                for (int64_t g = 0; g < G; g++) {
                    const __m256 w = _mm256_set1_ps(scores[g * L + t] * step);
                    for (int64_t i = 0; i < D / 8; i++) acc[g][i] = _mm256_fmadd_ps(w, vr[i], acc[g][i]);
                    shift[g] += scores[g * L + t] * lo;
                }
                continue;
            }
            for (int64_t g = 0; g < G; g++) {
                const __m256 p = _mm256_set1_ps(scores[g * L + t]);
                for (int64_t i = 0; i < D / 8; i++)
                    acc[g][i] = _mm256_fmadd_ps(p, load8(v + 8 * i * ELEM(kind), kind), acc[g][i]);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const __m256 inv = _mm256_set1_ps((v_scale ? v_scale[h] : 1.f) / total[g]);
        float *o = out + (s * Hq + h * G + g) * D;
        const __m256 add = _mm256_set1_ps(shift[g]);  // zero but for a 4-bit cache
        for (int64_t i = 0; i < D / 8; i++)
            _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(kind == KIND_INT4 ? _mm256_add_ps(acc[g][i], add) : acc[g][i], inv));
    }
    free(scores);
    return 0;
}

int slimlm_paged_decode(const float *q, const void *k_cache, const void *v_cache, int kind, const float *k_scale,
                        const float *v_scale, const int32_t *tables, int64_t width, const int32_t *seq_lens, int64_t S,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, float scale, int amx, float *out,
                        int nthreads) {
    (void)amx;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nthreads)
    for (int64_t s = 0; s < S; s++) {
        for (int64_t h = 0; h < Hkv; h++) {
#define ATTEND(KIND) attend_head(q, k_cache, v_cache, KIND, k_scale, v_scale, tables, width, seq_lens, s, h, Hq, \
                                 Hq / Hkv, D, Hkv, block_size, scale, out)
            // a literal kind for each: its own loops
            const int status = kind == KIND_F32 ? ATTEND(KIND_F32) : kind == KIND_BF16 ? ATTEND(KIND_BF16)
                             : kind == KIND_INT8 ? ATTEND(KIND_INT8) : kind == KIND_INT4 ? ATTEND(KIND_INT4)
                             : ATTEND(KIND_FP8);
#undef ATTEND
            if (status) failed = 1;
        }
    }
    return failed ? -1 : 0;
}
#endif
