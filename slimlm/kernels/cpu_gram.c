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
// Built with the other kernels by slimlm/kernels/cpu_library.py; compiles to nothing without AVX-512 BF16.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>
#include <omp.h>

#define PC 256  // token pairs per chunk
#define NC 256  // columns per block

// out[i, j] = beta·out[i, j] + alpha·Σ_t x[t, i]·x[t, j] over the 16×16 tiles with i-tile ≤ j-tile. x is
// [T, n] bf16, row-major; out [n, n] fp32, row-major; n a multiple of 16. Returns 0, or -1 without memory.
int slimlm_bf16_gram(const uint16_t *x, int64_t T, int64_t n, float *out, float alpha, float beta, int nthreads) {
    int64_t P = (T + 1) / 2;
    uint32_t *pairs = aligned_alloc(64, (size_t)(P * n * 4));  // n % 16 == 0: a multiple of 64 bytes
    if (!pairs) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const uint16_t *lo = x + 2 * p * n, *hi = lo + n;
        uint32_t *d = pairs + p * n;
        if (2 * p + 1 < T)
            for (int64_t c = 0; c < n; c++) d[c] = (uint32_t)lo[c] | (uint32_t)hi[c] << 16;
        else  // an odd last token pairs with zeros
            for (int64_t c = 0; c < n; c++) d[c] = lo[c];
    }
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
#endif
