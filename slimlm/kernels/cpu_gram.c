// Xᵀ·X of bf16 activations with fp32 sums on the bf16 dot-product unit (vdpbf16ps): GPTQ's Hessians.
//
// Why this exists: GPTQ sums H = 2/n·Σ xxᵀ over every calibration token. Products of bf16 numbers are exact in
// fp32, but torch multiplies bf16 matrices into a bf16 result (every entry of H rounded to 8 bits: +1.3% wiki
// perplexity, benchmarks/results/gptq-hessian-dtype-2026-12-02.md) and fp32 ones at half the bf16 rate. Here
// the products are exact and the sums fp32, at the bf16 unit's rate.
//
// Only the 16×16 tiles on and above the diagonal are computed (H is symmetric; the caller mirrors the rest).
// Tokens go in pairs, the operand vdpbf16ps takes: x [T, n] is first interleaved so that one dword holds
// (x[2p, c], x[2p+1, c]); a tile's 16 columns at pair p are then one 64-byte load, a row's pair one dword to
// broadcast, and acc[r][k] += x[2p,i]·x[2p,j] + x[2p+1,i]·x[2p+1,j]. Blocked like a GEMM: PC pairs at a time
// (sums of each chunk added into out), NC columns of them (16 KB a tile column) shared by the rows that
// meet them, so the operands are read from cache, not memory.
//
// On a CPU with AMX the same sums run on the tile unit (slimlm_bf16_gram_amx, below): 5-10× the rate.
//
// Built with the other kernels by slimlm/kernels/cpu_library.py; compiles to nothing without AVX-512 BF16.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>
#include "slimlm_kernels.h"

#define PC 256  // token pairs per chunk
#define NC 256  // columns per block

// out[i, j] = beta·out[i, j] + alpha·Σ_t x[t, i]·x[t, j] over the 16×16 tiles with i-tile ≤ j-tile. x is
// [T, n] bf16, row-major; out [n, n] fp32, row-major; n a multiple of 16. Returns 0, or -1 without memory.
// x [T, n] as token pairs, P rows of n dwords (x[2p, c], x[2p + 1, c]); rows from T's last pair on are zeros.
// NULL without memory.
static uint32_t *token_pairs(const uint16_t *x, int64_t T, int64_t n, int64_t P, int nthreads) {
    uint32_t *pairs = aligned_alloc(64, (size_t)(P * n * 4));  // n % 16 == 0: a multiple of 64 bytes
    if (!pairs) return NULL;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const uint16_t *lo = x + 2 * p * n, *hi = lo + n;
        uint32_t *d = pairs + p * n;
        if (2 * p + 1 < T)
            for (int64_t c = 0; c < n; c++) d[c] = (uint32_t)lo[c] | (uint32_t)hi[c] << 16;
        else if (2 * p < T)  // an odd last token pairs with zeros
            for (int64_t c = 0; c < n; c++) d[c] = lo[c];
        else
            memset(d, 0, (size_t)n * 4);
    }
    return pairs;
}

int slimlm_bf16_gram(const uint16_t *x, int64_t T, int64_t n, float *out, float alpha, float beta, int nthreads) {
    int64_t P = (T + 1) / 2;
    uint32_t *pairs = token_pairs(x, T, n, P, nthreads);
    if (!pairs) return -1;
    const int64_t tiles = n / 16, block = NC / 16;
    const __m512 va = _mm512_set1_ps(alpha);
    // One parallel region, no barrier between chunks: the units of work (one row tile against one block of
    // column tiles) go to the threads round-robin, the same way in every chunk, so each tile of out is only ever
    // summed by one thread.
#pragma omp parallel num_threads(nthreads)
    {
        const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
        for (int64_t p0 = 0; p0 < P; p0 += PC) {
            const int64_t p1 = p0 + PC < P ? p0 + PC : P;
            const __m512 vb = _mm512_set1_ps(p0 == 0 ? beta : 1.0f);  // later chunks add to the first's sums
            int64_t unit = 0;
            for (int64_t j0 = 0; j0 < tiles; j0 += block) {
                const int64_t j1 = j0 + block < tiles ? j0 + block : tiles;
                for (int64_t it = 0; it < j1; it++) {
                    if (unit++ % threads != thread) continue;
                    for (int64_t jt = it > j0 ? it : j0; jt < j1; jt++) {
                        __m512 acc[16];
                        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                        const uint32_t *a = pairs + p0 * n + it * 16, *b = pairs + p0 * n + jt * 16;
                        for (int64_t p = p0; p < p1; p++, a += n, b += n) {
                            const __m512bh vb16 = (__m512bh)_mm512_load_si512(b);
                            for (int r = 0; r < 16; r++)
                                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)a[r]), vb16);
                        }
                        for (int r = 0; r < 16; r++) {
                            float *o = out + (it * 16 + r) * n + jt * 16;
                            __m512 v = _mm512_mul_ps(acc[r], va);
                            // beta 0 ignores what out held (it may be uninitialized), as BLAS does
                            if (p0 != 0 || beta != 0.0f) v = _mm512_fmadd_ps(_mm512_loadu_ps(o), vb, v);
                            _mm512_storeu_ps(o, v);
                        }
                    }
                }
            }
        }
    }
    free(pairs);
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same sums on the AMX tile unit: tdpbf16ps multiplies a 16×32 bf16 tile by a 16-pair × 16-column tile into
// 16×16 fp32 sums, exact products and fp32 sums as above, 8192 multiply-adds an instruction. For H's 32×32 block
// (i, j) the left tiles are x's columns i..i+31 over 32 tokens (so x is transposed once, `cols`: column c's
// tokens contiguous) and the right tiles the token pairs of columns j..j+31 (the layout above). Blocked as the
// vector loop: TC tokens at a time, column blocks of NC; tmm0-3 hold a block's sums, tmm4-5 the left tiles,
// tmm6-7 the right ones. Widths must be a multiple of 32.
void configure_tiles(void);  // cpu_gemm.c: eight tiles of 16 rows × 64 bytes

#define TC 512  // tokens per chunk: a left panel of 32 columns is 32 KB, a right one of NC columns 256 KB

// out[r, c] of block (ib, jb) = scale·out + alpha·sums (scale 0: out ignored), tile (a, b) of the block from
// sums[2a + b]; on the diagonal the tile below it is left alone.
static void gram_block_out(const float *sums, float *out, int64_t n, int64_t ib, int64_t jb, float alpha,
                           float scale) {
    const __m512 va = _mm512_set1_ps(alpha), vs = _mm512_set1_ps(scale);
    for (int t = 0; t < 4; t++) {
        if (ib == jb && t == 2) continue;
        for (int r = 0; r < 16; r++) {
            float *o = out + (ib * 32 + (t >> 1) * 16 + r) * n + jb * 32 + (t & 1) * 16;
            __m512 v = _mm512_mul_ps(_mm512_load_ps(sums + t * 256 + r * 16), va);
            if (scale != 0.0f) v = _mm512_fmadd_ps(_mm512_loadu_ps(o), vs, v);
            _mm512_storeu_ps(o, v);
        }
    }
}

int slimlm_bf16_gram_amx(const uint16_t *x, int64_t T, int64_t n, float *out, float alpha, float beta,
                         int nthreads) {
    const int64_t Tp = (T + 31) / 32 * 32, blocks = n / 32, nc = NC / 32;
    uint32_t *pairs = token_pairs(x, T, n, Tp / 2, nthreads);
    uint16_t *cols = aligned_alloc(64, (size_t)(n * Tp * 2));
    if (!pairs || !cols) {
        free(pairs);
        free(cols);
        return -1;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += 32) {  // 32×32 blocks: what one reads and writes stays in L1
        for (int64_t t0 = 0; t0 < T; t0 += 32)
            for (int64_t c = c0; c < c0 + 32; c++)
                for (int64_t t = t0; t < t0 + 32 && t < T; t++) cols[c * Tp + t] = x[t * n + c];
        for (int64_t c = c0; c < c0 + 32; c++) memset(cols + c * Tp + T, 0, (size_t)(Tp - T) * 2);
    }
    // Units of work (one block row against one column block) go to the threads round-robin, the same way in
    // every chunk, so each block of out is only ever summed by one thread (no barrier between chunks).
#pragma omp parallel num_threads(nthreads)
    {
        const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
        float sums[4 * 256] __attribute__((aligned(64)));
        configure_tiles();
        for (int64_t t0 = 0; t0 < Tp; t0 += TC) {
            const int64_t t1 = t0 + TC < Tp ? t0 + TC : Tp;
            const float scale = t0 == 0 ? beta : 1.0f;  // later chunks add to the first's sums
            int64_t unit = 0;
            for (int64_t j0 = 0; j0 < blocks; j0 += nc) {
                const int64_t j1 = j0 + nc < blocks ? j0 + nc : blocks;
                for (int64_t ib = 0; ib < j1; ib++) {
                    if (unit++ % threads != thread) continue;
                    const uint16_t *a0 = cols + ib * 32 * Tp, *a1 = a0 + 16 * Tp;
                    for (int64_t jb = ib > j0 ? ib : j0; jb < j1; jb++) {
                        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                        for (int64_t t = t0; t < t1; t += 32) {
                            const uint32_t *b = pairs + t / 2 * n + jb * 32;
                            _tile_loadd(4, a0 + t, 2 * Tp);
                            _tile_loadd(5, a1 + t, 2 * Tp);
                            _tile_loadd(6, b, 4 * n);
                            _tile_loadd(7, b + 16, 4 * n);
                            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                        }
                        _tile_stored(0, sums, 64); _tile_stored(1, sums + 256, 64);
                        _tile_stored(2, sums + 512, 64); _tile_stored(3, sums + 768, 64);
                        gram_block_out(sums, out, n, ib, jb, alpha, scale);
                    }
                }
            }
        }
        _tile_release();
    }
    free(cols);
    free(pairs);
    return 0;
}
#endif
#endif
