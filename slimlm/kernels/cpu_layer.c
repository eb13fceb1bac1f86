// The small per-layer operations of a step, each in one call: the residual add with the RMSNorm that follows
// it, the rotary embedding of q and k with the KV-cache write, and SiLU(gate)·up. At batch 1 each is a few thousand
// flops, and as PyTorch operators they were ~15 calls a layer at ~3-10 µs each: a third of the step
// (measured, benchmarks/decode_overhead.py). Plain C (the compiler vectorizes it); fp32 or bf16 tensors.
//
// Every result is rounded as the PyTorch reference (kernels/reference.py) rounds it, operation by
// operation: a bf16 op computes in fp32 and rounds to nearest even, and no multiply is fused with an add
// (hence fp-contract off below), so the rotary kernel's outputs equal the reference's bit for bit. The
// norm's sum of squares is accumulated in double: it differs from torch's fp32 reduction in the last bit.
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>  // F16C's fp16 conversions (a 4-bit KV row's step and minimum)
#include "slimlm_kernels.h"

static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t to_bf16(float f) {  // round to nearest even, as torch converts
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);  // a NaN stays a (quiet) NaN
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(v);
    else ((float *)p)[i] = v;
}

static inline float rounded(float v, int bf16) { return bf16 ? from_bf16(to_bf16(v)) : v; }

#define MAX_KV_BYTES (16 * 256 * 4)  // a token's rotated keys before they are quantized: kv_heads·dim at most 16·256

// One row of slimlm_add_rms_norm, for a literal dtype
static inline __attribute__((always_inline)) void add_rms_norm_row(const void *x, void *residual, const void *weight,
                                                                   void *out, int64_t base, int64_t dim, float eps,
                                                                   int bf16) {
    double squares = 0.0;
#pragma omp simd reduction(+ : squares)  // squares are exact in double: the order moves only bits far below fp32
    for (int64_t i = 0; i < dim; i++) {
        float h = load(x, base + i, bf16);
        if (residual) {
            h = rounded(h + load(residual, base + i, bf16), bf16);
            store(residual, base + i, h, bf16);
        }
        squares += (double)h * h;
    }
    const float inv = 1.0f / sqrtf((float)(squares / (double)dim) + eps);
    const void *h = residual ? residual : x;
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        const float normed = rounded(load(h, base + i, bf16) * inv, bf16);
        store(out, base + i, load(weight, i, bf16) * normed, bf16);
    }
}

// The kernels below branch on the dtype inside their parallel loops, each branch passing a literal: OpenMP
// outlines a loop body before anything is inlined into it, so a literal given to a function that holds the
// pragma reaches the loop as a variable, and the vector loop then handles both dtypes (SiLU·up ran 2.2×
// slower that way).

// Per row: h = x + residual (rounded; written back into residual), or h = x when residual is NULL;
// out = weight · (h / sqrt(mean(h²) + eps)), normalized in fp32, rounded, then scaled and rounded.
void slimlm_add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                         float eps, int bf16, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) add_rms_norm_row(x, residual, weight, out, r * dim, dim, eps, 1);
        else add_rms_norm_row(x, residual, weight, out, r * dim, dim, eps, 0);
    }
}

// out[i] = x[i]·cos[i] + partner[i]·sin[i] for i < n (pointers in elements of the dtype), products rounded
static inline __attribute__((always_inline)) void rotate_part(const void *x, const void *partner, const void *cos,
                                                              const void *sin, void *out, int64_t n, int bf16) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float a = rounded(load(x, i, bf16) * load(cos, i, bf16), bf16);
        const float b = rounded(load(partner, i, bf16) * load(sin, i, bf16), bf16);
        store(out, i, a + b, bf16);
    }
}

// x·cos + roll(x, D/2)·sin for one head at x (sin with its first half negated, as the model's tables hold
// it): the two halves, each with the other as its partner, so the loops vectorize
static inline __attribute__((always_inline)) void rotate(const char *x, const char *cos, const char *sin, char *out,
                                                         int64_t dim, int bf16) {
    const int64_t half = dim / 2 * (bf16 ? 2 : 4);
    rotate_part(x, x + half, cos, sin, out, dim / 2, bf16);
    rotate_part(x + half, x, cos + half, sin + half, out + half, dim / 2, bf16);
}

#define INT4_ROW(dim) ((dim) / 2 + 4)  // bytes of a 4-bit row: the codes, then the fp16 step and minimum

// x / scale as quantized_kv stores it: divided in fp32, clamped to ±127 (int8) or ±448 (fp8), then rounded to
// the nearest code, ties to even: an integer, or an fp8 e4m3 (a subnormal below 2⁻⁶, in steps of 2⁻⁹; else
// the float's mantissa rounded to 3 bits, as torch's conversion rounds it). A NaN stays NaN (fp8 0x7F).
static inline uint8_t quantized(float x, float scale, int kind) {
    float v = x / scale;
    const float limit = kind == KIND_INT8 ? 127.f : 448.f;
    v = v < -limit ? -limit : (v > limit ? limit : v);
    if (kind == KIND_INT8) return (uint8_t)(int8_t)rintf(v);
    union { float f; uint32_t u; } b = {v};
    const uint32_t sign = (b.u >> 24) & 0x80, a = b.u & 0x7FFFFFFF;
    if (a > 0x7F800000u) return 0x7F;  // NaN
    if (a < (121u << 23)) {  // below 2⁻⁶
        union { uint32_t u; float f; } m = {a};
        return (uint8_t)(sign | (uint32_t)rintf(m.f * 512.f));
    }
    return (uint8_t)(sign | ((a + 0x7FFFF + ((a >> 20) & 1) - (120u << 23)) >> 20));
}

// y = (x − offset)·H for one head's dim values x of the step's dtype at src (offset NULL: none), H [dim, dim],
// in fp32. The sums run in another order than torch's matmul: a value on a rounding boundary can round the
// other way.
static void times_rotation(const char *src, int bf16, int64_t dim, const float *offset, const float *rotation,
                           float *y) {
    float x[256];
    for (int64_t d = 0; d < dim; d++) x[d] = load(src, d, bf16) - (offset ? offset[d] : 0.f);
    for (int64_t j = 0; j < dim; j++) y[j] = 0.f;
    for (int64_t d = 0; d < dim; d++)
        for (int64_t j = 0; j < dim; j++) y[j] += x[d] * rotation[d * dim + j];
}

// One K or V vector of a KV head (dim values of the step's dtype at src) as a 4-bit row (formats/kv_int4.py): less
// `offset` (NULL: none), times the rotation H [dim, dim], then 16 levels from its minimum to its maximum, each
// step of the way rounded as kv_int4.quantize rounds it; dim/2 bytes of codes (code j low, code j + dim/2 high),
// then the fp16 step and minimum.
static void int4_row(const char *src, int bf16, int64_t dim, const float *offset, const float *rotation,
                     uint8_t *row) {
    float y[256];
    times_rotation(src, bf16, dim, offset, rotation, y);
    float lo = y[0], hi = y[0];
    for (int64_t j = 1; j < dim; j++) lo = y[j] < lo ? y[j] : lo, hi = y[j] > hi ? y[j] : hi;
    const uint16_t lo_h = _cvtss_sh(lo, _MM_FROUND_TO_NEAREST_INT);
    const float lo16 = _cvtsh_ss(lo_h);
    const uint16_t step_h = _cvtss_sh((hi - lo16) / 15.f, _MM_FROUND_TO_NEAREST_INT);
    const float step = _cvtsh_ss(step_h);
    uint8_t codes[256];
    for (int64_t j = 0; j < dim; j++) {
        const float c = step > 0.f ? rintf((y[j] - lo16) / step) : 0.f;
        codes[j] = (uint8_t)(c < 0.f ? 0.f : (c > 15.f ? 15.f : c));
    }
    for (int64_t j = 0; j < dim / 2; j++) row[j] = (uint8_t)(codes[j] | codes[j + dim / 2] << 4);
    memcpy(row + dim / 2, &step_h, 2), memcpy(row + dim / 2 + 2, &lo_h, 2);
}

// One row of slimlm_rotary_kv_write, for a literal dtype: q rotated into q; k rotated and v copied into the
// cache rows k, v, or quantized there with their heads' scales (8-bit kinds; NULL: 1; keys less k_offset when
// given, then times `rotation` when given (fp8: formats/kv_cache.py), and q too; tmp: kv_heads·dim scratch).
static inline __attribute__((always_inline)) void rotary_row(const char *x, int64_t heads, int64_t kv_heads,
                                                             int64_t dim, const char *cos, const char *sin, char *k,
                                                             char *v, char *q, int bf16, int kind,
                                                             const float *k_scale, const float *v_scale, char *tmp,
                                                             const float *k_offset, const float *rotation) {
    const int64_t head = dim * (bf16 ? 2 : 4);
    for (int64_t h = 0; h < heads; h++) rotate(x + h * head, cos, sin, q + h * head, dim, bf16);
    if (kind == KIND_INT4) {  // keys rotated into tmp, then each head's key and value as a 4-bit row
        const int64_t row = INT4_ROW(dim);
        for (int64_t h = 0; h < kv_heads; h++) {
            rotate(x + (heads + h) * head, cos, sin, tmp + h * head, dim, bf16);
            int4_row(tmp + h * head, bf16, dim, k_offset ? k_offset + h * dim : NULL, rotation, (uint8_t *)k + h * row);
            int4_row(x + (heads + kv_heads + h) * head, bf16, dim, NULL, rotation, (uint8_t *)v + h * row);
        }
        return;
    }
    const int quantize = kind == KIND_INT8 || kind == KIND_FP8;
    for (int64_t h = 0; h < kv_heads; h++) rotate(x + (heads + h) * head, cos, sin, (quantize ? tmp : k) + h * head, dim, bf16);
    if (!quantize) {
        memcpy(v, x + (heads + kv_heads) * head, kv_heads * head);
        return;
    }
    if (rotation) {  // keys, less their offsets, into fp32 in tmp; queries in place
        float y[256];
        for (int64_t h = 0; h < heads; h++) {
            times_rotation(q + h * head, bf16, dim, NULL, rotation, y);
            for (int64_t j = 0; j < dim; j++) store(q + h * head, j, y[j], bf16);
        }
        for (int64_t h = kv_heads - 1; h >= 0; h--)  // from the last head: each reads only what it overwrites
            times_rotation(tmp + h * head, bf16, dim, k_offset ? k_offset + h * dim : NULL, rotation,
                           (float *)tmp + h * dim);
    }
    for (int64_t i = 0; i < kv_heads * dim; i++) {
        const float key = rotation ? ((float *)tmp)[i] : load(tmp, i, bf16) - (k_offset ? k_offset[i] : 0.f);
        k[i] = (char)quantized(key, k_scale ? k_scale[i / dim] : 1.f, kind);
        v[i] = (char)quantized(load(x + (heads + kv_heads) * head, i, bf16), v_scale ? v_scale[i / dim] : 1.f, kind);
    }
}

// qkv [rows, (heads + 2·kv_heads)·dim]: q rotated into q_out [rows, heads, dim]; k rotated and v copied into
// the caches' slot slots[r] (caches [slots, kv_heads, dim]: qkv's dtype, or 8-bit codes of `kind` with
// k_scale, v_scale [kv_heads], NULL for 1; or 4-bit rows [slots, kv_heads, dim/2 + 4], both through `rotation`
// [dim, dim]); quantized keys less k_offset [kv_heads, dim] (NULL: none). cos, sin [rows, dim].
void slimlm_rotary_kv_write(const void *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                            const void *cos, const void *sin, const int64_t *slots, void *k_cache, void *v_cache,
                            void *q_out, int bf16, int kind, const float *k_scale, const float *v_scale,
                            const float *k_offset, const float *rotation, int nthreads) {
    const int64_t elem = bf16 ? 2 : 4, row = (heads + 2 * kv_heads) * dim * elem, head = dim * elem;
    const int64_t cached = kind == KIND_INT4 ? kv_heads * INT4_ROW(dim)  // bytes a slot
                           : kv_heads * dim * (kind == KIND_INT8 || kind == KIND_FP8 ? 1 : elem);
#pragma omp parallel for num_threads(nthreads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const char *x = (const char *)qkv + r * row, *c = (const char *)cos + r * head, *s = (const char *)sin + r * head;
        char *k = (char *)k_cache + slots[r] * cached, *v = (char *)v_cache + slots[r] * cached;
        char *q = (char *)q_out + r * heads * head, tmp[MAX_KV_BYTES];
        if (bf16) rotary_row(x, heads, kv_heads, dim, c, s, k, v, q, 1, kind, k_scale, v_scale, tmp, k_offset, rotation);
        else rotary_row(x, heads, kv_heads, dim, c, s, k, v, q, 0, kind, k_scale, v_scale, tmp, k_offset, rotation);
    }
}

// e^x in plain C that the compiler vectorizes (a loop of expf calls stays scalar): Cephes' expf, x = n·ln 2 + r
// with ln 2 in two parts (n·C1 exact) so r keeps its bits, e^r by its polynomial, 2^n from the exponent bits.
// Within a couple of units in the last place, as torch's own vectorized exp (Sleef) is: each rounds a few
// values the other way in the last bit.
static inline float exp_vectorizable(float x) {
    const float t = x * 1.44269504088896341f;
    const float n = rintf(t < -125.f ? -125.f : (t > 128.f ? 128.f : t));
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const union { uint32_t u; float f; } half_scale = {(uint32_t)((int32_t)n + 126) << 23};  // 2^(n-1): normal
    const float e = p * half_scale.f * 2.f;  // overflows to infinity where e^x does
    return t < -150.f ? 0.f : e;  // a NaN passes through as NaN
}

// silu(gate) · up of one row of gu = [gate | up], each op rounded as torch rounds it in the dtype
static inline __attribute__((always_inline)) void silu_row(const void *gate, const void *up, void *out,
                                                           int64_t width, int bf16) {
#pragma omp simd
    for (int64_t i = 0; i < width; i++) {
        const float g = load(gate, i, bf16), u = load(up, i, bf16);
        store(out, i, rounded(g / (1.0f + exp_vectorizable(-g)), bf16) * u, bf16);
    }
}

// log p(target), the largest log p and its token (the first of equal ones, as argmax) for one row of logits,
// in fp32 as torch's log_softmax computes them (x - max - log Σ e^(x - max)); the sum's parts are added in fp64,
// so that 152K terms lose nothing to its order.
static inline __attribute__((always_inline)) void logprob_row(const void *x, int64_t vocab, int bf16, int64_t target,
                                                              float *target_logprob, float *best_logprob, int64_t *best) {
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < vocab; i++) top = fmaxf(top, load(x, i, bf16));
    double sum = 0.0;
    for (int64_t i0 = 0; i0 < vocab; i0 += 2048) {  // fp32 sums of 2048 terms (vectorized), added in fp64
        const int64_t i1 = i0 + 2048 < vocab ? i0 + 2048 : vocab;
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int64_t i = i0; i < i1; i++) part += exp_vectorizable(load(x, i, bf16) - top);
        sum += part;
    }
    int64_t at = 0;
    while (at < vocab - 1 && load(x, at, bf16) != top) at++;
    const float norm = top + (float)log(sum);
    *target_logprob = load(x, target, bf16) - norm;
    *best_logprob = top - norm;
    *best = at;
}

// logprob_row for each row of logits [rows, vocab]: one read of the row for the maximum and one for the sum,
// instead of an fp32 copy, a log-softmax written out and a top-k.
void slimlm_row_logprobs(const void *logits, int64_t rows, int64_t vocab, int bf16, const int64_t *targets,
                         float *target_logprob, float *best_logprob, int64_t *best, int nthreads) {
    const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) if (rows >= 2)
    for (int64_t r = 0; r < rows; r++) {
        const void *x = (const char *)logits + r * vocab * elem;
        if (bf16) logprob_row(x, vocab, 1, targets[r], target_logprob + r, best_logprob + r, best + r);
        else logprob_row(x, vocab, 0, targets[r], target_logprob + r, best_logprob + r, best + r);
    }
}

void slimlm_silu_mul(const void *gu, void *out, int64_t rows, int64_t width, int bf16, int nthreads) {
    const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)gu + 2 * r * width * elem;
        if (bf16) silu_row(gate, gate + width * elem, (char *)out + r * width * elem, width, 1);
        else silu_row(gate, gate + width * elem, (char *)out + r * width * elem, width, 0);
    }
}

// The whole-layer decode runs on the bf16 dot-product GEMM (cpu_gemm.c) or on AVX2's int8 and fp32 loops
// (cpu_gemm_avx2.c); AVX-512 CPUs without BF16 run the modules.
#if defined(SLIMLM_BF16_GEMM) || (defined(__AVX2__) && !defined(__AVX512F__))
#include <stdlib.h>

// One packed linear, as cpu_gemm.quant_matmul would call it for this many rows (the loop chosen in Python),
// and its bias in the step's dtype (NULL for none: Qwen2's q/k/v have one)
typedef struct {
    const void *codes, *scales, *zeros;
    int64_t blocks, group, bits, in_features, out_features, code_rows;
    int64_t loop;  // 0: bf16 x and y; 2: the fused fp32 loop (padded y);
                   // 3: bf16 x and y on the AMX tile unit; 4: AVX2's int8 loop (fp32 x, padded y)
    const void *bias;
} Linear;

// The loops that write fp32 into the padded width: AVX2's int8 loop (which allocates, so it may fail) and the
// fused fp32 loop.
static int padded_product(const Linear *w, const float *x, int64_t m, float *padded, int nthreads) {
#ifndef SLIMLM_BF16_GEMM
    if (w->loop == 4)
        return slimlm_quant_matmul_i8(x, m, w->in_features, w->codes, w->scales, w->zeros, w->blocks, w->group,
                                      padded, nthreads);
#endif
    slimlm_quant_matmul((int)w->bits, x, m, w->in_features, w->codes, w->scales, w->zeros, w->blocks, w->group,
                        padded, nthreads);
    return 0;
}

static int product(const Linear *w, const void *x, int64_t m, void *y, float *padded, int nthreads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (w->loop == 3)
        return slimlm_quant_matmul_amx((int)w->bits, x, m, w->in_features, w->codes, w->scales, w->zeros, w->blocks,
                                       w->group, y, w->out_features, 1, nthreads);
#endif
#ifdef SLIMLM_BF16_GEMM
    if (w->loop == 0)
        return slimlm_quant_matmul_bf16((int)w->bits, x, m, w->in_features, w->codes, w->scales, w->zeros, w->blocks,
                                        w->group, y, w->out_features, 1, w->code_rows, nthreads);
#endif
    if (padded_product(w, x, m, padded, nthreads)) return -1;
    for (int64_t r = 0; r < m; r++)  // drop the padding features
        memcpy((float *)y + r * w->out_features, padded + r * w->blocks * 64, sizeof(float) * w->out_features);
    return 0;
}

// y = x·Wᵀ + bias, the bias added to the rounded product and rounded again, as torch's `y + bias` does
static int linear(const Linear *w, const void *x, int64_t m, void *y, float *padded, int bf16, int nthreads) {
    if (product(w, x, m, y, padded, nthreads)) return -1;
    if (w->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < w->out_features; j++) {
                const int64_t i = r * w->out_features + j;
                store(y, i, load(y, i, bf16) + load(w->bias, j, bf16), bf16);
            }
    return 0;
}

// The intermediate results of one layer, for `rows` sequences: allocated once per step, used by every layer
typedef struct {
    char *h, *qkv, *q, *attn, *gu, *act;  // in the step's dtype
    float *qf, *padded;  // the attention's fp32 query and output; the fused fp32 loop's padded output
} Buffers;

// Built with -DSLIMLM_PHASE_TIMES (benchmarks/step_phases.py), decode_layer adds the seconds each of its calls
// takes to slimlm_phase_seconds, in call order; otherwise PHASE compiles to nothing.
#ifdef SLIMLM_PHASE_TIMES
#include <time.h>
double slimlm_phase_seconds[9];
#define PHASE_START struct timespec phase_t0; clock_gettime(CLOCK_MONOTONIC, &phase_t0)
#define PHASE(i)                                                                                    \
    do {                                                                                            \
        struct timespec t;                                                                          \
        clock_gettime(CLOCK_MONOTONIC, &t);                                                         \
        slimlm_phase_seconds[i] += (t.tv_sec - phase_t0.tv_sec) + 1e-9 * (t.tv_nsec - phase_t0.tv_nsec); \
        phase_t0 = t;                                                                               \
    } while (0)
#else
#define PHASE_START
#define PHASE(i)
#endif

// One decoder layer: its two RMSNorms' weights, its KV cache's per-head scales (8-bit caches; NULL for a float
// one) and its four packed linears (qkv, o, gate_up, down)
typedef struct {
    const void *norm1, *norm2;
    const float *k_scale, *v_scale;
    const float *k_offset, *rotation;  // what slimlm_rotary_kv_write takes for the keys (NULL: none)
    Linear w[4];
} Layer;

// A whole decoder layer for `rows` decoding sequences (one new token each), the calls the model's modules make
// in the same order: add + norm, q/k/v, rotary + KV write, paged attention, o, add + norm, gate/up, SiLU·up,
// down. x [rows, hidden] is the previous layer's output; residual the stream (updated in place; NULL for the
// first layer, whose stream is x itself); the layer's output goes to out. The caches hold `kind`.
// Returns 0, or -1 when out of memory.
static int decode_layer(void *x, void *residual, const Layer *layer, float eps, const void *cos, const void *sin,
                        const int64_t *slots, void *k_cache, void *v_cache, const int32_t *tables, int64_t width,
                        const int32_t *seq_lens, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t block_size, float scale, void *out, int bf16, int kind, int amx, int nthreads,
                        const Buffers *b) {
    const Linear *w = layer->w;
    const int64_t hidden = w[1].out_features, inter = w[3].in_features;
    PHASE_START;
    slimlm_add_rms_norm(x, residual, layer->norm1, b->h, rows, hidden, eps, bf16, nthreads);
    PHASE(0);
    if (!residual) residual = x;
    if (linear(&w[0], b->h, rows, b->qkv, b->padded, bf16, nthreads)) return -1;
    PHASE(1);
    slimlm_rotary_kv_write(b->qkv, rows, heads, kv_heads, dim, cos, sin, slots, k_cache, v_cache, b->q, bf16, kind,
                           layer->k_scale, layer->v_scale, layer->k_offset, layer->rotation, nthreads);
    PHASE(2);
    float *of = b->qf + rows * heads * dim;  // the attention kernel reads and writes fp32
    for (int64_t i = 0; i < rows * heads * dim; i++) b->qf[i] = load(b->q, i, bf16);
    if (slimlm_paged_decode(b->qf, k_cache, v_cache, kind, layer->k_scale, layer->v_scale, tables, width, seq_lens,
                            rows, heads, kv_heads, dim, block_size, scale, amx, of, nthreads))
        return -1;
    for (int64_t i = 0; i < rows * heads * dim; i++) store(b->attn, i, of[i], bf16);
    PHASE(3);
    if (linear(&w[1], b->attn, rows, out, b->padded, bf16, nthreads)) return -1;
    PHASE(4);
    slimlm_add_rms_norm(out, residual, layer->norm2, b->h, rows, hidden, eps, bf16, nthreads);
    PHASE(5);
    if (linear(&w[2], b->h, rows, b->gu, b->padded, bf16, nthreads)) return -1;
    PHASE(6);
    slimlm_silu_mul(b->gu, b->act, rows, inter, bf16, nthreads);
    PHASE(7);
    const int status = linear(&w[3], b->act, rows, out, b->padded, bf16, nthreads);
    PHASE(8);
    return status;
}

// A decode step through all n layers in one call (each ~30 µs of Python and ctypes less, measured).
// x [rows, hidden]: the embeddings, which become the residual stream (updated in place); the last layer's
// output goes to out, tmp (x's size) holds every other layer's. kv: the cache pool [n, 2, blocks,
// block_size, kv_heads, dim] of `kind`, layer_bytes apart per layer. Returns 0, or -1 when out of memory.
int slimlm_decode_layers(const Layer *layers, int64_t n, void *x, void *tmp, void *out, float eps, const void *cos,
                         const void *sin, const int64_t *slots, void *kv, int64_t layer_bytes, const int32_t *tables,
                         int64_t width, const int32_t *seq_lens, int64_t rows, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t block_size, float scale, int bf16, int kind, int amx, int nthreads) {
    const int64_t elem = bf16 ? 2 : 4, attn = rows * heads * dim;
    int64_t hidden = 0, qkv = 0, gu = 0, inter = 0, blocks = 0;  // the widest of every layer
#define WIDEST(v, e) v = (e) > v ? (e) : v
    for (int64_t l = 0; l < n; l++) {
        const Linear *w = layers[l].w;
        WIDEST(hidden, w[1].out_features), WIDEST(qkv, w[0].out_features), WIDEST(gu, w[2].out_features);
        WIDEST(inter, w[3].in_features), WIDEST(blocks, w[0].blocks), WIDEST(blocks, w[2].blocks);
    }
#undef WIDEST
    Buffers b = {malloc(rows * hidden * elem), malloc(rows * qkv * elem), malloc(attn * elem), malloc(attn * elem),
                 malloc(rows * gu * elem), malloc(rows * inter * elem), malloc(sizeof(float) * attn * 2),
                 malloc(sizeof(float) * rows * blocks * 64)};
    int status = b.h && b.qkv && b.q && b.attn && b.gu && b.act && b.qf && b.padded ? 0 : -1;
    void *in = x;
    for (int64_t l = 0; status == 0 && l < n; l++) {
        void *dst = (n - 1 - l) % 2 == 0 ? out : tmp;  // alternating, so that the last layer writes out
        char *k_cache = (char *)kv + l * layer_bytes;
        status = decode_layer(in, l == 0 ? NULL : x, &layers[l], eps, cos, sin, slots, k_cache,
                              k_cache + layer_bytes / 2, tables, width, seq_lens, rows, heads, kv_heads, dim,
                              block_size, scale, dst, bf16, kind, amx, nthreads, &b);
        in = dst;
    }
    free(b.h), free(b.qkv), free(b.q), free(b.attn), free(b.gu), free(b.act), free(b.qf), free(b.padded);
    return status;
}
#endif
