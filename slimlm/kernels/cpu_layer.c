// The small per-layer operations of a decode step, each in one call: the residual add with the RMSNorm that
// follows it, and the rotary embedding of q and k with the KV-cache write. At batch 1 each is a few thousand
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

// Per row: h = x + residual (rounded; written back into residual), or h = x when residual is NULL;
// out = weight · (h / sqrt(mean(h²) + eps)), normalized in fp32, rounded, then scaled and rounded.
void slimlm_add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                         float eps, int bf16, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * dim;
        double squares = 0.0;
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
        for (int64_t i = 0; i < dim; i++) {
            const float normed = rounded(load(h, base + i, bf16) * inv, bf16);
            store(out, base + i, load(weight, i, bf16) * normed, bf16);
        }
    }
}

// x·cos + roll(x, D/2)·sin for one head (sin with its first half negated, as the model's tables hold it)
static inline void rotate(const void *x, int64_t xi, const void *cos, const void *sin, int64_t ci, void *out,
                          int64_t oi, int64_t dim, int bf16) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i++) {
        const float a = rounded(load(x, xi + i, bf16) * load(cos, ci + i, bf16), bf16);
        const float b = rounded(load(x, xi + (i + half) % dim, bf16) * load(sin, ci + i, bf16), bf16);
        store(out, oi + i, a + b, bf16);
    }
}

// qkv [rows, (heads + 2·kv_heads)·dim]: q rotated into q_out [rows, heads, dim]; k rotated and v copied into
// the caches' slot slots[r] (caches [slots, kv_heads, dim], qkv's dtype). cos, sin [rows, dim].
void slimlm_rotary_kv_write(const void *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                            const void *cos, const void *sin, const int64_t *slots, void *k_cache, void *v_cache,
                            void *q_out, int bf16) {
    const int64_t width = (heads + 2 * kv_heads) * dim, elem = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = r * width, slot = slots[r] * kv_heads * dim;
        for (int64_t h = 0; h < heads; h++)
            rotate(qkv, row + h * dim, cos, sin, r * dim, q_out, (r * heads + h) * dim, dim, bf16);
        for (int64_t h = 0; h < kv_heads; h++)
            rotate(qkv, row + (heads + h) * dim, cos, sin, r * dim, k_cache, slot + h * dim, dim, bf16);
        memcpy((char *)v_cache + slot * elem, (const char *)qkv + (row + (heads + kv_heads) * dim) * elem,
               kv_heads * dim * elem);
    }
}
