// One quantized GEMV against a plain read of the same bytes, matrix by matrix, from memory (read_pieces.py
// builds and runs it). Each of `copies` weights lies in its own memory (copies x its bytes > L3), and the
// candidates take turns, round by round:
//   gemv    y = x · Wᵀ for one row of bf16 x (slimlm_quant_matmul_bf16, the decode step's call), copy after copy
//   pieces  a sum over the same bytes with the same threads, one piece after another, each in its own
//           parallel region, as the GEMV reads them
//   stream  a sum over a 1 GiB buffer: the most that loads alone move here
// Prints one line: "gemv_s pieces_s stream_s bytes_per_copy" (median seconds per copy, or per 1 GiB).
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int slimlm_quant_matmul_bf16(int bits, const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                             const uint16_t *scales, const uint8_t *zeros, int64_t nblocks, int64_t group,
                             void *y, int64_t y_cols, int y_bf16, int64_t code_rows, int nthreads);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// Σ of bytes [0, n) as floats, split evenly over the threads (n a multiple of 256 · threads)
static float read_bytes(const char *p, size_t n, int threads) {
    float total = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma omp for schedule(static)
        for (size_t o = 0; o < n; o += 256)
            for (int i = 0; i < 4; i++) s[i] = _mm512_add_ps(s[i], _mm512_load_ps((const float *)(p + o + 64 * i)));
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])));
    }
    return total;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, by_value);
    return v[n / 2];
}

int main(int argc, char **argv) {
    if (argc != 7) return fprintf(stderr, "usage: K N bits group copies threads\n"), 2;
    const int64_t K = atol(argv[1]), N = atol(argv[2]), bits = atol(argv[3]), group = atol(argv[4]);
    const int copies = atoi(argv[5]), threads = atoi(argv[6]), rounds = 15;
    const int64_t nblocks = N / 64, code_bytes = K * N * bits / 8, groups = K / group * N;
    const size_t piece = (code_bytes + groups * 3 + 256 * threads - 1) / (256 * threads) * (256 * threads);
    const size_t big = (size_t)1 << 30;
    char **mem = malloc(sizeof(char *) * copies), *stream = aligned_alloc(4096, big);
    uint16_t *x = aligned_alloc(64, K * 2), *y = aligned_alloc(64, N * 4);
    for (int c = 0; c < copies; c++) {  // codes, then fp16 scales of 1, then zeros of 8: one piece each
        mem[c] = aligned_alloc(4096, piece);
        memset(mem[c], 0x5A, piece);
        uint16_t *scales = (uint16_t *)(mem[c] + code_bytes);
        for (int64_t i = 0; i < groups; i++) scales[i] = 0x3C00;
        memset(mem[c] + code_bytes + groups * 2, 8, groups);
    }
    memset(stream, 0, big);
    for (int64_t k = 0; k < K; k++) x[k] = 0x3F80;
    double gemv[rounds], pieces[rounds], whole[rounds];
    volatile float sink = 0.f;
    for (int r = 0; r < rounds; r++) {
        double t = now();
        for (int c = 0; c < copies; c++) {
            const char *m = mem[c];
            slimlm_quant_matmul_bf16((int)bits, x, 1, K, (const uint8_t *)m, (const uint16_t *)(m + code_bytes),
                                     (const uint8_t *)(m + code_bytes + groups * 2), nblocks, group, y, N, 1, 1,
                                     threads);
        }
        gemv[r] = (now() - t) / copies;
        t = now();
        for (int c = 0; c < copies; c++) sink += read_bytes(mem[c], piece, threads);
        pieces[r] = (now() - t) / copies;
        t = now();
        sink += read_bytes(stream, big, threads);
        whole[r] = now() - t;
    }
    printf("%.9f %.9f %.9f %lld\n", median(gemv, rounds), median(pieces, rounds), median(whole, rounds),
           (long long)(code_bytes + groups * 3));
    return 0;
}
