// Paged decode attention for CPUs, fp32 or bf16 cache (fp32 sums): one query per sequence, keys and values read
// in place through the block table (no gathered copy), each KV head read once for its whole query group (GQA).
//
// Why not torch: a decode step's attention is dozens of tiny batched matmuls whose per-call and per-batch
// overhead dwarfs the arithmetic (measured: ~1.6 ms per layer at 32 sequences of 131 tokens, against
// ~0.1 ms of memory traffic). Here one OpenMP task per sequence (or per part of its tokens, when the
// sequences are few) computes the scores of all its queries, a softmax, and the weighted sums of values.
// Scores go 16 tokens at a time, each token's lanes summed by one shuffle tree for all 16 (sum16), with the
// bf16 dot product where keys and queries are bf16; values with AVX-512 along the head dimension.
#ifdef __AVX512F__  // cpu_attention_avx2.c otherwise
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define MAX_HEADS 128  // query heads
#define MAX_DIM 256
#define MAX_PARTS 16   // parts a sequence splits into at most
#define MIN_PART 64    // tokens a part holds at least

// 16 cache values as fp32: bf16 is the top half of an fp32, so widening is a shift
static inline __m512 load16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

// r[j] = Σ of a[j]'s 16 lanes, for 16 vectors at once: three rounds of pairwise shuffles and adds (45
// instructions where 16 separate horizontal sums take ~130).
static inline __m512 sum16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int k = 0; k < 8; k++)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of a[2k] = x, a[2k+1] = y
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int m = 0; m < 4; m++) {  // per 128-bit lane: that lane's sums of a[4m..4m+3]
        const __m512d x = _mm512_castps_pd(b[2 * m]), y = _mm512_castps_pd(b[2 * m + 1]);
        c[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // the four 128-bit lanes of each c[m] added: lane m of the result
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

// The lanes of q·k (q fp32, k the cache's; summed by the caller): one fused multiply-add per 16 values.
static inline __m512 dot_lanes(const float *q, const void *k, int64_t d, int bf16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16((const char *)k + i * (bf16 ? 2 : 4), bf16), acc);
    return acc;
}

#ifdef __AVX512BF16__
static inline int bf16_exact(float x) {  // whether x converts to bf16 and back unchanged
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0xFFFF) == 0;
}

// The same for a bf16 cache and a query that is exactly bf16 (a bf16 model's): qp holds the query as bf16
// pairs, and the keys go into the bf16 dot product as they are stored, 32 values an instruction, products exact.
static inline __m512 dot_lanes_bf16(const __m512bh *qp, const uint16_t *k, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + i), qp[i / 32]);
    if (i < d)  // d is a multiple of 16: a last 16 values
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, k + i), qp[i / 32]);
    return acc;
}
#endif

// Where token t's K or V rows (all KV heads, side by side) lie in a cache, through the sequence's block table.
// This and the next always inlined: as plain inline functions gcc kept them out of the hot loops (1.2× slower).
static inline __attribute__((always_inline)) const char *token_row(const void *cache, const int32_t *table,
                                                                   int64_t t, int64_t block_size, int64_t row_bytes) {
    return (const char *)cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row_bytes;
}

// Asks for a row ahead of its use: the blocks lie anywhere in the pool, so the hardware prefetchers lose the
// stream at every block boundary.
static inline __attribute__((always_inline)) void prefetch_bytes(const char *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
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

// Tokens [t0, t1) of one sequence, all KV heads, for its Hq queries (q [Hq, D]): each query's scores (into
// scores, Hq·(t1 − t0) floats), softmax and weighted sum of values. With part == NULL the sums are divided
// through into out [Hq, D]; otherwise out gets them undivided, part[g] the largest score of query g and
// part[Hq + g] the sum of e^(score − largest), so that the parts of a sequence merge (merge_parts).
// Token-major: a token's rows of all KV heads lie side by side in the cache and are read as one run (1.2–1.4×
// over a pass per head, measured). Always inlined with a literal D where the caller can (64, 128): the dot
// products and the value rows then unroll into registers (1.3× on the scores, measured).
static inline __attribute__((always_inline)) void
attend(const float *q, const void *k_cache, const void *v_cache, int bf16, const int32_t *table, int64_t t0,
       int64_t t1, int64_t Hq, int64_t G, int64_t D, int64_t Hkv, int64_t block_size, float scale, float *scores,
       float *out, float *part) {
    const int64_t elem = bf16 ? 2 : 4, row = Hkv * D * elem, L = t1 - t0;
    float top[MAX_HEADS], total[MAX_HEADS];
    for (int64_t g = 0; g < Hq; g++) top[g] = -INFINITY;
#ifdef __AVX512BF16__
    __m512bh qp[Hq][(D + 31) / 32];  // the queries as bf16, in order, when that is exact
    int exact = bf16;
    for (int64_t i = 0; exact && i < Hq * D; i++) exact = bf16_exact(q[i]);
    for (int64_t g = 0; exact && g < Hq; g++)
        for (int64_t i = 0; i < D; i += 32) {
            const float *x = q + g * D + i;
            const __m512 hi = D - i >= 32 ? _mm512_loadu_ps(x + 16) : _mm512_setzero_ps();
            qp[g][i / 32] = _mm512_cvtne2ps_pbh(hi, _mm512_loadu_ps(x));
        }
#endif
    // scores 16 tokens at a time: their keys' lanes, then one sum16 per query
    for (int64_t c = 0; c < L; c += 16) {
        const int64_t n = L - c < 16 ? L - c : 16;
        const char *k[16];
        for (int64_t j = 0; j < n; j++) {
            k[j] = token_row(k_cache, table, t0 + c + j, block_size, row);
            if (c + j + 16 < L) prefetch_bytes(token_row(k_cache, table, t0 + c + j + 16, block_size, row), row);
        }
        const __mmask16 valid = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        for (int64_t g = 0; g < Hq; g++) {
            const int64_t at = g / G * D * elem;  // the query's KV head within a row
            __m512 lanes[16];
            for (int64_t j = 0; j < 16; j++) {
#ifdef __AVX512BF16__
                if (exact) {
                    lanes[j] = j < n ? dot_lanes_bf16(qp[g], (const uint16_t *)(k[j] + at), D) : _mm512_setzero_ps();
                    continue;
                }
#endif
                lanes[j] = j < n ? dot_lanes(q + g * D, k[j] + at, D, bf16) : _mm512_setzero_ps();
            }
            const __m512 x = _mm512_mul_ps(sum16(lanes), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + g * L + c, valid, x);
            top[g] = fmaxf(top[g], _mm512_mask_reduce_max_ps(valid, x));
        }
    }
    for (int64_t g = 0; g < Hq; g++) {
        float *r = scores + g * L;
        const __m512 shift = _mm512_set1_ps(top[g]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < L; t += 16) {
            const __mmask16 m = L - t >= 16 ? 0xFFFF : (__mmask16)((1u << (L - t)) - 1);
            const __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, r + t), shift));
            _mm512_mask_storeu_ps(r + t, m, p);
            sum = _mm512_mask_add_ps(sum, m, sum, p);
        }
        total[g] = _mm512_reduce_add_ps(sum);
    }
    __m512 acc[Hq][D / 16];  // local: the compiler keeps it out of the way of every other store
    for (int64_t g = 0; g < Hq; g++)
        for (int64_t i = 0; i < D / 16; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t++) {
        const char *v = token_row(v_cache, table, t0 + t, block_size, row);
        if (t + 16 < L) prefetch_bytes(token_row(v_cache, table, t0 + t + 16, block_size, row), row);
        for (int64_t h = 0; h < Hkv; h++) {
            __m512 vr[MAX_DIM / 16];  // head h's values, widened once for its G queries
            for (int64_t i = 0; i < D / 16; i++) vr[i] = load16(v + (h * D + 16 * i) * elem, bf16);
            for (int64_t g = h * G; g < (h + 1) * G; g++) {
                const __m512 p = _mm512_set1_ps(scores[g * L + t]);
                for (int64_t i = 0; i < D / 16; i++) acc[g][i] = _mm512_fmadd_ps(p, vr[i], acc[g][i]);
            }
        }
    }
    for (int64_t g = 0; g < Hq; g++) {
        const __m512 inv = _mm512_set1_ps(part ? 1.f : 1.f / total[g]);
        for (int64_t i = 0; i < D / 16; i++) _mm512_storeu_ps(out + g * D + 16 * i, _mm512_mul_ps(acc[g][i], inv));
    }
    if (part) memcpy(part, top, sizeof(float) * Hq), memcpy(part + Hq, total, sizeof(float) * Hq);
}

// One sequence's parts (undivided sums sums [parts, Hq, D], stats [parts, 2·Hq] as attend writes them) into
// out [Hq, D]: each part's sums rescaled by e^(its largest score − the largest of all).
static void merge_parts(const float *sums, const float *stats, int64_t parts, int64_t Hq, int64_t D, float *out) {
    for (int64_t g = 0; g < Hq; g++) {
        float top = -INFINITY, total = 0.f, weight[MAX_PARTS];
        for (int64_t p = 0; p < parts; p++) top = fmaxf(top, stats[p * 2 * Hq + g]);
        for (int64_t p = 0; p < parts; p++) {
            weight[p] = expf(stats[p * 2 * Hq + g] - top);
            total += weight[p] * stats[p * 2 * Hq + Hq + g];
        }
        for (int64_t i = 0; i < D; i += 16) {
            __m512 o = _mm512_setzero_ps();
            for (int64_t p = 0; p < parts; p++)
                o = _mm512_fmadd_ps(_mm512_set1_ps(weight[p]), _mm512_loadu_ps(sums + (p * Hq + g) * D + i), o);
            _mm512_storeu_ps(out + g * D + i, _mm512_div_ps(o, _mm512_set1_ps(total)));
        }
    }
}

// q, out [S, Hq, D] fp32; caches [blocks, block_size, Hkv, D] fp32 or (bf16 = 1) bf16; tables [S, width].
// D a multiple of 16, <= MAX_DIM; Hq <= MAX_HEADS. Returns 0, or -1 when out of memory.
// A task is one sequence, all its KV heads. With fewer sequences than 2 per thread, each splits into parts of
// its tokens (as flash-decoding does), merged after: one long sequence then runs on every thread.
int slimlm_paged_decode(const float *q, const void *k_cache, const void *v_cache, int bf16, const int32_t *tables,
                        int64_t width, const int32_t *seq_lens, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                        int64_t block_size, float scale, float *out, int nthreads) {
    int64_t longest = 0, parts = 1;
    for (int64_t s = 0; s < S; s++) longest = seq_lens[s] > longest ? seq_lens[s] : longest;
    while (parts < MAX_PARTS && S * parts < 2 * nthreads && longest >= 2 * parts * MIN_PART) parts *= 2;
    float *sums = NULL, *stats = NULL;  // of every part, when sequences split
    if (parts > 1) {
        sums = malloc(sizeof(float) * S * parts * Hq * D), stats = malloc(sizeof(float) * S * parts * 2 * Hq);
        if (!sums || !stats) return free(sums), free(stats), -1;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t task = 0; task < S * parts; task++) {
        const int64_t s = task / parts, L = seq_lens[s], span = (L + parts - 1) / parts;
        const int64_t t0 = task % parts * span < L ? task % parts * span : L, t1 = t0 + span < L ? t0 + span : L;
        float *scores = malloc(sizeof(float) * Hq * span);
        if (!scores) {
            failed = 1;
            continue;
        }
        float *o = parts > 1 ? sums + task * Hq * D : out + s * Hq * D, *part = parts > 1 ? stats + task * 2 * Hq : NULL;
#define ATTEND(DIM) attend(q + s * Hq * D, k_cache, v_cache, bf16, tables + s * width, t0, t1, Hq, Hq / Hkv, DIM, Hkv, \
                           block_size, scale, scores, o, part)
        switch (D) {
            case 64: ATTEND(64); break;
            case 128: ATTEND(128); break;
            default: ATTEND(D);
        }
#undef ATTEND
        free(scores);
    }
    for (int64_t s = 0; parts > 1 && !failed && s < S; s++)
        merge_parts(sums + s * parts * Hq * D, stats + s * parts * 2 * Hq, parts, Hq, D, out + s * Hq * D);
    free(sums), free(stats);
    return failed ? -1 : 0;
}

// ---- Prompt chunks: flash attention over the paged cache ----
// A task is one sequence's tile of up to 16 consecutive queries and one KV head, for the G query heads that
// read it. Each query head's tile is held transposed (Qt [D][16]: one vector per dimension, a lane per query),
// so that scores, their softmax and the value sums all run 16 queries to a vector with no horizontal sums:
// for a key, 16 scores are D fused multiply-adds of Qt[d] by the key's d-th value broadcast. Keys and values
// go 16 tokens at a time, widened once to fp32 for the G heads, with the running maximum and exp-sum of
// flash attention, so no score row is ever stored. 2.3-6x the PyTorch path it replaced (batched matmuls and a
// masked softmax, one sequence at a time) on a 2-core Xeon: benchmarks/prompt_attention.py.
#define TILE 16

// tokens [c, c + 16) of KV head h as fp32 rows [16][D]; tokens at or past `end` are zeros (their slots may
// hold anything: a NaN there times a zero weight would still be NaN)
static inline __attribute__((always_inline)) void widen_chunk(const void *cache, const int32_t *table, int64_t c,
                                                              int64_t end, int64_t h, int64_t D, int64_t Hkv,
                                                              int64_t block_size, int bf16, float *dst) {
    const int64_t elem = bf16 ? 2 : 4, row = Hkv * D * elem;
    for (int64_t j = 0; j < TILE; j++) {
        const char *src = c + j < end ? token_row(cache, table, c + j, block_size, row) + h * D * elem : NULL;
        for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(dst + j * D + i, src ? load16(src + i * elem, bf16) : _mm512_setzero_ps());
    }
}

// One query head's tile against one chunk of keys and values (kc, vc [16][D]): the scores, the running
// maximum m and exp-sum l of each query lane, and the transposed sums ot [D][16] rescaled and added to.
// pos: each lane's query position; a key at position c + j counts for lanes at or past it, below `end`.
static inline __attribute__((always_inline)) void
flash_chunk(const float *qt, const float *kc, const float *vc, int64_t D, __m512i pos, int64_t c, int64_t end,
            __m512 *m, __m512 *l, float *ot) {
    __m512 s[TILE];
    for (int64_t j = 0; j < TILE; j++) s[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 4)  // four dimensions a round: 16 chains of fused adds, one per key
        for (int64_t e = d; e < d + 4; e++) {
            const __m512 q = _mm512_loadu_ps(qt + e * TILE);
            for (int64_t j = 0; j < TILE; j++) s[j] = _mm512_fmadd_ps(q, _mm512_set1_ps(kc[j * D + e]), s[j]);
        }
    __mmask16 seen[TILE];
    __m512 top = *m;
    for (int64_t j = 0; j < TILE; j++) {
        seen[j] = c + j < end ? _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32((int)(c + j))) : 0;
        top = _mm512_mask_max_ps(top, seen[j], top, s[j]);
    }
    const __m512 rescale = exp512(_mm512_sub_ps(*m, top));
    __m512 sum = _mm512_mul_ps(*l, rescale);
    for (int64_t j = 0; j < TILE; j++) {
        s[j] = _mm512_maskz_mov_ps(seen[j], exp512(_mm512_sub_ps(s[j], top)));
        sum = _mm512_add_ps(sum, s[j]);
    }
    *m = top, *l = sum;
    for (int64_t d = 0; d < D; d += 8) {  // eight dimensions a round: eight chains, so the adds overlap
        __m512 o[8];
        for (int64_t i = 0; i < 8; i++) o[i] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + i) * TILE), rescale);
        for (int64_t j = 0; j < TILE; j++)
            for (int64_t i = 0; i < 8; i++) o[i] = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vc[j * D + d + i]), o[i]);
        for (int64_t i = 0; i < 8; i++) _mm512_storeu_ps(ot + (d + i) * TILE, o[i]);
    }
}

// q, out [T, Hq, D] in the cache's dtype (bf16 = 1) or fp32; caches [blocks, block_size, Hkv, D]; sequence s's
// queries are rows query_start[s] .. query_start[s + 1], the last of its seq_lens[s] cached tokens (causal).
// Sequences with one query are skipped when skip_single is set (the decode kernel takes them). D a multiple
// of 16, <= MAX_DIM; Hq / Hkv <= MAX_HEADS. Returns 0, or -1 when out of memory.
int slimlm_paged_prefill(const void *q, const void *k_cache, const void *v_cache, int bf16, const int32_t *tables,
                         int64_t width, const int32_t *seq_lens, const int32_t *query_start, int64_t S, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t block_size, float scale, int skip_single, void *out,
                         int nthreads) {
    const int64_t G = Hq / Hkv, elem = bf16 ? 2 : 4;
    int64_t tasks = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t n = query_start[s + 1] - query_start[s];
        tasks += (n > 1 || !skip_single) ? (n + TILE - 1) / TILE * Hkv : 0;
    }
    int64_t *order = malloc(sizeof(int64_t) * 3 * (tasks ? tasks : 1));  // (s, tile, h) of each task
    if (!order) return -1;
    int64_t k = 0;
    for (int64_t s = 0; s < S; s++) {  // a sequence's last tiles first: they see the most keys
        const int64_t n = query_start[s + 1] - query_start[s];
        if (n == 1 && skip_single) continue;
        for (int64_t tile = (n + TILE - 1) / TILE - 1; tile >= 0; tile--)
            for (int64_t h = 0; h < Hkv; h++) order[k++] = s, order[k++] = tile, order[k++] = h;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t s = order[3 * task], tile = order[3 * task + 1], h = order[3 * task + 2];
        const int64_t n = query_start[s + 1] - query_start[s], L = seq_lens[s];
        const int64_t r0 = tile * TILE, rows = n - r0 < TILE ? n - r0 : TILE;
        const int64_t first = L - n + r0, end = first + rows;  // the tile's first query position; keys it sees
        const int32_t *table = tables + s * width;
        float *buf = malloc(sizeof(float) * (2 * G * D * TILE + 2 * TILE * D));
        if (!buf) {
            failed = 1;
            continue;
        }
        float *qt = buf, *ot = qt + G * D * TILE, *kc = ot + G * D * TILE, *vc = kc + TILE * D;
        memset(qt, 0, sizeof(float) * 2 * G * D * TILE);
        for (int64_t g = 0; g < G; g++)  // the queries transposed, scaled; lanes past the tile stay zero
            for (int64_t r = 0; r < rows; r++) {
                const char *x = (const char *)q + (((query_start[s] + r0 + r) * Hq) + h * G + g) * D * elem;
                for (int64_t d = 0; d < D; d++) {
                    float v;
                    if (bf16) {
                        const uint32_t u = (uint32_t)((const uint16_t *)x)[d] << 16;
                        memcpy(&v, &u, sizeof v);
                    } else {
                        v = ((const float *)x)[d];
                    }
                    qt[(g * D + d) * TILE + r] = v * scale;
                }
            }
        __m512 m[MAX_HEADS], l[MAX_HEADS];
        for (int64_t g = 0; g < G; g++) m[g] = _mm512_set1_ps(-INFINITY), l[g] = _mm512_setzero_ps();
        const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int)first),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        for (int64_t c = 0; c < end; c += TILE) {
            widen_chunk(k_cache, table, c, end, h, D, Hkv, block_size, bf16, kc);
            widen_chunk(v_cache, table, c, end, h, D, Hkv, block_size, bf16, vc);
            for (int64_t g = 0; g < G; g++) {
                switch (D) {
                    case 64: flash_chunk(qt + g * D * TILE, kc, vc, 64, pos, c, end, &m[g], &l[g], ot + g * D * TILE); break;
                    default: flash_chunk(qt + g * D * TILE, kc, vc, D, pos, c, end, &m[g], &l[g], ot + g * D * TILE);
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {  // divided through and written back row-major
            float lanes[TILE], *o = ot + g * D * TILE;
            _mm512_storeu_ps(lanes, _mm512_div_ps(_mm512_set1_ps(1.f), l[g]));
            for (int64_t r = 0; r < rows; r++) {
                char *y = (char *)out + (((query_start[s] + r0 + r) * Hq) + h * G + g) * D * elem;
                for (int64_t d = 0; d < D; d++) {
                    const float v = o[d * TILE + r] * lanes[r];
                    if (bf16) {  // round to nearest even, as torch converts
                        uint32_t u;
                        memcpy(&u, &v, sizeof u);
                        ((uint16_t *)y)[d] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
                    } else {
                        ((float *)y)[d] = v;
                    }
                }
            }
        }
        free(buf);
    }
    free(order);
    return failed ? -1 : 0;
}

#endif
