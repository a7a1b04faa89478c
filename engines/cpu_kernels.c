/* CPU kernels for decode steps of few rows, where PyTorch's per-op costs and the packed int8 GEMMs' one-row
 * paths leave most of the memory bandwidth unused. Loaded by engines/cpu_kernels.py.
 *
 * The library is built for AVX2 + FMA; the AVX-512 (F, BW, VNNI) and AMX kernels sit in their own target
 * regions, so one build runs on every x86-64 CPU with AVX2 and the Python side calls each kernel only where
 * the CPU has its instructions.
 *
 * Threads: OpenMP. Python has loaded torch's libgomp by the time this library is opened, so the two
 * share one runtime and one thread pool (same soname).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>



/* Output features [begin, end) of this OpenMP thread: a contiguous share of n, so each thread streams
 * its own part of the weight. */
static inline void thread_share(const int64_t n, int64_t *begin, int64_t *end) {
    const int64_t count = omp_get_num_threads(), index = omp_get_thread_num();
    const int64_t per_thread = (n + count - 1) / count;
    *begin = index * per_thread < n ? index * per_thread : n;
    *end = *begin + per_thread < n ? *begin + per_thread : n;
}

/* -- int8_gemv (AVX2) ----------------------------------------------------------------------------------
 * int8 weight-only matmul: out = (x · wᵀ) · w_scale (+ bias), float32 in and out, for decode steps and prefill.
 * Int8Linear's product (per-output-channel scales) with each row of x quantised to int16 on the fly (its
 * own scale max|x| / X_LEVELS, rounded half to even: 13 bits, where bfloat16 keeps 8) and the int8 weights
 * widened to int16 in registers: `vpmaddwd` multiplies and pairs them into int32, exactly. Against widening
 * the weights to float32 (the first version of this kernel) that is half the instructions per weight,
 * which is what bounds a product of more than one row (speculative verification, batched decode).
 *
 * The sums are integers, so a row's result is the same bits whatever else shares the call: a speculative
 * verification step (k + 1 rows per sequence) gives the logits plain decoding does. Rows go in groups of
 * ROWS_TOGETHER over blocks of weight rows small enough to stay in L1 while every group passes over them:
 * the weights stream from memory once per pass (below). Each thread takes a contiguous share of the output
 * features, so at one row it reads one sequential stream, which the hardware prefetchers follow (reading
 * several weight rows interleaved was ~40 % slower on 896-wide rows). Where a group of rows outgrows L1d (the
 * down projections), the features go in slices whose copies of the group's rows fit it (`int8_kblock_share`),
 * each weight row's slice fetched ahead while the one before is multiplied.
 *
 * Prefill chunks take the same path: rows pass in chunks whose int16 copies stay in L2 (X_CHUNK_BYTES) while
 * the weight streams once per chunk. A row's product is then the same bits in a prefill chunk as in a decode
 * step, and the int16 products (16 multiply-adds an instruction, exact) outrun float32 sgemm over a dequantised
 * copy of the weight, which also spent more time writing that copy than multiplying (BENCHMARKS.md).
 *
 * Exactness bound: an int32 lane sums K / 8 products of |w| ≤ 128 and |q(x)| ≤ X_LEVELS, so K ≤ INT8_MAX_K
 * keeps every lane below 2³¹; the eight lanes are added in int64. K must be a multiple of 8.
 */
#define DECODE_MAX_ROWS 48  /* decode_layer_int8's rows: a decode step's (speculative verification included) */
#define X_CHUNK_BYTES (192 * 1024)  /* int16 rows of x per pass over the weight: under half of a Zen 3's L2 */
#define INT8_MAX_K 16000
#define X_LEVELS 8191
#define ROWS_TOGETHER 8  /* 8 accumulators + 2 weight vectors in the 16 registers */
/* Weight bytes ahead that the dot product asks for (software prefetch): the hardware prefetchers alone left a
 * one-row product of the small model's weights 10 % slower (same-run A/B, BENCHMARKS.md, 2026-12-04). */
#define PREFETCH_BYTES 1024
#define BLOCK_BYTES 16384  /* weight rows per block: as many as fit in these bytes (half of L1d), at least one */
#define KBLOCK_ROWS 64  /* int8_kblock_share: weight rows whose sums a thread carries across the feature slices */
#define L1D_BYTES (32 * 1024)  /* the L1d of the AVX2-only CPUs this kernel serves (Zen 2 and 3, Haswell to Skylake) */

static inline int64_t hsum_epi32_exact(const __m256i v) {
    const __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                          _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
    const __m128i two = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    return _mm_cvtsi128_si64(two) + _mm_extract_epi64(two, 1);
}

/* Row m of x as int16 in xq and its scale, as torch computes round(x / (max(max|x|, 1e-12) / X_LEVELS)). */
static void quantize_row_int16(const float *x, const int64_t K, int16_t *xq, float *x_scale) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax8 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) amax8 = _mm256_max_ps(amax8, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
    float lanes[8], amax = 1e-12f;
    _mm256_storeu_ps(lanes, amax8);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    const float scale = amax / (float)X_LEVELS;
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t k = 0; k < K; k += 8) {  /* cvtps rounds half to even (the default rounding mode) */
        const __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + k), scale8));
        _mm_storeu_si128((__m128i *)(xq + k), _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
    }
    *x_scale = scale;
}

/* The integer sums of `count` (1 to ROWS_TOGETHER) rows of xq (row stride `x_stride`) with one weight row over `length`
 * features (a multiple of 8), added to sums[m], exactly (see the bound above); `ahead[k]` (or nothing where NULL) is
 * fetched while w[k] is multiplied. */
static inline __attribute__((always_inline)) void int8_dot_partial(
    const int count, const int16_t *xq, const int64_t x_stride, const int64_t length, const int8_t *w,
    const int8_t *ahead, int64_t *sums) {
    __m256i acc[ROWS_TOGETHER];
    for (int m = 0; m < count; m++) acc[m] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 32 <= length; k += 32) {
        if (ahead) _mm_prefetch((const char *)(ahead + k), _MM_HINT_T0);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k + 16)));
        for (int m = 0; m < count; m++) {
            const int16_t *x_row = xq + m * x_stride + k;
            const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x_row));
            const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x_row + 16)));
            acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(p0, p1));
        }
    }
    for (; k < length; k += 8) {
        const __m128i w_part = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + k)));
        for (int m = 0; m < count; m++) {
            const __m128i p = _mm_madd_epi16(w_part, _mm_loadu_si128((const __m128i *)(xq + m * x_stride + k)));
            acc[m] = _mm256_add_epi32(acc[m], _mm256_zextsi128_si256(p));
        }
    }
    for (int m = 0; m < count; m++) sums[m] += hsum_epi32_exact(acc[m]);
}

/* out[m][n] for the `count` (1 to ROWS_TOGETHER) rows of xq from `xq`. */
static inline __attribute__((always_inline)) void int8_dot(
    const int count, const int16_t *xq, const float *x_scale, const int64_t K, const int8_t *w_row,
    const float w_scale, const float *bias, float *out, const int64_t N) {
    int64_t sums[ROWS_TOGETHER] = {0};
    int8_dot_partial(count, xq, K, K, w_row, w_row + PREFETCH_BYTES, sums);
    for (int m = 0; m < count; m++) {
        const float y = ((float)sums[m] * x_scale[m]) * w_scale;
        out[m * N] = bias ? y + *bias : y;
    }
}

/* Whether `int8_gemv_share` takes the features in slices (`int8_kblock_share`): where a group of input rows (up to
 * ROWS_TOGETHER of them) does not fit L1d. On a Zen 4 running the AVX2 build the down projections (K 4,864 and
 * 8,960) then ran 1.1-1.4x faster at 3 to 48 rows than weight rows in pairs (the path before), the same bits. */
static inline int int8_kblock_takes(const int64_t rows, const int64_t K) {
    const int64_t group = rows < ROWS_TOGETHER ? rows : ROWS_TOGETHER;
    return rows >= 2 && group * K * (int64_t)sizeof(int16_t) > L1D_BYTES;
}

/* This thread's share of the output features where a group of input rows outgrows L1d (the down projections' K):
 * the features in slices whose int16 copies for the group fill half of L1d, each slice against every weight row
 * of a block of KBLOCK_ROWS, the integer sums carried from slice to slice. The group's slice is read from L1
 * for every weight row, where `int8_dot` would read the whole rows from L2; the weight still streams from memory
 * once, a slice of a row at a time. The same integer sums as `int8_dot`, so the same bits. */
static void int8_kblock_share(const int16_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                              const int8_t *w, const float *w_scale, const float *bias, float *out, const int64_t N) {
    const int64_t group = rows < ROWS_TOGETHER ? rows : ROWS_TOGETHER;
    const int64_t fitting = L1D_BYTES / 2 / (group * (int64_t)sizeof(int16_t)) / 32 * 32;
    const int64_t slice = fitting > 32 ? fitting : 32;
    int64_t sums[KBLOCK_ROWS * ROWS_TOGETHER];
    int64_t begin, end;
    thread_share(N, &begin, &end);
    for (int64_t block = begin; block < end; block += KBLOCK_ROWS) {
        const int64_t block_end = block + KBLOCK_ROWS < end ? block + KBLOCK_ROWS : end;
        for (int64_t m = 0; m < rows; m += ROWS_TOGETHER) {
            const int count = rows - m < ROWS_TOGETHER ? (int)(rows - m) : ROWS_TOGETHER;
            memset(sums, 0, sizeof(sums));
            for (int64_t k = 0; k < K; k += slice) {
                const int64_t length = K - k < slice ? K - k : slice;
                for (int64_t n = block; n < block_end; n++) {
                    const int8_t *next = n + 1 < block_end ? w + (n + 1) * K + k : NULL;
                    int64_t *row_sums = sums + (n - block) * ROWS_TOGETHER;
                    switch (count) {  /* constant counts: registers */
#define ROWS(r) case r: int8_dot_partial(r, xq + m * K + k, K, length, w + n * K + k, next, row_sums); break;
                        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
                    }
                }
            }
            for (int64_t n = block; n < block_end; n++)
                for (int r = 0; r < count; r++) {
                    const float y = ((float)sums[(n - block) * ROWS_TOGETHER + r] * x_scale[m + r]) * w_scale[n];
                    out[(m + r) * N + n] = bias ? y + bias[n] : y;
                }
        }
    }
}

/* Rows [0, rows) of x quantised into xq and x_scale, split among the threads of the enclosing team (an
 * orphaned `omp for`: its implicit barrier ends it). */
static void quantize_rows_int16(const float *x, const int64_t rows, const int64_t K, int16_t *xq, float *x_scale) {
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; m++) quantize_row_int16(x + m * K, K, xq + m * K, x_scale + m);
}

/* This thread's share of the output features of q(x) · wᵀ: called by every thread of a team, no barrier. */
static void int8_gemv_share(const int16_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                            const int8_t *w, const float *w_scale, const float *bias, float *out, const int64_t N) {
    if (int8_kblock_takes(rows, K)) {
        int8_kblock_share(xq, x_scale, rows, K, w, w_scale, bias, out, N);
        return;
    }
    const int64_t n_block = BLOCK_BYTES / K > 1 ? BLOCK_BYTES / K : 1;
    int64_t begin, end;
    thread_share(N, &begin, &end);
    for (int64_t block = begin; block < end; block += n_block) {
        const int64_t block_end = block + n_block < end ? block + n_block : end;
        for (int64_t m = 0; m < rows; m += ROWS_TOGETHER)
            for (int64_t n = block; n < block_end; n++) {
                const float *row_bias = bias ? bias + n : NULL;
                const int16_t *x_rows = xq + m * K;
                float *row_out = out + m * N + n;
                switch (rows - m < ROWS_TOGETHER ? rows - m : ROWS_TOGETHER) {  /* constant counts: registers */
#define ROWS(r) case r: int8_dot(r, x_rows, x_scale + m, K, w + n * K, w_scale[n], row_bias, row_out, N); break;
                    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
                }
            }
    }
}

static inline int int8_gemv_takes(const int64_t rows, const int64_t K) {
    return rows >= 1 && K >= 8 && K <= INT8_MAX_K && K % 8 == 0;
}

/* Rows per pass over the weight: a multiple of ROWS_TOGETHER whose int16 copies fill at most X_CHUNK_BYTES. */
static inline int64_t rows_per_pass(const int64_t K) {
    const int64_t fitting = X_CHUNK_BYTES / (K * (int64_t)sizeof(int16_t)) / ROWS_TOGETHER * ROWS_TOGETHER;
    return fitting > ROWS_TOGETHER ? fitting : ROWS_TOGETHER;
}

/* x [rows, K] float32; w [N, K] int8; w_scale [N] float32; bias [N] float32 or NULL; out [rows, N]
 * float32. Returns 0; -1 if rows < 1 or K is not a multiple of 8 in [8, INT8_MAX_K]; -2 if scratch memory
 * is not available. */
int int8_gemv(const float *x, const int64_t rows, const int64_t K, const int8_t *w, const float *w_scale,
              const float *bias, float *out, const int64_t N, const int threads) {
    if (!int8_gemv_takes(rows, K)) return -1;
    int16_t *xq = malloc(rows * K * sizeof(int16_t));
    float *x_scale = malloc(rows * sizeof(float));
    if (!xq || !x_scale) {
        free(xq);
        free(x_scale);
        return -2;
    }
    const int64_t pass = rows_per_pass(K);
    #pragma omp parallel num_threads(threads)
    {
        quantize_rows_int16(x, rows, K, xq, x_scale);
        for (int64_t m = 0; m < rows; m += pass)  /* each thread writes only its own output features: no barrier */
            int8_gemv_share(xq + m * K, x_scale + m, rows - m < pass ? rows - m : pass, K, w, w_scale, bias,
                            out + m * N, N);
    }
    free(xq);
    free(x_scale);
    return 0;
}

int decode_layer_max_rows(void) { return DECODE_MAX_ROWS; }
int int8_gemv_max_k(void) { return INT8_MAX_K; }
int int8_gemv_x_levels(void) { return X_LEVELS; }

/* -- paged_decode_attention ---------------------------------------------------------------------------
 * One query token per row attending over its sequence's context in the paged KV cache, read in place
 * through the block table (no gathered copy, no mask): row t sees positions [0, context_lens[t]).
 * K/V are float32 or bfloat16 (widened exactly); scores, softmax and the weighted sum in float32.
 * Query heads sharing a KV head are done together, so each K/V vector is read once per group.
 * Threads split the (row, KV head) pairs. Two builds of the same algorithm: eight lanes (AVX2, here) and
 * sixteen (AVX-512, below); `paged_decode_attention` on the Python side picks the CPU's.
 */
#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

int paged_decode_attention_limits(int64_t *max_head_dim, int64_t *max_group) {
    *max_head_dim = MAX_HEAD_DIM;
    *max_group = MAX_GROUP;
    return 0;
}

/* Where position p's K (or V) vector of KV head kvh lives in the paged cache. The block size is a power of
 * two, 1 << block_shift: a shift and a mask instead of a 64-bit division per position read. */
static inline const void *key_vector(const void *cache, const int64_t *table, const int block_shift,
                                     const int64_t kv_heads, const int64_t kvh, const int64_t head_dim,
                                     const int64_t p, const int bf16) {
    const int64_t slot = (table[p >> block_shift] << block_shift) + (p & ((1 << block_shift) - 1));
    const int64_t index = (slot * kv_heads + kvh) * head_dim;
    return bf16 ? (const void *)((const uint16_t *)cache + index) : (const void *)((const float *)cache + index);
}

/* Positions a decode row's read of the cache asks ahead for (software prefetch). Once blocks have been freed and taken
 * again, a sequence's blocks are seldom all adjacent in memory, and at each jump the hardware's prefetchers start
 * over: attention over blocks lying backwards or scattered took up to twice as long as over adjacent ones, and
 * asking 24 positions ahead won back most of the difference (`python -m bench.kernels`' block-order table;
 * BENCHMARKS.md, 2026-12-06, "blocks in memory order"). */
#define KV_PREFETCH_AHEAD 24

/* Position p's K (or V) vector of KV head kvh into L1, if p < fetch_end: the context's length, or 0 where nothing is
 * fetched ahead (prefill chunks, whose rows read one sequence's K/V again and again from cache: there the lookups
 * only cost time). Always inlined: GCC deletes calls to a function that only prefetches, as calls without side
 * effects. */
static inline __attribute__((always_inline)) void prefetch_position(
    const void *cache, const int64_t *table, const int block_shift, const int64_t kv_heads, const int64_t kvh,
    const int64_t head_dim, const int64_t p, const int64_t fetch_end, const int bf16) {
    if (p >= fetch_end) return;
    const char *vector = key_vector(cache, table, block_shift, kv_heads, kvh, head_dim, p, bf16);
    const int64_t bytes = head_dim * (bf16 ? 2 : 4);
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(vector + line, _MM_HINT_T0);
}

static inline float hsum8(const __m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

static inline float hmax8(const __m256 v) {
    const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}

static inline __m256 load8(const void *base, const int64_t index, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + index);
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

/* Four sums of eight lanes each, [a, b, c, d]. */
static inline __m128 hsum4_ps8(const __m256 a, const __m256 b, const __m256 c, const __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* y · 2^n (n integral) by adding n to the exponent field; at n = -126, exp's lowest, that can give a
 * denormal's bits (< 1e-37: as good as 0 beside the row's maximum, whose term is 1). */
static inline __m256 scale_pow2_256(const __m256 y, const __m256 n) {
    const __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), exponent));
}

#define VEC __m256
#define LANES 8
#define V_ZERO _mm256_setzero_ps
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_SET1 _mm256_set1_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_FMADD _mm256_fmadd_ps
#define V_FNMADD _mm256_fnmadd_ps
#define V_MAX _mm256_max_ps
#define V_ROUND(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_SCALE_POW2 scale_pow2_256
#define V_LOAD_KV load8
#define V_HSUM hsum8
#define V_HMAX hmax8
#define V_HSUM4 hsum4_ps8
#define V_EXP exp256
#define TILE_ROWS tile_rows_avx2
#define ACCUMULATE_V accumulate_v_avx2
#define ATTEND_TASKS attend_tasks_avx2
#define PAGED_DECODE_ATTEND paged_decode_attend_avx2
#define PAGED_DECODE_ATTENTION paged_decode_attention_avx2
#include "cpu_attention.inc"
#undef VEC
#undef LANES
#undef V_ZERO
#undef V_LOAD
#undef V_STORE
#undef V_SET1
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_FMADD
#undef V_FNMADD
#undef V_MAX
#undef V_ROUND
#undef V_SCALE_POW2
#undef V_LOAD_KV
#undef V_HSUM
#undef V_HMAX
#undef V_HSUM4

/* -- the tile order: the int8 weight layout of `w8a8_amx` and `w8a8_vnni` -------------------------------------
 * Groups of TILE_GROUP output features, and in each group one 4 KiB block per TILE_K_CHUNK inputs holding four
 * slices of 16 features × 16 quads of inputs; a quad of a slice (64 bytes) holds its 16 features' inputs
 * 4q..4q+3: an AMX B tile's row, and one `vpdpbusd` operand. AMX loads a slice's 16 quads as one tile, so there a
 * block is slice-major ([slice][quad]); `w8a8_vnni` reads the four slices' quad q together, so for it a block is
 * quad-major ([quad][slice]): one sequential stream, which the prefetchers follow better (~10% more bandwidth at
 * one row on a Zen 4). A group's blocks are contiguous, so each thread reads one sequential stream; N and K
 * are padded with zeros to multiples of 64.
 */
#define TILE_GROUP 64
#define TILE_K_CHUNK 64
#define TILE_BLOCK_BYTES (TILE_GROUP * TILE_K_CHUNK)

/* w [N, K] int8 → packed [ceil(N / 64), ceil(K / 64), 4096] int8, zero-padded; blocks quad-major or slice-major.
 * row_sums [N] int32 (Σₖ w[n, k], for `w8a8_vnni`), or NULL. */
void w8a8_tile_pack(const int8_t *w, const int64_t N, const int64_t K, const int quad_major, int8_t *packed,
                    int32_t *row_sums) {
    const int64_t groups = (N + TILE_GROUP - 1) / TILE_GROUP, chunks = (K + TILE_K_CHUNK - 1) / TILE_K_CHUNK;
    const int64_t slice_bytes = quad_major ? 64 : 1024, quad_bytes = quad_major ? 256 : 64;
    memset(packed, 0, groups * chunks * TILE_BLOCK_BYTES);
    for (int64_t n = 0; n < N; n++) {
        const int64_t group = n / TILE_GROUP, slice = (n % TILE_GROUP) / 16, feature = n % 16;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; k++) {
            const int64_t chunk = k / TILE_K_CHUNK, quad = (k % TILE_K_CHUNK) / 4;
            packed[(group * chunks + chunk) * TILE_BLOCK_BYTES + slice * slice_bytes + quad * quad_bytes + feature * 4
                   + k % 4] = w[n * K + k];
            sum += w[n * K + k];
        }
        if (row_sums) row_sums[n] = sum;
    }
}

/* The w8a8 kernels' pieces (defined in their target regions below) that the decode layer calls when its products
 * are w8a8: on AMX tiles, or through VNNI dot products. */
static void quantize_rows_int8(const float *x, const int64_t rows, const int64_t K, int8_t *xq, float *x_scale);
static void w8a8_amx_share(const int8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                           const int8_t *packed, const float *w_scale, const float *bias, float *out, const int64_t N);
static void paged_decode_attend_avx512(const float *q, const void *k_cache, const void *v_cache, const int bf16,
                                       const int64_t *block_tables, const int64_t max_blocks,
                                       const int64_t *context_lens, const int64_t rows, const int64_t heads,
                                       const int64_t kv_heads, const int64_t head_dim, const int block_shift,
                                       const float scale, const int fetch_ahead, float *out, int *status);
static void paged_decode_attend_avx512bf16(const float *q, const void *k_cache, const void *v_cache, const int bf16,
                                           const int64_t *block_tables, const int64_t max_blocks,
                                           const int64_t *context_lens, const int64_t rows, const int64_t heads,
                                           const int64_t kv_heads, const int64_t head_dim, const int block_shift,
                                           const float scale, const int fetch_ahead, float *out, int *status);
static void paged_decode_attend_amx(const float *q, const void *k_cache, const void *v_cache, const int bf16,
                                    const int64_t *block_tables, const int64_t max_blocks, const int64_t *context_lens,
                                    const int64_t rows, const int64_t heads, const int64_t kv_heads,
                                    const int64_t head_dim, const int block_shift, const float scale,
                                    const int fetch_ahead, float *out, int *status);
static void quantize_rows_vnni(const float *x, const int64_t rows, const int64_t K, uint8_t *xq, float *x_scale);
static void w8a8_amx_silu_mul_share(const int8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                                    const int8_t *packed, const float *w_scale, const float *bias, float *out,
                                    const int64_t N, float *scratch);
static void w8a8_vnni_silu_mul_share(const uint8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                                     const int8_t *packed, const int32_t *w_sum, const float *w_scale,
                                     const float *bias, float *out, const int64_t N, float *scratch);
static void w8a8_vnni_share(const uint8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                            const int8_t *packed, const int32_t *w_sum, const float *w_scale, const float *bias,
                            float *out, const int64_t N);

/* -- decode_layer_int8 (AVX2) -----------------------------------------------------------------------
 * One Llama / Qwen2 decoder layer for a decode step's rows, in one call: RMSNorm, the q/k/v product, RoPE,
 * the new K/V into the paged cache, paged attention, the output product and residual, RMSNorm, gate/up,
 * SiLU · up, the down product and residual. Each step is a PyTorch op or a kernel call on the PyTorch side,
 * ~20 of them per layer at tens of microseconds each, which at batch 1 is a third of a step's time beside
 * the weights streaming through `int8_gemv` (BENCHMARKS.md). Here they run in one team of threads with a
 * barrier between steps; every product is `int8_gemv`'s and the attention is `paged_decode_attention`'s,
 * so the rows keep their properties: each row's result is the same bits whatever else shares the call.
 * The element-wise steps are the PyTorch module's arithmetic in float32 (RMSNorm's sum of squares and
 * SiLU's exponential in another order and polynomial: a few ulp apart). Runs only where every product of
 * the layer is of one kind (`products` in the shape) on float32 activations: int8 weight-only (`int8_gemv`'s
 * arithmetic) or w8a8 over the weights in tile order, on AMX tiles (`w8a8_amx`'s) or through VNNI dot products
 * (`w8a8_vnni`'s) (`engines.models.llama.LlamaForCausalLM.native_decoder`).
 */
enum layer_products { INT8_WEIGHT_ONLY = 0, W8A8_AMX = 1, W8A8_VNNI = 2 };

struct int8_linear {  /* weight [out, in] int8 (or in tile order: w8a8_tile_pack), scale [out], bias [out] or NULL */
    const int8_t *weight;
    const float *scale, *bias;
    const int32_t *weight_sum;  /* [out] Σₖ w[n, k] for W8A8_VNNI's unsigned activations; NULL otherwise */
    int32_t activation_passes;  /* 1, or 2: a w8a8 input in two int8 passes (`quantize_project`); not gate_up's */
};

struct decoder_layer {
    const float *input_norm, *post_attention_norm;  /* [hidden] */
    struct int8_linear qkv, o, gate_up, down;  /* [q + 2 kv, hidden], [hidden, q], [2 intermediate, hidden], [hidden, intermediate] */
    void *k_cache, *v_cache;  /* [slots, kv_heads, head_dim], float32 or bfloat16 (kv_bf16) */
};

struct decoder_shape {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float rms_norm_eps, attention_scale;
    int32_t kv_bf16;
    int32_t products;  /* enum layer_products */
    int32_t bf16_dot;  /* a bfloat16 cache is attended by the `vdpbf16ps` build (1), or with q · k on AMX tiles (2) */
};

struct decode_rows {  /* this step's decode rows, shared by every layer of the step */
    int64_t rows;
    const float *cos, *sin;  /* [rows, head_dim]: the rows' positions in the RoPE tables (sin signed, see apply_rope) */
    const int64_t *slot_mapping;  /* [rows] */
    const int64_t *block_tables;  /* [rows, max_blocks] */
    int64_t max_blocks;
    const int64_t *context_lens;  /* [rows] */
    float *workspace;  /* decode_layer_workspace_floats(shape, rows) floats, 32-byte aligned */
};

#define ALIGN_FLOATS(n) (((n) + 7) / 8 * 8)

static inline int64_t widest_input(const struct decoder_shape *s) {
    const int64_t q_size = s->heads * s->head_dim, widest = s->hidden > q_size ? s->hidden : q_size;
    return widest > s->intermediate ? widest : s->intermediate;
}

/* Floats a quantised input row takes: int16 [widest], or int8 padded to whole AMX tiles. */
static inline int64_t quantized_row_floats(const int64_t widest) {
    const int64_t int16_floats = (widest + 1) / 2, int8_floats = (widest + 63) / 64 * 64 / 4;
    return ALIGN_FLOATS(int16_floats > int8_floats ? int16_floats : int8_floats);
}

/* The widest output of a product whose input may take two passes (q/k/v, o, down). */
static inline int64_t widest_pass_output(const struct decoder_shape *s) {
    const int64_t qkv = (s->heads + 2 * s->kv_heads) * s->head_dim;
    return qkv > s->hidden ? qkv : s->hidden;
}

/* Per row: the float32 input, two quantised inputs (a second pass's beside the first), q/k/v, gate/up, a product's
 * output, a second pass's float32 input, and both passes' outputs; then two input scales. */
int64_t decode_layer_workspace_floats(const struct decoder_shape *s, const int64_t rows) {
    const int64_t widest = widest_input(s), qkv = (s->heads + 2 * s->kv_heads) * s->head_dim;
    return rows * (ALIGN_FLOATS(widest) + 2 * quantized_row_floats(widest) + ALIGN_FLOATS(qkv)
                   + ALIGN_FLOATS(2 * s->intermediate) + 2 * ALIGN_FLOATS(widest)
                   + 2 * ALIGN_FLOATS(widest_pass_output(s))) + ALIGN_FLOATS(2 * rows);
}

static void rms_norm_row(const float *x, const float *weight, const int64_t K, const float eps, float *out) {
    __m256 squares = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        squares = _mm256_add_ps(squares, _mm256_mul_ps(v, v));
    }
    const __m256 r = _mm256_set1_ps(1.f / sqrtf(hsum8(squares) / (float)K + eps));
    for (int64_t k = 0; k < K; k += 8)
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(weight + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), r)));
}

/* RMSNorm of x [rows, K] (K a multiple of 8) into out, each row as the decode layer normalises its rows: the
 * model's norms on the CPU, so that a decode row computed among a prefill chunk's rows (`engines.model_runner`)
 * is the same bits as through the decode layer. Returns 0, or -1 on bad sizes. */
int rms_norm_rows(const float *x, const float *weight, const int64_t rows, const int64_t K, const float eps,
                  float *out, const int threads) {
    if (K % 8) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < rows; m++) rms_norm_row(x + m * K, weight, K, eps, out + m * K);
    return 0;
}

/* out = x · cos + rotate_half(x) · signed sin over one head of head_dim (even; out may be x), as
 * engines.models.llama.apply_rope computes it: products, then their sum (no fused multiply-add), the same bits. */
static void rope_head(const float *x, const float *cos, const float *sin, const int64_t head_dim, float *out) {
    const int64_t half = head_dim / 2;
    int64_t d = 0;
    for (; d + 8 <= half; d += 8) {  /* each store after both of its lanes' loads: in place is safe */
        const __m256 first = _mm256_loadu_ps(x + d), second = _mm256_loadu_ps(x + half + d);
        _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_mul_ps(first, _mm256_loadu_ps(cos + d)),
                                                _mm256_mul_ps(second, _mm256_loadu_ps(sin + d))));
        _mm256_storeu_ps(out + half + d, _mm256_add_ps(_mm256_mul_ps(second, _mm256_loadu_ps(cos + half + d)),
                                                       _mm256_mul_ps(first, _mm256_loadu_ps(sin + half + d))));
    }
    for (; d < half; d++) {
        const float first = x[d], second = x[half + d];
        out[d] = first * cos[d] + second * sin[d];
        out[half + d] = second * cos[half + d] + first * sin[half + d];
    }
}

/* apply_rope over rows, `rope_head` for each head: out [rows, heads, head_dim], x's rows `x_stride` floats apart
 * (the q and k heads of a q/k/v product's rows), cos and sin [rows, head_dim]. A head of a multiple of 16 dims.
 * Returns 0, or -1 on bad sizes. */
int rope_rows(const float *x, const int64_t x_stride, const float *cos, const float *sin, const int64_t rows,
              const int64_t heads, const int64_t head_dim, float *out, const int threads) {
    if (head_dim % 16) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < rows; m++)
        for (int64_t h = 0; h < heads; h++)
            rope_head(x + m * x_stride + h * head_dim, cos + m * head_dim, sin + m * head_dim, head_dim,
                      out + (m * heads + h) * head_dim);
    return 0;
}

static inline uint16_t bfloat16_bits(const float value) {  /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays a quiet NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static void store_kv(void *cache, const int bf16, const int64_t slot, const float *values, const int64_t count) {
    if (bf16)
        for (int64_t i = 0; i < count; i++) ((uint16_t *)cache)[slot * count + i] = bfloat16_bits(values[i]);
    else
        memcpy((float *)cache + slot * count, values, sizeof(float) * (size_t)count);
}

/* silu(gate) · up, silu(g) = g / (1 + e^-g), with e^-|g| (exp256 takes x ≤ 0) for either sign of g. */
static void silu_mul_row(const float *gate, const float *up, const int64_t K, float *out) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 g = _mm256_loadu_ps(gate + k);
        const __m256 e = exp256(_mm256_or_ps(g, sign));  /* e^-|g| */
        const __m256 positive = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
        const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + k)));
    }
}

/* Rows [0, rows) of x quantised for the layer's products into xq (int16; int8 padded to whole tiles; or int8
 * shifted to uint8), split among the team's threads; the `omp for` ends in a barrier. */
static void quantize_inputs(const enum layer_products products, const float *x, const int64_t rows, const int64_t K,
                            void *xq, float *x_scale) {
    switch (products) {
        case W8A8_AMX: quantize_rows_int8(x, rows, K, xq, x_scale); break;
        case W8A8_VNNI: quantize_rows_vnni(x, rows, K, xq, x_scale); break;
        default: quantize_rows_int16(x, rows, K, xq, x_scale);
    }
}

/* Every row's product through the layer's arithmetic, each thread its share of the output features, then a
 * barrier: the team reads `out` next. (Its input rows were quantised in an `omp for`, which ends in one.) */
static void project(const enum layer_products products, const void *xq, const float *x_scale, const int64_t rows,
                    const int64_t K, const struct int8_linear *linear, float *out, const int64_t N) {
    switch (products) {
        case W8A8_AMX: w8a8_amx_share(xq, x_scale, rows, K, linear->weight, linear->scale, linear->bias, out, N); break;
        case W8A8_VNNI:
            w8a8_vnni_share(xq, x_scale, rows, K, linear->weight, linear->weight_sum, linear->scale, linear->bias, out,
                            N);
            break;
        default: int8_gemv_share(xq, x_scale, rows, K, linear->weight, linear->scale, linear->bias, out, N);
    }
    #pragma omp barrier
}

/* x − round(x / scale) · scale over a row, `scale` its `quantize_row_bytes` scale: what rounding it to int8 levels
 * left, the input of its second pass. torch's `x - torch.round(x / s) * s` (`engines.quantization.residual_rows`),
 * each operation rounded alone, rounding half to even: the same bits. */
static void residual_row(const float *x, const int64_t K, const float scale, float *out) {
    const __m256 scale8 = _mm256_set1_ps(scale);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        const __m256 q = _mm256_round_ps(_mm256_div_ps(v, scale8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_ps(out + k, _mm256_sub_ps(v, _mm256_mul_ps(q, scale8)));
    }
    for (; k < K; k++) out[k] = x[k] - nearbyintf(x[k] / scale) * scale;
}

struct pass_scratch {  /* what a product's inputs take in the layer's workspace (`decode_layer_workspace_floats`) */
    void *xq;  /* quantised rows: the first pass's [rows], then a second pass's [rows] */
    float *x_scale;  /* [2 rows], the same order */
    float *residual;  /* [rows, K]: a second pass's float32 input */
    float *passes;  /* [2 rows, N]: both passes' products */
};

/* out [rows, N] = x [rows, K] times the layer's weight, the input quantised for its products: in one pass, or for a
 * w8a8 projection that takes two (`activation_passes`) in two — the rows, then what their rounding left
 * (`residual_row`) — as 2 · rows rows of one product without the bias, each row's two passes summed, then the bias:
 * `engines.quantization.W8A8Linear`'s arithmetic. The second pass leaves at most 1/254 of one pass's rounding error,
 * which is large where a few outlier features set a row's scale. Every thread of the team calls it; it ends in a
 * barrier. */
static void quantize_project(const enum layer_products products, const float *x, const int64_t rows,
                             const int64_t K, const struct int8_linear *linear, const struct pass_scratch *w,
                             float *out, const int64_t N) {
    quantize_inputs(products, x, rows, K, w->xq, w->x_scale);
    if (linear->activation_passes < 2) {
        project(products, w->xq, w->x_scale, rows, K, linear, out, N);
        return;
    }
    const int64_t row_bytes = (K + TILE_K_CHUNK - 1) / TILE_K_CHUNK * TILE_K_CHUNK;  /* w8a8: int8 in whole chunks */
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; m++) residual_row(x + m * K, K, w->x_scale[m], w->residual + m * K);
    quantize_inputs(products, w->residual, rows, K, (uint8_t *)w->xq + rows * row_bytes, w->x_scale + rows);
    struct int8_linear unbiased = *linear;
    unbiased.bias = NULL;
    project(products, w->xq, w->x_scale, 2 * rows, K, &unbiased, w->passes, N);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; m++) {
        const float *first = w->passes + m * N, *second = w->passes + (rows + m) * N;
        float *row = out + m * N;
        for (int64_t n = 0; n < N; n++) row[n] = first[n] + second[n];
        if (linear->bias)
            for (int64_t n = 0; n < N; n++) row[n] += linear->bias[n];
    }
}

/* The product of a w8a8 layer in tile order (`products`: W8A8_AMX or W8A8_VNNI; w_sum for VNNI, else NULL) with x
 * [rows, K] in two passes, as the decode layer multiplies such an input (`quantize_project`): out [rows, N]; xq
 * [2 rows, ceil(K / 64) * 64] bytes, x_scale [2 rows], residual [rows, K] and passes [2 rows, N] float32 are scratch.
 * Returns 0, or -1 for products of another kind. */
int w8a8_two_pass(const int products, const float *x, const int64_t rows, const int64_t K, const int8_t *packed,
                  const int32_t *w_sum, const float *w_scale, const float *bias, float *out, const int64_t N, void *xq,
                  float *x_scale, float *residual, float *passes, const int threads) {
    if (products != W8A8_AMX && products != W8A8_VNNI) return -1;
    const struct int8_linear linear = {packed, w_scale, bias, w_sum, 2};
    const struct pass_scratch scratch = {xq, x_scale, residual, passes};
    #pragma omp parallel num_threads(threads)
    quantize_project((enum layer_products)products, x, rows, K, &linear, &scratch, out, N);
    return 0;
}

/* silu(gate) · up of the rows' gate_up product into out [rows, I], then a barrier. w8a8 products over whole
 * 64-feature groups per half combine each gate group with its up group while both are in cache (the
 * `*_silu_mul_share`s, each thread's [2, rows, 64] scratch in `gate_up`), the same bits as the product of all
 * of them followed by `silu_mul_row`, which the other layers run: `gate_up` [rows, 2 I] holds that product. */
static void project_silu_mul(const struct decoder_shape *s, const void *xq, const float *x_scale, const int64_t rows,
                             const int64_t K, const struct int8_linear *linear, float *gate_up, float *out) {
    const int64_t inter = s->intermediate;
    const int gated = s->products != INT8_WEIGHT_ONLY && inter % TILE_GROUP == 0
                      && omp_get_num_threads() * 2 * TILE_GROUP <= 2 * inter;  /* the scratch fits in gate_up */
    if (gated) {
        float *scratch = gate_up + omp_get_thread_num() * 2 * rows * TILE_GROUP;
        if (s->products == W8A8_AMX)
            w8a8_amx_silu_mul_share(xq, x_scale, rows, K, linear->weight, linear->scale, linear->bias, out, 2 * inter,
                                    scratch);
        else
            w8a8_vnni_silu_mul_share(xq, x_scale, rows, K, linear->weight, linear->weight_sum, linear->scale,
                                     linear->bias, out, 2 * inter, scratch);
        #pragma omp barrier
        return;
    }
    project(s->products, xq, x_scale, rows, K, linear, gate_up, 2 * inter);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; m++)
        silu_mul_row(gate_up + m * 2 * inter, gate_up + m * 2 * inter + inter, inter, out + m * inter);
}

/* x [rows, hidden] float32, the rows' hidden states, updated in place. Returns 0; -1 if the sizes are not
 * the kernels' (rows, a product's in_features, head_dim, heads per KV head, block size); -2 if attention
 * found no scratch memory (x is then not meaningful). */
int decode_layer_int8(const struct decoder_layer *layer, const struct decoder_shape *s,
                      const struct decode_rows *step, float *x, const int threads) {
    const int64_t rows = step->rows, hidden = s->hidden, head_dim = s->head_dim;
    const int64_t q_size = s->heads * head_dim, kv_size = s->kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    const int64_t inter = s->intermediate;
    if (rows > DECODE_MAX_ROWS || !int8_gemv_takes(rows, hidden) || !int8_gemv_takes(rows, q_size)
        || !int8_gemv_takes(rows, inter))
        return -1;
    if (head_dim % 8 || head_dim > MAX_HEAD_DIM || s->heads % s->kv_heads || s->heads / s->kv_heads > MAX_GROUP)
        return -1;
    if (s->block_size < 1 || s->block_size & (s->block_size - 1) || inter % 8) return -1;
    const int two_passes = layer->qkv.activation_passes > 1 || layer->o.activation_passes > 1
                           || layer->down.activation_passes > 1;
    if (layer->gate_up.activation_passes > 1 || (two_passes && s->products == INT8_WEIGHT_ONLY)) return -1;
    const int block_shift = __builtin_ctzll((unsigned long long)s->block_size);
    const int64_t widest = widest_input(s);
    float *h = step->workspace;  /* a product's float32 input rows, [rows, widest] */
    void *xq = h + rows * ALIGN_FLOATS(widest);  /* the same rows quantised: int16 [rows, widest] or int8 padded */
    float *qkv = h + rows * (ALIGN_FLOATS(widest) + 2 * quantized_row_floats(widest));
    float *gate_up = qkv + rows * ALIGN_FLOATS(qkv_size);
    float *y = gate_up + rows * ALIGN_FLOATS(2 * inter);  /* a product's output rows or the packed q, [rows, widest] */
    float *residual = y + rows * ALIGN_FLOATS(widest);
    float *passes = residual + rows * ALIGN_FLOATS(widest);
    float *x_scale = passes + 2 * rows * ALIGN_FLOATS(widest_pass_output(s));
    const struct pass_scratch scratch = {xq, x_scale, residual, passes};
    /* w8a8 layers run only on CPUs with AVX-512 (AMX or VNNI): their attention takes the sixteen-lane build where
     * the head fills whole vectors of it, with bfloat16 dot products where the CPU has them. */
    void (*const attend)(const float *, const void *, const void *, int, const int64_t *, int64_t, const int64_t *,
                         int64_t, int64_t, int64_t, int64_t, int, float, int, float *, int *) =
        s->products == INT8_WEIGHT_ONLY || head_dim % 16 ? paged_decode_attend_avx2
        : s->bf16_dot == 2 ? paged_decode_attend_amx
        : s->bf16_dot ? paged_decode_attend_avx512bf16 : paged_decode_attend_avx512;
    int status = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            rms_norm_row(x + m * hidden, layer->input_norm, hidden, s->rms_norm_eps, h + m * hidden);
        quantize_project(s->products, h, rows, hidden, &layer->qkv, &scratch, qkv, qkv_size);
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) {
            float *row = qkv + m * qkv_size;
            for (int64_t head = 0; head < s->heads + s->kv_heads; head++)  /* q's heads, then k's */
                rope_head(row + head * head_dim, step->cos + m * head_dim, step->sin + m * head_dim, head_dim,
                          row + head * head_dim);
            store_kv(layer->k_cache, s->kv_bf16, step->slot_mapping[m], row + q_size, kv_size);
            store_kv(layer->v_cache, s->kv_bf16, step->slot_mapping[m], row + q_size + kv_size, kv_size);
        }
        /* q rows are qkv_size apart: attend from a packed copy (the attention kernel's layout). */
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) memcpy(y + m * q_size, qkv + m * qkv_size, sizeof(float) * (size_t)q_size);
        attend(
            y, layer->k_cache, layer->v_cache, s->kv_bf16, step->block_tables, step->max_blocks, step->context_lens,
            rows, s->heads, s->kv_heads, head_dim, block_shift, s->attention_scale, 1, h, &status);
        quantize_project(s->products, h, rows, q_size, &layer->o, &scratch, y, hidden);
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) {
            float *x_row = x + m * hidden;
            for (int64_t k = 0; k < hidden; k++) x_row[k] += y[m * hidden + k];
            rms_norm_row(x_row, layer->post_attention_norm, hidden, s->rms_norm_eps, h + m * hidden);
        }
        quantize_inputs(s->products, h, rows, hidden, xq, x_scale);
        project_silu_mul(s, xq, x_scale, rows, hidden, &layer->gate_up, gate_up, h);
        quantize_project(s->products, h, rows, inter, &layer->down, &scratch, y, hidden);
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t k = 0; k < hidden; k++) x[m * hidden + k] += y[m * hidden + k];
    }
    return status ? -2 : 0;
}

/* -- sample_rows -----------------------------------------------------------------------------------------
 * One draw per row of logits [rows, vocab] float32 from softmax(logits / temperature) restricted to what the row's
 * min-p (min_p > 0), top k (top_k > 0) and top-p nucleus (top_p < 1) keep — engines/sampler.py's `candidates` —
 * in two or three passes over the row where PyTorch makes six or more (a sampled decode step's sampling took a
 * third of its time at 16 requests). `draw_native` there states the rule; its PyTorch path draws the same ids.
 *
 * Per row: pass 1, the maximum; pass 2, the weights e^((x - max) / T) summed per block of SAMPLE_BLOCK ids (float32
 * lanes, each block's sum in double; -inf and NaN weigh 0) and, for a truncated row, its likely ids: those at least
 * min_p as likely as the most likely one (min-p), else at least e^log_share as likely, at most `max_likely` of them
 * (a top-k row short of k such ids, or with too many, moves that bound: `collect_top_k`). A truncated row sorts
 * them (most likely first, lower id first among equals) to find its cut: the last id it keeps. What it keeps is the
 * k most likely (of the min-p set), then the smallest prefix of those whose mass — over the row's, or over the top
 * k's or the min-p set's own where the row has one — reaches top_p (an id is dropped when the mass before it
 * already does; the first always stays). A top-p row whose nucleus goes on past its likely ids finds the cut from
 * a histogram of its mass by distance from the maximum (`nucleus_cut`).
 *
 * The draw, with one uniform variate u: the id at which the kept weights' cumulative sum, in id order, first exceeds
 * u · their total (the blocks' sums first, then within the block; kept ids few enough to be listed are walked
 * directly). ids[r] is that id, or -1 where the row is left to the caller: no finite maximum, or a cut not found
 * among at most `max_likely` ids. At temperature 1 without min-p, pass 2 summed e^(x - max) over the whole row:
 * logprobs[r] is then the drawn id's log-softmax, `logprob_rows`' bits (what the cascade asks of every sampled
 * token), else NaN. Returns 0, or -1 where scratch memory could not be had (nothing drawn then). */
#define SAMPLE_BLOCK 1024
#define GAP_BINS 2048  /* `nucleus_cut`'s histogram: 1/32 nat a bin, 64 nats (ids beyond weigh < 1.7e-28 each) */
#define GAP_BINS_PER_NAT 32.f

struct likely_id { float logit; int32_t id; };

struct sample_scratch {
    double *block_sums;        /* [blocks] */
    double *bins;              /* [GAP_BINS] */
    float *w;                  /* [SAMPLE_BLOCK] */
    struct likely_id *likely;  /* [max_likely] */
};

/* How many ids the block of SAMPLE_BLOCK starting at id `begin` holds (the last one fewer). */
static inline int64_t block_length(const int64_t vocab, const int64_t begin) {
    return vocab - begin < SAMPLE_BLOCK ? vocab - begin : SAMPLE_BLOCK;
}

static int more_likely_first(const void *a, const void *b) {
    const struct likely_id *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static int lower_id_first(const void *a, const void *b) {
    const struct likely_id *x = a, *y = b;
    return (x->id > y->id) - (x->id < y->id);
}

static float row_max(const float *x, const int64_t vocab) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int64_t i = 0;
    for (; i + 32 <= vocab; i += 32) {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
        m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + i + 16));
        m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + i + 24));
    }
    float best = hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (; i < vocab; i++) best = x[i] > best ? x[i] : best;
    return best;
}

static inline float weight_of(const float x, const float max, const float inverse_t) {
    return x > -INFINITY ? expf((x - max) * inverse_t) : 0.f;  /* NaN compares false too */
}

/* What a truncated row keeps: the ids whose logit is above `logit`, and those equal to it up to `id` (the last kept
 * one in the order most likely first, lower id first among equals). */
struct cut { float logit; int64_t id; };
static const struct cut NO_CUT = {-FLT_MAX, INT64_MAX};  /* every finite logit */

/* e^((x[i] - max) · inverse_t) for the ids i in [begin, begin + n) (n ≤ SAMPLE_BLOCK) into w[i - begin], 0 where x[i]
 * is -inf or NaN or not kept by `cut`; returns their sum. */
static double block_weights(const float *x, const int64_t begin, const int64_t n, const float max,
                            const float inverse_t, const struct cut cut, float *w) {
    const __m256 top = _mm256_set1_ps(max), scale = _mm256_set1_ps(inverse_t), floor = _mm256_set1_ps(cut.logit);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + begin + i);
        const __m256 kept = _mm256_cmp_ps(v, floor, _CMP_GE_OQ);  /* -inf and NaN fail it */
        const __m256 e = _mm256_and_ps(exp256(_mm256_mul_ps(_mm256_sub_ps(v, top), scale)), kept);
        _mm256_storeu_ps(w + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    double total = hsum8(sum);
    for (; i < n; i++) {
        w[i] = x[begin + i] >= cut.logit ? expf((x[begin + i] - max) * inverse_t) : 0.f;
        total += w[i];
    }
    if (cut.id < begin + n - 1)  /* ties with the cut's logit past its id are not kept */
        for (int64_t j = cut.id + 1 > begin ? cut.id + 1 - begin : 0; j < n; j++)
            if (x[begin + j] == cut.logit) {
                total -= w[j];
                w[j] = 0.f;
            }
    return total;
}

/* Appends the ids in [begin, begin + n) whose logit is at least `floor` to likely (count in *found, at most
 * `capacity` kept; *found goes on counting past it). */
static void collect_likely(const float *x, const int64_t begin, const int64_t n, const float floor,
                           struct likely_id *likely, const int64_t capacity, int64_t *found) {
    const __m256 bound = _mm256_set1_ps(floor);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + begin + i), bound, _CMP_GE_OQ));
        for (; mask; mask &= mask - 1) {
            const int64_t id = begin + i + __builtin_ctz(mask);
            if (*found < capacity) likely[*found] = (struct likely_id){x[id], (int32_t)id};
            ++*found;
        }
    }
    for (; i < n; i++)
        if (x[begin + i] >= floor) {
            if (*found < capacity) likely[*found] = (struct likely_id){x[begin + i], (int32_t)(begin + i)};
            ++*found;
        }
}

/* For a top-k row whose `found` ids within `gap` nats (tempered) of its maximum are fewer than k or more than
 * `capacity`: a gap that lets through at least *k ids and at most `capacity` (doubled, then bisected between too few
 * and too many; a dozen compare-only passes at most), or, past 128 nats, every finite id (*k lowered to their number
 * where fewer). Returns how many ids were found: more than `capacity` where no gap fits. */
static int64_t collect_top_k(const float *x, const int64_t vocab, const float max, const float inverse_t, float gap,
                             int64_t found, struct likely_id *likely, const int64_t capacity, int64_t *k) {
    float too_few = found < *k ? gap : 0.f, too_many = found < *k ? 0.f : gap;
    for (int pass = 0; pass < 12; pass++) {
        gap = too_many > 0.f ? (too_few + too_many) / 2.f : 2.f * too_few;
        if (gap > 128.f) break;
        found = 0;
        collect_likely(x, 0, vocab, max - gap / inverse_t, likely, capacity, &found);
        if (found >= *k && found <= capacity) return found;
        if (found < *k) too_few = gap;
        else too_many = gap;
    }
    if (too_many > 0.f) return found;
    found = 0;
    collect_likely(x, 0, vocab, -FLT_MAX, likely, capacity, &found);
    *k = *k < found ? *k : found;
    return found;
}

/* How many of `likely` (sorted, most likely first; `width` of them) the top-p rule keeps with the mass over `total`,
 * or 0 where their whole mass stays short of top_p and the list is not `closed` (holds all the row may keep). */
static int64_t nucleus_length(const struct likely_id *likely, const int64_t width, const float max,
                              const float inverse_t, const double total, const float top_p, const int closed) {
    double before = 0.;
    for (int64_t kept = 0; kept < width; kept++) {
        if (kept > 0 && before >= top_p) return kept;
        before += weight_of(likely[kept].logit, max, inverse_t) / total;
    }
    return closed ? width : 0;
}

/* The histogram bin of logit x: its distance below the maximum, `scale` bins a nat, the last bin beyond (NaN too). */
static inline int64_t gap_bin(const float x, const float max, const float scale) {
    const float bin = (max - x) * scale;
    return bin < GAP_BINS - 1 ? (int64_t)bin : GAP_BINS - 1;
}

/* The cut of a top-p row whose nucleus goes on past its likely ids: the mass per bin of distance from the maximum
 * (1/32 nat, tempered) gives the bin in which the kept mass reaches top_p of `total`; that bin's ids, sorted, give
 * the cut. Returns 0, or -1 where that bin holds more than `capacity` ids. */
static int nucleus_cut(const float *x, const int64_t vocab, const float max, const float inverse_t,
                       const double total, const float top_p, struct sample_scratch *s, const int64_t capacity,
                       struct cut *cut) {
    memset(s->bins, 0, GAP_BINS * sizeof *s->bins);
    const float scale = inverse_t * GAP_BINS_PER_NAT;
    for (int64_t begin = 0; begin < vocab; begin += SAMPLE_BLOCK) {
        const int64_t n = block_length(vocab, begin);
        block_weights(x, begin, n, max, inverse_t, NO_CUT, s->w);
        for (int64_t i = 0; i < n; i++)  /* NaN and -inf weigh 0 wherever they land */
            s->bins[gap_bin(x[begin + i], max, scale)] += s->w[i];
    }
    double before = 0.;
    int64_t last = 0;
    for (int64_t b = 0; b < GAP_BINS; b++) {
        if (s->bins[b] <= 0.) continue;
        last = b;
        if ((before + s->bins[b]) / total >= top_p) break;
        before += s->bins[b];
    }
    int64_t found = 0;  /* the ids of bin `last`, most likely first */
    for (int64_t i = 0; i < vocab; i++) {
        if (x[i] > -INFINITY && gap_bin(x[i], max, scale) == last) {
            if (found < capacity) s->likely[found] = (struct likely_id){x[i], (int32_t)i};
            found++;
        }
    }
    if (found > capacity || found == 0) return -1;
    qsort(s->likely, (size_t)found, sizeof *s->likely, more_likely_first);
    int64_t i = 0;
    for (; i + 1 < found; i++) {
        before += weight_of(s->likely[i].logit, max, inverse_t);
        if (before / total >= top_p) break;
    }
    *cut = (struct cut){s->likely[i].logit, s->likely[i].id};
    return 0;
}

/* The draw among `n` listed kept ids (any order; sorted by id here): u · their mass along their cumulative sum. */
static int64_t draw_listed(struct likely_id *kept, const int64_t n, const float max, const float inverse_t,
                           const double u) {
    qsort(kept, (size_t)n, sizeof *kept, lower_id_first);
    double mass = 0.;
    for (int64_t i = 0; i < n; i++) mass += weight_of(kept[i].logit, max, inverse_t);
    const double target = u * mass;
    double sum = 0.;
    int64_t last = kept[0].id;
    for (int64_t i = 0; i < n; i++) {
        const float w = weight_of(kept[i].logit, max, inverse_t);
        if (w <= 0.f) continue;
        sum += w;
        last = kept[i].id;
        if (target < sum) return last;
    }
    return last;
}

/* Σ of the row's weights (`block_weights` block by block, w their scratch), each block's sum also into block_sums
 * where given. */
static double row_weights(const float *x, const int64_t vocab, const float max, const float inverse_t,
                          const struct cut cut, float *w, double *block_sums) {
    double total = 0.;
    for (int64_t begin = 0; begin < vocab; begin += SAMPLE_BLOCK) {
        const double sum = block_weights(x, begin, block_length(vocab, begin), max, inverse_t, cut, w);
        if (block_sums) block_sums[begin / SAMPLE_BLOCK] = sum;
        total += sum;
    }
    return total;
}

/* The draw over what `cut` keeps of the row: its block by the blocks' cumulative masses, then the id within it. */
static int64_t draw_row(const float *x, const int64_t vocab, const float max, const float inverse_t,
                        const struct cut cut, const double u, struct sample_scratch *s, double *total) {
    const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    const double sum = row_weights(x, vocab, max, inverse_t, cut, s->w, s->block_sums), target = u * sum;
    if (total) *total = sum;
    double before = 0., block_before = 0.;
    int64_t block = 0;
    for (int64_t b = 0; b < blocks; b++) {
        if (s->block_sums[b] > 0.) {  /* else the last block with mass, should u · total round up to the total */
            block = b;
            block_before = before;
            if (target < before + s->block_sums[b]) break;
        }
        before += s->block_sums[b];
    }
    const int64_t begin = block * SAMPLE_BLOCK, n = block_length(vocab, begin);
    block_weights(x, begin, n, max, inverse_t, cut, s->w);
    const double residual = target - block_before;
    double mass = 0.;
    int64_t last = begin;
    for (int64_t i = 0; i < n; i++) {
        if (s->w[i] <= 0.f) continue;
        mass += s->w[i];
        last = begin + i;
        if (residual < mass) return last;
    }
    return last;
}

struct sample_options { float temperature, top_p, min_p; int64_t top_k; double u; };

/* The draw of a truncated row among its `found` likely ids (collected up to `capacity`), or -2 where what it keeps
 * goes on past them (a top-p nucleus, or a min-p set too large to list), or -1 where it cannot be drawn here. */
static int64_t draw_likely(const struct sample_options o, const float max, const float inverse_t, const double total,
                           int64_t found, const int64_t capacity, struct likely_id *likely) {
    const int closed = o.top_k > 0 || o.min_p > 0.f;  /* the list holds every id the row may keep */
    if (found > capacity) return closed && o.top_k ? -1 : -2;
    qsort(likely, (size_t)found, sizeof *likely, more_likely_first);
    const int64_t width = o.top_k > 0 && o.top_k < found ? o.top_k : found;
    double mass = total;
    if (closed) {  /* the top k's or the min-p set's own mass normalises them */
        mass = 0.;
        for (int64_t i = 0; i < width; i++) mass += weight_of(likely[i].logit, max, inverse_t);
    }
    const int64_t kept = o.top_p < 1.f ? nucleus_length(likely, width, max, inverse_t, mass, o.top_p, closed) : width;
    return kept > 0 ? draw_listed(likely, kept, max, inverse_t, o.u) : -2;
}

/* The chosen id's log-softmax from the row's maximum and Σ e^(x - max) — `logprob_rows`' arithmetic, the same bits —
 * where the draw summed the whole row at temperature 1 (else NaN): a sampled token's logprob without another pass. */
static float chosen_logprob(const float *x, const int64_t id, const float max, const double total) {
    return id >= 0 && total > 0. ? (x[id] - max) - (float)log(total) : NAN;
}

/* One row's draw (see above), or -1; `*logprob` the drawn id's `chosen_logprob` (NaN where not known). */
static int64_t sample_row(const float *x, const int64_t vocab, struct sample_options o, const float log_share,
                          const int64_t capacity, struct sample_scratch *s, float *logprob) {
    const float max = row_max(x, vocab), inverse_t = 1.f / o.temperature;
    const int whole_row = inverse_t == 1.f && !(o.min_p > 0.f);  /* the sums below are log_softmax's */
    *logprob = NAN;
    if (!isfinite(max)) return -1;
    if (!(o.top_k > 0 || o.top_p < 1.f || o.min_p > 0.f)) {
        double total;
        const int64_t id = draw_row(x, vocab, max, inverse_t, NO_CUT, o.u, s, &total);
        if (whole_row) *logprob = chosen_logprob(x, id, max, total);
        return id;
    }
    /* The likely ids, and the row's mass: the min-p set's where the row has one (its floor is a cut). */
    const struct cut floor = {max + (o.min_p > 0.f ? logf(o.min_p) : log_share) / inverse_t, INT64_MAX};
    double total = 0.;
    int64_t found = 0;
    for (int64_t begin = 0; begin < vocab; begin += SAMPLE_BLOCK) {
        const int64_t n = block_length(vocab, begin);
        total += block_weights(x, begin, n, max, inverse_t, o.min_p > 0.f ? floor : NO_CUT, s->w);
        collect_likely(x, begin, n, floor.logit, s->likely, capacity, &found);
    }
    if (o.top_k && o.min_p <= 0.f && (found < o.top_k || found > capacity))
        found = collect_top_k(x, vocab, max, inverse_t, -log_share, found, s->likely, capacity, &o.top_k);
    int64_t id = draw_likely(o, max, inverse_t, total, found, capacity, s->likely);
    if (id == -2) {
        struct cut cut = o.min_p > 0.f ? floor : NO_CUT;  /* a min-p set too large to list is cut by its floor */
        if (o.top_p < 1.f) {  /* and then by its nucleus, never below the floor */
            if (nucleus_cut(x, vocab, max, inverse_t, total, o.top_p, s, capacity, &cut) != 0) return -1;
            if (o.min_p > 0.f && cut.logit < floor.logit) cut = floor;
        }
        id = draw_row(x, vocab, max, inverse_t, cut, o.u, s, NULL);
    }
    if (whole_row) *logprob = chosen_logprob(x, id, max, total);
    return id;
}

int sample_rows(const float *logits, const int64_t rows, const int64_t vocab, const float *temperature,
                const int64_t *top_k, const float *top_p, const float *min_p, const double *u,
                const float log_share, const int64_t max_likely, int64_t *ids, float *logprobs, const int threads) {
    const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    int status = 0;
    #pragma omp parallel num_threads(threads)
    {
        struct sample_scratch s = {malloc((size_t)blocks * sizeof *s.block_sums), malloc(GAP_BINS * sizeof *s.bins),
                                   malloc(SAMPLE_BLOCK * sizeof *s.w), malloc((size_t)max_likely * sizeof *s.likely)};
        if (!s.block_sums || !s.bins || !s.w || !s.likely) {
            #pragma omp atomic write
            status = -1;
        }
        #pragma omp barrier
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (status) continue;
            const struct sample_options o = {temperature[r], top_p[r], min_p[r], top_k[r], u[r]};
            ids[r] = sample_row(logits + r * vocab, vocab, o, log_share, max_likely, &s, logprobs + r);
        }
        free(s.block_sums);
        free(s.bins);
        free(s.w);
        free(s.likely);
    }
    return status;
}

/* -- logprob_rows ----------------------------------------------------------------------------------------
 * Each row's log-softmax at its chosen id and at its `top_n` most likely ids (most likely first, lower id first
 * among equals), for logits [rows, vocab] float32: what `engines.sampler.token_logprobs` reports (the cascade asks the
 * small tier for every answer token's; a scored prompt, for every prompt token's). Two passes over a row — its
 * maximum and its top n (each id compared with the n-th best so far; few get inserted), then Σ e^(x - max) in
 * float32 lanes, each block's sum in double — where a log-softmax writes the whole row and `topk` reads it again;
 * each log-probability is (x - max) - log Σ, as PyTorch computes it. -inf and NaN logits weigh 0 in the sum.
 * chosen_lp [rows], top_ids [rows, top_n], top_lp [rows, top_n] (a row with fewer than top_n non-NaN logits pads
 * with id 0 at -inf). Returns 0. */
static void insert_top(const float value, const int64_t id, const int64_t top_n, int64_t *count, float *values,
                       int64_t *ids) {
    const int full = *count == top_n;
    if (full && !(value > values[top_n - 1])) return;
    int64_t at = full ? top_n - 1 : (*count)++;
    for (; at > 0 && value > values[at - 1]; at--) {  /* after its equals: lower ids, seen first, stay first */
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
    }
    values[at] = value;
    ids[at] = id;
}

/* The row's maximum, and its top n into values / ids (their number in *count). */
static float row_max_and_top(const float *x, const int64_t vocab, const int64_t top_n, float *values, int64_t *ids,
                             int64_t *count) {
    if (!top_n) return row_max(x, vocab);
    __m256 best = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= vocab; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        best = _mm256_max_ps(best, v);
        int mask = *count < top_n ? _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_ORD_Q))
                                  : _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(values[top_n - 1]), _CMP_GT_OQ));
        for (; mask; mask &= mask - 1) insert_top(x[i + __builtin_ctz(mask)], i + __builtin_ctz(mask), top_n, count,
                                                   values, ids);
    }
    float max = hmax8(best);
    for (; i < vocab; i++) {
        max = x[i] > max ? x[i] : max;
        if (x[i] == x[i]) insert_top(x[i], i, top_n, count, values, ids);
    }
    return max;
}

int logprob_rows(const float *logits, const int64_t rows, const int64_t vocab, const int64_t *chosen,
                 const int64_t top_n, float *chosen_lp, int64_t *top_ids, float *top_lp, const int threads) {
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        float *values = top_lp + r * top_n;
        int64_t *ids = top_ids + r * top_n, count = 0;
        const float max = row_max_and_top(x, vocab, top_n, values, ids, &count);
        float w[SAMPLE_BLOCK];
        const float log_total = (float)log(row_weights(x, vocab, max, 1.f, NO_CUT, w, NULL));
        chosen_lp[r] = (x[chosen[r]] - max) - log_total;
        for (int64_t j = 0; j < top_n; j++) {
            values[j] = j < count ? (values[j] - max) - log_total : -INFINITY;
            ids[j] = j < count ? ids[j] : 0;
        }
    }
    return 0;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")

/* silu_mul_row sixteen lanes at a time (K a multiple of 16), for the w8a8 products' gated shares: each element
 * through the same operations (exp512 is exp256's arithmetic in sixteen lanes), the same bits. Defined below,
 * after the AVX-512 attention build that defines exp512. */
static void silu_mul_row16(const float *gate, const float *up, const int64_t K, float *out);

/* -- w8a8_vnni ---------------------------------------------------------------------------------------
 * W8A8Linear's product through AVX-512 VNNI over the weight in quad-major tile order (`w8a8_tile_pack`), for any
 * number of rows: out = (q(x) · wᵀ) · x_scale · w_scale (+ bias), bit for bit `torch._int_mm`'s. `vpdpbusd` multiplies
 * unsigned by signed bytes, so activations are shifted to u8 (q + 128) and 128 · Σₖ w[n, k] (`w_sum`, taken once
 * when the layer is built) is subtracted from each sum — exact in int32.
 *
 * A quad of a slice (64 bytes) holds 16 features × 4 inputs, so one `vpdpbusd` with 4 input bytes of an x row
 * broadcast adds them into 16 features' sums at once: no horizontal sum per feature, and each weight vector read
 * from memory serves VNNI_ROWS rows (4 slices × 4 rows of accumulators; 6 rows spilled and ran slower; GCC folds
 * the weight loads into the `vpdpbusd`s, L1 hits, which measured the same as holding them in registers). Against
 * dot products along K over a row-major weight (the kernel this one replaced), 4 rows cost about one row's time
 * instead of 1.35-1.8x on the Zen 4, and one row is no slower (BENCHMARKS.md, 2026-12-05).
 * Threads split the groups; within a group every block of VNNI_ROWS rows passes over the group's weight, which
 * stays in L2 between them.
 */
#define VNNI_ROWS 4

/* The lanes of 16 from j on that fall before `width`: a masked load's or store's valid elements. */
static inline __mmask16 lanes_below(const int64_t width, const int64_t j) {
    return width - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (width - j)) - 1);
}

static inline __attribute__((always_inline)) void vnni_group_rows(
    const int rows, const uint8_t *xq, const int64_t Kp, const float *x_scale, const int8_t *weight,
    const int32_t *w_sum, const float *w_scale, const float *bias, float *out, const int64_t stride, const int64_t N,
    const int64_t n_group, const int8_t *ahead, const int64_t ahead_lines) {
    const int64_t chunks = Kp / TILE_K_CHUNK, ahead_per_chunk = (ahead_lines + chunks - 1) / chunks;
    /* Sixteen named accumulators, not an array: GCC kept the array's elements in registers but copied them between
     * registers around every `vpdpbusd` (two copies per product), which held a Zen 5 core, which issues two
     * `vpdpbusd` a cycle, to about half its products (BENCHMARKS.md, 2026-12-07). */
    const __m512i zero = _mm512_setzero_si512();
    __m512i a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero, a13 = zero;
    __m512i a20 = zero, a21 = zero, a22 = zero, a23 = zero, a30 = zero, a31 = zero, a32 = zero, a33 = zero;
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int8_t *block = weight + chunk * TILE_BLOCK_BYTES;
        const uint8_t *x_chunk = xq + chunk * TILE_K_CHUNK;
        for (int64_t line = chunk * ahead_per_chunk; line < (chunk + 1) * ahead_per_chunk && line < ahead_lines; line++)
            _mm_prefetch((const char *)(ahead + line * 64), _MM_HINT_T1);
        for (int q = 0; q < 16; q++) {
            for (int line = 0; line < 4; line++)  /* the next block, a 256-byte quarter per quad */
                _mm_prefetch((const char *)(block + TILE_BLOCK_BYTES + q * 256 + line * 64), _MM_HINT_T0);
            const __m512i w0 = _mm512_loadu_si512((const void *)(block + q * 256));
            const __m512i w1 = _mm512_loadu_si512((const void *)(block + q * 256 + 64));
            const __m512i w2 = _mm512_loadu_si512((const void *)(block + q * 256 + 128));
            const __m512i w3 = _mm512_loadu_si512((const void *)(block + q * 256 + 192));
#define VNNI_ROW(r)                                                                                             \
            if (rows > r) {                                                                                     \
                int32_t x4;                                                                                     \
                memcpy(&x4, x_chunk + r * Kp + q * 4, sizeof x4);                                               \
                const __m512i x_quad = _mm512_set1_epi32(x4);                                                   \
                a0##r = _mm512_dpbusd_epi32(a0##r, x_quad, w0);                                                 \
                a1##r = _mm512_dpbusd_epi32(a1##r, x_quad, w1);                                                 \
                a2##r = _mm512_dpbusd_epi32(a2##r, x_quad, w2);                                                 \
                a3##r = _mm512_dpbusd_epi32(a3##r, x_quad, w3);                                                 \
            }
            VNNI_ROW(0) VNNI_ROW(1) VNNI_ROW(2) VNNI_ROW(3)
#undef VNNI_ROW
        }
    }
    const __m512i acc[4][VNNI_ROWS] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                                       {a30, a31, a32, a33}};
    for (int s = 0; s < 4; s++) {
        const int64_t n0 = n_group + s * 16;
        if (n0 >= N) break;
        const __mmask16 valid = lanes_below(N, n0);
        const __m512i shift = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(valid, w_sum + n0), 7);  /* 128 · w_sum */
        const __m512 scale16 = _mm512_maskz_loadu_ps(valid, w_scale + n0);
        const __m512 bias16 = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[s][r], shift));
            __m512 y = _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(x_scale[r])), scale16);
            if (bias) y = _mm512_add_ps(y, bias16);
            _mm512_mask_storeu_ps(out + r * stride + s * 16, valid, y);
        }
    }
}

/* Row of x as bytes: x / scale rounded half to even (as torch.round) plus `zero_point` (0: int8, for AMX; 128: uint8,
 * for VNNI), where scale = max|x| / 127 (at least 1e-12 / 127); padded with zero_point (a zero) to Kp. */
static void quantize_row_bytes(const float *x, const int64_t K, const int64_t Kp, const int zero_point, uint8_t *xq,
                               float *x_scale) {
    const int64_t full = K / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (K - full)) - 1);
    __m512 amax16 = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 16) amax16 = _mm512_max_ps(amax16, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    if (tail) amax16 = _mm512_max_ps(amax16, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, x + full)));
    const float scale = fmaxf(_mm512_reduce_max_ps(amax16), 1e-12f) / 127.f;
    const __m512 scale16 = _mm512_set1_ps(scale);
    const __m512i zero16 = _mm512_set1_epi32(zero_point);
    for (int64_t k = 0; k < K; k += 16) {  /* cvtps rounds half to even (the default rounding mode) */
        const __mmask16 valid = k < full ? (__mmask16)0xffff : tail;
        const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(valid, x + k), scale16));
        _mm512_mask_cvtepi32_storeu_epi8(xq + k, valid, _mm512_add_epi32(q, zero16));
    }
    memset(xq + K, zero_point, Kp - K);
    *x_scale = scale;
}

/* Rows [0, rows) of x as uint8 rows of ceil(K / 64) * 64 bytes in xq, split among the threads of the enclosing
 * team (an orphaned `omp for`: its implicit barrier ends it). */
static void quantize_rows_vnni(const float *x, const int64_t rows, const int64_t K, uint8_t *xq, float *x_scale) {
    const int64_t Kp = (K + TILE_K_CHUNK - 1) / TILE_K_CHUNK * TILE_K_CHUNK;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; m++) quantize_row_bytes(x + m * K, K, Kp, 128, xq + m * Kp, x_scale + m);
}

/* Every row of the product for the 64 features of `group`, into `out` (row 0's first feature of the group; rows
 * `stride` apart). The first block of VNNI_ROWS rows reads the group's weight from memory, the others from L2; where
 * there are several blocks, each also fetches its share of `next_group`'s weight (the group this thread takes next;
 * -1: none) into L2, so that the next group's first block does not wait on memory: without it, 32-row products
 * over a model's weights (from memory) took markedly longer than over one layer's (in cache) (BENCHMARKS.md,
 * 2026-12-06). */
static void vnni_group(const uint8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                       const int8_t *packed, const int64_t group, const int64_t next_group, const int32_t *w_sum,
                       const float *w_scale, const float *bias, float *out, const int64_t stride, const int64_t N) {
    const int64_t chunks = (K + TILE_K_CHUNK - 1) / TILE_K_CHUNK, Kp = chunks * TILE_K_CHUNK;
    const int64_t group_lines = chunks * TILE_BLOCK_BYTES / 64, passes = (rows + VNNI_ROWS - 1) / VNNI_ROWS;
    const int64_t share = next_group >= 0 && passes > 1 ? (group_lines + passes - 1) / passes : 0;
    const int8_t *weight = packed + group * chunks * TILE_BLOCK_BYTES;
    const int8_t *next = packed + (next_group >= 0 ? next_group : 0) * chunks * TILE_BLOCK_BYTES;
    for (int64_t m0 = 0; m0 < rows; m0 += VNNI_ROWS) {
        const uint8_t *x_rows = xq + m0 * Kp;
        float *rows_out = out + m0 * stride;
        const int64_t first_line = m0 / VNNI_ROWS * share;
        const int8_t *ahead = next + first_line * 64;
        const int64_t ahead_lines = first_line >= group_lines ? 0
                                    : first_line + share < group_lines ? share : group_lines - first_line;
        switch (rows - m0 < VNNI_ROWS ? rows - m0 : VNNI_ROWS) {  /* constant counts: registers */
#define ROWS(r) case r: vnni_group_rows(r, x_rows, Kp, x_scale + m0, weight, w_sum, w_scale, bias, rows_out, stride, \
                                        N, group * TILE_GROUP, ahead, ahead_lines); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#undef ROWS
        }
    }
}

/* This thread's share of the output groups: called by every thread of a team, no barrier. */
static void w8a8_vnni_share(const uint8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                            const int8_t *packed, const int32_t *w_sum, const float *w_scale, const float *bias,
                            float *out, const int64_t N) {
    int64_t begin, end;
    thread_share((N + TILE_GROUP - 1) / TILE_GROUP, &begin, &end);
    for (int64_t group = begin; group < end; group++)
        vnni_group(xq, x_scale, rows, K, packed, group, group + 1 < end ? group + 1 : -1, w_sum, w_scale, bias,
                   out + group * TILE_GROUP, N, N);
}

/* w8a8_amx_silu_mul_share's arithmetic through VNNI (see there). */
static void w8a8_vnni_silu_mul_share(const uint8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                                     const int8_t *packed, const int32_t *w_sum, const float *w_scale,
                                     const float *bias, float *out, const int64_t N, float *scratch) {
    const int64_t half = N / 2, half_groups = half / TILE_GROUP;
    float *gate = scratch, *up = scratch + rows * TILE_GROUP;
    int64_t begin, end;
    thread_share(half_groups, &begin, &end);
    for (int64_t group = begin; group < end; group++) {
        vnni_group(xq, x_scale, rows, K, packed, group, group + half_groups, w_sum, w_scale, bias, gate, TILE_GROUP,
                   N);
        vnni_group(xq, x_scale, rows, K, packed, group + half_groups, group + 1 < end ? group + 1 : -1, w_sum,
                   w_scale, bias, up, TILE_GROUP, N);
        for (int64_t m = 0; m < rows; m++)
            silu_mul_row16(gate + m * TILE_GROUP, up + m * TILE_GROUP, TILE_GROUP, out + m * half + group * TILE_GROUP);
    }
}

/* x [rows, K] float32; packed from w8a8_tile_pack (quad-major); w_sum [N] int32; w_scale [N] float32; bias [N]
 * float32 or NULL; out [rows, N] float32; xq [rows, ceil(K / 64) * 64] uint8 and x_scale [rows] are scratch.
 * Returns 0. */
int w8a8_vnni(const float *x, const int64_t rows, const int64_t K, const int8_t *packed, const int32_t *w_sum,
              const float *w_scale, const float *bias, float *out, const int64_t N, uint8_t *xq, float *x_scale,
              const int threads) {
    #pragma omp parallel num_threads(threads)
    {
        quantize_rows_vnni(x, rows, K, xq, x_scale);
        w8a8_vnni_share(xq, x_scale, rows, K, packed, w_sum, w_scale, bias, out, N);
    }
    return 0;
}

/* w8a8_amx_silu_mul through VNNI: w_sum as w8a8_vnni takes it. Returns 0. */
int w8a8_vnni_silu_mul(const float *x, const int64_t rows, const int64_t K, const int8_t *packed, const int32_t *w_sum,
                       const float *w_scale, const float *bias, float *out, const int64_t N, uint8_t *xq,
                       float *x_scale, float *scratch, const int threads) {
    #pragma omp parallel num_threads(threads)
    {
        quantize_rows_vnni(x, rows, K, xq, x_scale);
        w8a8_vnni_silu_mul_share(xq, x_scale, rows, K, packed, w_sum, w_scale, bias, out, N,
                                 scratch + omp_get_thread_num() * 2 * rows * TILE_GROUP);
    }
    return 0;
}

/* -- paged_decode_attention (AVX-512): the same body as the AVX2 build, sixteen lanes ------------------ */

static inline __m512 load16(const void *base, const int64_t index, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)base + index);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Four sums of sixteen lanes each, [a, b, c, d], in the order a single reduction would not keep:
 * each is summed pairwise across lanes, which differs from _mm512_reduce_add_ps only in rounding. */
static inline __m128 hsum4_ps(const __m512 a, const __m512 b, const __m512 c, const __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

#define VEC __m512
#define LANES 16
#define V_ZERO _mm512_setzero_ps
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_SET1 _mm512_set1_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_FMADD _mm512_fmadd_ps
#define V_FNMADD _mm512_fnmadd_ps
#define V_MAX _mm512_max_ps
#define V_ROUND(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_SCALE_POW2 _mm512_scalef_ps
#define V_LOAD_KV load16
#define V_HSUM _mm512_reduce_add_ps
#define V_HMAX _mm512_reduce_max_ps
#define V_HSUM4 hsum4_ps
#define V_EXP exp512
#define TILE_ROWS tile_rows_avx512
#define ACCUMULATE_V accumulate_v_avx512
#define ATTEND_TASKS attend_tasks_avx512
#define PAGED_DECODE_ATTEND paged_decode_attend_avx512
#define PAGED_DECODE_ATTENTION paged_decode_attention_avx512
#include "cpu_attention.inc"

static void silu_mul_row16(const float *gate, const float *up, const int64_t K, float *out) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512i sign = _mm512_set1_epi32((int32_t)0x80000000u);
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 g = _mm512_loadu_ps(gate + k);
        const __m512 e = exp512(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), sign)));  /* e^-|g| */
        const __mmask16 positive = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
        const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(positive, e, one), _mm512_add_ps(one, e));
        _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), _mm512_loadu_ps(up + k)));
    }
}

/* -- a product's per-row argmax and log-softmax there, folded group by group in cache ---------------------------
 * An LM head's greedy choice needs each row's argmax of the product, and the cascade that token's logprob; the
 * [rows, N] float32 outputs (19.5 MB for 32 rows of a 152k vocabulary) need never be written. `w8a8_amx_argmax` and
 * `w8a8_vnni_argmax` compute one group of 64 features for every row at a time and fold it, while it is in cache,
 * into each row's state over 16 lanes: its running maximum with the first id reaching it (numpy's argmax: strictly
 * greater replaces, NaN replaces any number), and with logprobs each lane's maximum and Σ e^(output − maximum)
 * (`exp512`: within ~1e-5 of log_softmax's). Lanes, then threads in feature order, are merged at the end. */

struct row_folds {  /* one thread's per-row state, and the group it folds: [rows, TILE_GROUP] outputs */
    float *outputs;
    __m512 *best, *lane_max, *lane_sum;
    __m512i *best_ids;
};

struct thread_folds {  /* each thread's per-row result, [threads, rows]: an id of -1 for a thread without features */
    int threads;
    float *value, *max, *sum;
    int64_t *id;
};

static void row_folds_free(struct row_folds *f) { free(f->outputs), free(f->best), free(f->best_ids); }

/* Returns 0, or -2 without memory (what is allocated is freed by row_folds_free). */
static int row_folds_alloc(struct row_folds *f, const int64_t rows, const int64_t first_feature) {
    f->outputs = aligned_alloc(64, (size_t)(rows * TILE_GROUP) * sizeof(float));
    f->best = aligned_alloc(64, (size_t)rows * 3 * sizeof(__m512));
    f->best_ids = aligned_alloc(64, (size_t)rows * sizeof(__m512i));
    if (!f->outputs || !f->best || !f->best_ids) return -2;
    f->lane_max = f->best + rows, f->lane_sum = f->best + 2 * rows;
    const __m512i first = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)first_feature));
    for (int64_t m = 0; m < rows; m++) {
        f->best[m] = f->lane_max[m] = _mm512_set1_ps(-INFINITY), f->best_ids[m] = first;
        f->lane_sum[m] = _mm512_setzero_ps();
    }
    return 0;
}

/* Row m's running maximum over 16 lanes (`best`, `best_ids`) folded with the `width` outputs of one group that
 * start at feature n0: strictly greater replaces (so each lane keeps the first of equal maxima), and NaN replaces
 * any number (numpy's argmax counts NaN as the maximum). */
static inline void fold_group_max(const float *outputs, const int64_t width, const int64_t n0, __m512 *best,
                                  __m512i *best_ids) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 valid = lanes_below(width, j);
        const __m512 v = _mm512_maskz_loadu_ps(valid, outputs + j);
        const __mmask16 wins = valid & (_mm512_cmp_ps_mask(v, *best, _CMP_GT_OQ)
                                        | (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                           & _mm512_cmp_ps_mask(*best, *best, _CMP_ORD_Q)));
        *best = _mm512_mask_mov_ps(*best, wins, v);
        *best_ids = _mm512_mask_mov_epi32(*best_ids, wins, _mm512_add_epi32(lane, _mm512_set1_epi32((int)(n0 + j))));
    }
}

/* Row m's running log-sum-exp over 16 lanes — each lane's maximum and its Σ e^(output − maximum) — folded with the
 * `width` outputs of one group: the lane maxima move once per group (one rescaling exponential), then one
 * exponential per output. */
static inline void fold_group_logsumexp(const float *outputs, const int64_t width, __m512 *lane_max,
                                        __m512 *lane_sum) {
    __m512 top = *lane_max;
    for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 valid = lanes_below(width, j);
        top = _mm512_mask_max_ps(top, valid, top, _mm512_maskz_loadu_ps(valid, outputs + j));
    }
    __m512 sum = _mm512_mul_ps(*lane_sum, exp512(_mm512_sub_ps(*lane_max, top)));
    for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 valid = lanes_below(width, j);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, outputs + j), top));
        sum = _mm512_mask_add_ps(sum, valid, sum, e);
    }
    *lane_max = top, *lane_sum = sum;
}

/* The group of features [n0, n0 + 64) ∩ [0, N), in `f->outputs`, folded into every row's state. */
static inline void fold_group(struct row_folds *f, const int64_t rows, const int64_t n0, const int64_t N,
                              const int logprobs) {
    const int64_t width = N - n0 < TILE_GROUP ? N - n0 : TILE_GROUP;
    for (int64_t m = 0; m < rows; m++) {
        fold_group_max(f->outputs + m * TILE_GROUP, width, n0, f->best + m, f->best_ids + m);
        if (logprobs) fold_group_logsumexp(f->outputs + m * TILE_GROUP, width, f->lane_max + m, f->lane_sum + m);
    }
}

/* Whether (value, id) comes before (best, best_id) as numpy's argmax orders them: NaN first, then the larger value,
 * then the smaller index; anything comes before no best yet (best_id < 0). */
static inline int argmax_before(const float value, const int64_t id, const float best, const int64_t best_id) {
    if (best_id < 0) return 1;
    if (isnan(best)) return isnan(value) && id < best_id;
    return isnan(value) || value > best || (value == best && id < best_id);
}

/* (maximum, sum) log-sum-exp parts, each sum relative to its maximum, merged into (*total_max, *total_sum) (a part
 * with no outputs: maximum -inf, sum 0). */
static inline void merge_logsumexp(const float max, const float sum, float *total_max, float *total_sum) {
    if (max <= *total_max) {
        if (sum > 0.f) *total_sum += sum * expf(max - *total_max);
    } else {
        *total_sum = sum + (*total_sum > 0.f ? *total_sum * expf(*total_max - max) : 0.f);
        *total_max = max;
    }
}

/* Thread t's lanes merged into its row results in `parts`. */
static void row_folds_finish(const struct row_folds *f, const int64_t rows, const int64_t N, const int logprobs,
                             struct thread_folds *parts, const int t) {
    for (int64_t m = 0; m < rows; m++) {
        float lane_best[16], lane_maxima[16], lane_sums[16], value = -INFINITY;
        int32_t lane_ids[16];
        int64_t id = -1;
        _mm512_storeu_ps(lane_best, f->best[m]);
        _mm512_storeu_si512((void *)lane_ids, f->best_ids[m]);
        for (int lane = 0; lane < 16; lane++)
            if (lane_ids[lane] < N && argmax_before(lane_best[lane], lane_ids[lane], value, id))
                value = lane_best[lane], id = lane_ids[lane];
        const int64_t i = t * rows + m;
        parts->value[i] = value, parts->id[i] = id;
        if (!logprobs) continue;
        _mm512_storeu_ps(lane_maxima, f->lane_max[m]);
        _mm512_storeu_ps(lane_sums, f->lane_sum[m]);
        for (int lane = 0; lane < 16; lane++) merge_logsumexp(lane_maxima[lane], lane_sums[lane], parts->max + i,
                                                              parts->sum + i);
    }
}

/* Returns 0, or -2 without memory. */
static int thread_folds_alloc(struct thread_folds *parts, const int threads, const int64_t rows) {
    const size_t n = (size_t)(threads * rows);
    parts->threads = threads;
    parts->value = malloc(n * (3 * sizeof(float) + sizeof(int64_t)));
    if (!parts->value) return -2;
    parts->max = parts->value + n, parts->sum = parts->max + n, parts->id = (int64_t *)(parts->sum + n);
    for (size_t i = 0; i < n; i++) parts->id[i] = -1, parts->max[i] = -INFINITY, parts->sum[i] = 0.f;
    return 0;
}

/* The threads' results, in feature order, into ids [rows] and (if not NULL) logprobs [rows]; frees `parts`. */
static void thread_folds_merge(struct thread_folds *parts, const int64_t rows, int64_t *ids, float *logprobs) {
    for (int64_t m = 0; m < rows; m++) {
        float value = -INFINITY, max = -INFINITY, sum = 0.f;
        int64_t id = -1;
        for (int t = 0; t < parts->threads; t++) {
            const int64_t i = t * rows + m;
            if (parts->id[i] >= 0 && argmax_before(parts->value[i], parts->id[i], value, id))
                value = parts->value[i], id = parts->id[i];
            if (logprobs) merge_logsumexp(parts->max[i], parts->sum[i], &max, &sum);
        }
        ids[m] = id;
        if (logprobs) logprobs[m] = value - max - logf(sum);
    }
    free(parts->value);
}

/* A quantised product's operands, as the group functions of `fold_thread_share` take them. */
struct group_operands {
    const void *xq;
    const float *x_scale;
    int64_t rows, K;
    const int8_t *packed;
    const int32_t *w_sum;  /* VNNI's; NULL for AMX */
    const float *w_scale, *bias;
    int64_t N;
};

/* Every row's outputs for the 64 features of `group` into `outputs` [rows, 64] (`next_group`: the one this thread
 * takes next, -1 none; `configured_rows`: AMX's tile configuration, unused by VNNI). */
typedef void (*group_outputs)(const struct group_operands *p, int64_t group, int64_t next_group, float *outputs,
                              int *configured_rows);

/* This thread's share of the groups, each computed by `outputs_of` and folded while in cache; its rows' results
 * into `parts`. Called by every thread of a team. Returns 0, or -2 without memory. */
static int fold_thread_share(const struct group_operands *p, const group_outputs outputs_of, const int logprobs,
                             struct thread_folds *parts, int *configured_rows) {
    int64_t begin, end;
    thread_share((p->N + TILE_GROUP - 1) / TILE_GROUP, &begin, &end);
    struct row_folds folds;
    const int status = row_folds_alloc(&folds, p->rows, begin * TILE_GROUP);
    if (status == 0 && begin < end) {
        for (int64_t group = begin; group < end; group++) {
            outputs_of(p, group, group + 1 < end ? group + 1 : -1, folds.outputs, configured_rows);
            fold_group(&folds, p->rows, group * TILE_GROUP, p->N, logprobs);
        }
        row_folds_finish(&folds, p->rows, p->N, logprobs, parts, omp_get_thread_num());
    }
    row_folds_free(&folds);
    return status;
}

static void vnni_group_outputs(const struct group_operands *p, const int64_t group, const int64_t next_group,
                               float *outputs, int *configured_rows) {
    (void)configured_rows;
    vnni_group(p->xq, p->x_scale, p->rows, p->K, p->packed, group, next_group, p->w_sum, p->w_scale, p->bias, outputs,
               TILE_GROUP, p->N);
}

/* w8a8_amx_argmax through VNNI (w_sum as w8a8_vnni takes it): each row's argmax of `w8a8_vnni`'s outputs, the same
 * bits, and with `logprobs` (else NULL) the log-softmax there. Returns 0, or -2 without memory. */
int w8a8_vnni_argmax(const float *x, const int64_t rows, const int64_t K, const int8_t *packed, const int32_t *w_sum,
                     const float *w_scale, const float *bias, int64_t *ids, const int64_t N, uint8_t *xq,
                     float *x_scale, float *logprobs, const int threads) {
    struct thread_folds parts;
    if (thread_folds_alloc(&parts, threads, rows) != 0) return -2;
    const struct group_operands operands = {xq, x_scale, rows, K, packed, w_sum, w_scale, bias, N};
    int status = 0;
    #pragma omp parallel num_threads(threads)
    {
        quantize_rows_vnni(x, rows, K, xq, x_scale);
        if (fold_thread_share(&operands, vnni_group_outputs, logprobs != NULL, &parts, NULL) != 0) {
            #pragma omp atomic write
            status = -2;
        }
    }
    thread_folds_merge(&parts, rows, ids, logprobs);
    return status;
}

#pragma GCC pop_options

/* -- paged_decode_attention (AVX-512 with BF16): a bfloat16 cache read by `vdpbf16ps` ---------------------------
 * The sixteen-lane build, except over a bfloat16 cache (and heads of a multiple of 32 dims), which it reads as it is
 * stored: each `vdpbf16ps` multiplies 32 bfloat16 pairs and adds each pair's two products into a float32 lane, so
 * q · k takes half the instructions of float32 FMAs and no K is widened; for Σ weight · v the softmax numerators
 * are rounded to bfloat16 and two positions' V vectors interleaved, so each instruction adds two positions. The
 * query and the weights are rounded to bfloat16 as the PyTorch path (SDPA in the cache's dtype) rounds them;
 * sums stay float32. Taken where the CPU has AVX512_BF16 (Zen 4, Sapphire Rapids): see `paged_decode_attention`. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512bf16")

#define BF16_PAIRS 32  /* bfloat16 per vector: one `vdpbf16ps` operand */

static inline __m512bh load_bf16(const uint16_t *source) { return (__m512bh)_mm512_loadu_si512(source); }

/* scores[g * length + p] = scale · q_g · k_p for the group's heads g and positions [0, length), q in bfloat16. */
static inline __attribute__((always_inline)) void bf16_dot_scores(
    const float *q_group, const void *k_cache, const int64_t *table, const int block_shift, const int64_t kv_heads,
    const int64_t kvh, const int64_t head_dim, const int64_t group, const int64_t length, const int64_t fetch_end,
    const float scale, float *scores) {
    const int64_t parts = head_dim / BF16_PAIRS;
    __m512bh q[MAX_GROUP][MAX_HEAD_DIM / BF16_PAIRS];
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < parts; i++) {
            const float *source = q_group + g * head_dim + BF16_PAIRS * i;
            q[g][i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(source + 16), _mm512_loadu_ps(source));
        }
    int64_t p = 0;
    for (; p + 4 <= length; p += 4) {  /* four positions at a time: one reduction for four */
        const uint16_t *k[4];
        for (int j = 0; j < 4; j++) {
            k[j] = key_vector(k_cache, table, block_shift, kv_heads, kvh, head_dim, p + j, 1);
            prefetch_position(k_cache, table, block_shift, kv_heads, kvh, head_dim, p + j + KV_PREFETCH_AHEAD,
                              fetch_end, 1);
        }
        for (int64_t g = 0; g < group; g++) {
            __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t i = 0; i < parts; i++)
                for (int j = 0; j < 4; j++) dot[j] = _mm512_dpbf16_ps(dot[j], q[g][i], load_bf16(k[j] + BF16_PAIRS * i));
            _mm_storeu_ps(scores + g * length + p, _mm_mul_ps(hsum4_ps(dot[0], dot[1], dot[2], dot[3]), _mm_set1_ps(scale)));
        }
    }
    for (; p < length; p++) {
        const uint16_t *k = key_vector(k_cache, table, block_shift, kv_heads, kvh, head_dim, p, 1);
        for (int64_t g = 0; g < group; g++) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t i = 0; i < parts; i++) dot = _mm512_dpbf16_ps(dot, q[g][i], load_bf16(k + BF16_PAIRS * i));
            scores[g * length + p] = _mm512_reduce_add_ps(dot) * scale;
        }
    }
}

/* The float's nearest bfloat16 (ties to even), as `vcvtneps2bf16` rounds; x is finite (a softmax numerator). */
static inline uint16_t bf16_nearest(const float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* Each row of `numerators` ([group, length] float32) as bfloat16 in place, its first half: row g's weight p at
 * ((uint16_t *)(numerators + g * length))[p], and a zero after the last when length is odd (a pair's partner). */
static void round_weights_bf16(float *numerators, const int64_t group, const int64_t length) {
    for (int64_t g = 0; g < group; g++) {
        float *row = numerators + g * length;
        uint16_t *weights = (uint16_t *)row;  /* writes stay behind the reads: weight p lands in float p / 2 */
        int64_t p = 0;
        for (; p + 16 <= length; p += 16)
            _mm256_storeu_si256((__m256i *)(weights + p), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + p)));
        for (; p < length; p++) weights[p] = bf16_nearest(row[p]);
        if (length % 2) weights[length] = 0;
    }
}

/* 32 dims of a head's Σ weight · v, from the sums of `_mm512_unpacklo/hi_epi16`-interleaved V pairs (lo: dims
 * 8k..8k+3, hi: 8k+4..8k+7, in lanes 4k..4k+3 of each), put back in order and scaled by `inverse` into o[0..32). */
static inline void store_pair_sums(const __m512 lo, const __m512 hi, const __m512 inverse, float *o) {
    const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first_half, hi), inverse));
    _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second_half, hi), inverse));
}

/* out[g] = Σ_p weight_g,p · v_p / total[g] for the group's heads, from the softmax numerators in `scores` (rounded
 * to bfloat16 here, in place): HEADS heads × 64 dims at a time, their sums in registers through a pass over the
 * positions, two positions a step. `_mm512_unpacklo/hi_epi16` of two positions' 32 dims gives each float32 lane a
 * pair (v_p, v_p+1) of one dim: dims 8k..8k+3 (lo) and 8k+4..8k+7 (hi) in the lanes 4k..4k+3 of the 128-bit lane
 * k, put back in order once per head (`permutex2var`). */
static inline __attribute__((always_inline)) void bf16_weighted_values(
    float *scores, const void *v_cache, const int64_t *table, const int block_shift, const int64_t kv_heads,
    const int64_t kvh, const int64_t head_dim, const int64_t group, const int64_t length, const int64_t fetch_end,
    const float *total, float *out) {
    enum { HEADS = 4, PARTS = 2 };
    const int64_t parts = head_dim / BF16_PAIRS;
    round_weights_bf16(scores, group, length);
    for (int64_t g0 = 0; g0 < group; g0 += HEADS) {
        const int64_t heads_here = group - g0 < HEADS ? group - g0 : HEADS;
        const uint16_t *weights[HEADS];
        for (int64_t h = 0; h < heads_here; h++) weights[h] = (const uint16_t *)(scores + (g0 + h) * length);
        for (int64_t i0 = 0; i0 < parts; i0 += PARTS) {
            const int64_t parts_here = parts - i0 < PARTS ? parts - i0 : PARTS;
            __m512 lo[HEADS][PARTS], hi[HEADS][PARTS];
            for (int h = 0; h < HEADS; h++)
                for (int i = 0; i < PARTS; i++) lo[h][i] = hi[h][i] = _mm512_setzero_ps();
            for (int64_t p = 0; p < length; p += 2) {
                if (g0 == 0 && i0 == 0)  /* the first pass reads V from memory, later ones from L2 */
                    for (int64_t j = 0; j < 2; j++)
                        prefetch_position(v_cache, table, block_shift, kv_heads, kvh, head_dim,
                                          p + j + KV_PREFETCH_AHEAD, fetch_end, 1);
                const uint16_t *v0 = key_vector(v_cache, table, block_shift, kv_heads, kvh, head_dim, p, 1);
                const uint16_t *v1 = p + 1 < length
                    ? key_vector(v_cache, table, block_shift, kv_heads, kvh, head_dim, p + 1, 1) : NULL;
                __m512bh even[PARTS], odd[PARTS];
                for (int64_t i = 0; i < parts_here; i++) {
                    const __m512i a = _mm512_loadu_si512(v0 + BF16_PAIRS * (i0 + i));
                    const __m512i b = v1 ? _mm512_loadu_si512(v1 + BF16_PAIRS * (i0 + i)) : _mm512_setzero_si512();
                    even[i] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                    odd[i] = (__m512bh)_mm512_unpackhi_epi16(a, b);
                }
                for (int64_t h = 0; h < heads_here; h++) {
                    uint32_t pair;
                    memcpy(&pair, weights[h] + p, sizeof pair);
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int32_t)pair);
                    for (int64_t i = 0; i < parts_here; i++) {
                        lo[h][i] = _mm512_dpbf16_ps(lo[h][i], w, even[i]);
                        hi[h][i] = _mm512_dpbf16_ps(hi[h][i], w, odd[i]);
                    }
                }
            }
            for (int64_t h = 0; h < heads_here; h++) {
                const __m512 inverse = _mm512_set1_ps(length > 0 ? 1.f / total[g0 + h] : 0.f);
                for (int64_t i = 0; i < parts_here; i++)
                    store_pair_sums(lo[h][i], hi[h][i], inverse, out + (g0 + h) * head_dim + BF16_PAIRS * (i0 + i));
            }
        }
    }
}

#define V_BF16_DOT
#define V_EXP exp512_bf16
#define TILE_ROWS tile_rows_avx512bf16
#define ACCUMULATE_V accumulate_v_avx512bf16
#define ATTEND_TASKS attend_tasks_avx512bf16
#define PAGED_DECODE_ATTEND paged_decode_attend_avx512bf16
#define PAGED_DECODE_ATTENTION paged_decode_attention_avx512bf16
#include "cpu_attention.inc"
#undef V_BF16_DOT
#undef BF16_PAIRS

#pragma GCC pop_options

#if __has_include(<amxtileintrin.h>)  /* GCC 11+, clang 12+: older compilers build the rest without AMX */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")

/* -- w8a8_amx ----------------------------------------------------------------------------------------
 * W8A8Linear's product on AMX tiles, for any number of rows: out = (q(x) · wᵀ) · x_scale · w_scale (+ bias).
 *
 * `tdpbssd` multiplies a tile of 16 rows × 64 int8 of x by a tile of 64 × 16 int8 of w into 16 × 16 int32,
 * exactly, so the result is `torch._int_mm`'s bit for bit at every row count (a row's logits do not depend
 * on its batch mates, and speculative verification matches plain decoding). One instruction covers 16
 * output features × 64 inputs, so a few rows cost little more than one: the weight stream, not the
 * arithmetic, bounds a decode step of up to ~16 rows.
 *
 * The weight lives in slice-major tile order (`w8a8_tile_pack`): a block's four slices are the four B tiles of
 * its 64 inputs. Threads split the groups; within a group every 16-row block of x passes over the group's weight
 * (4 KiB per 64 inputs: it stays in L2 between blocks).
 */
#define AMX_TILE_ROWS 16

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_tile_config;

/* Linux hands a process AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
 * Returns 0 when granted. */
int w8a8_amx_enable(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1; }

/* Tiles 0-3: C (rows × 16 int32, one per 16-feature slice); 4: A (rows × 64 int8); 5, 6: B (16 × 64). */
static void amx_configure(const int rows) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int tile = 0; tile < 5; tile++) config.rows[tile] = (uint8_t)rows, config.colsb[tile] = 64;
    for (int tile = 5; tile < 7; tile++) config.rows[tile] = 16, config.colsb[tile] = 64;
    _tile_loadconfig(&config);
}

/* Rows [m0, m0 + rows) × the 64 features of `group` from the four C tiles, as W8A8Linear rescales, into `out`
 * (row 0's first feature of the group; rows `stride` apart). */
static inline void amx_store_group(int32_t acc[4][AMX_TILE_ROWS * 16], const int rows, const int64_t m0,
                                   const int64_t group, const float *x_scale, const float *w_scale,
                                   const float *bias, float *out, const int64_t stride, const int64_t N) {
    for (int slice = 0; slice < 4; slice++) {
        const int64_t n0 = group * TILE_GROUP + slice * 16;
        if (n0 >= N) break;
        const __mmask16 valid = lanes_below(N, n0);
        const __m512 scale16 = _mm512_maskz_loadu_ps(valid, w_scale + n0);
        const __m512 bias16 = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(acc[slice] + r * 16)));
            __m512 y = _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(x_scale[m0 + r])), scale16);
            if (bias) y = _mm512_add_ps(y, bias16);
            _mm512_mask_storeu_ps(out + (m0 + r) * stride + slice * 16, valid, y);
        }
    }
}

/* Rows [0, rows) of x as int8 rows of ceil(K / 64) * 64 bytes in xq, split among the threads of the enclosing
 * team (an orphaned `omp for`: its implicit barrier ends it). */
static void quantize_rows_int8(const float *x, const int64_t rows, const int64_t K, int8_t *xq, float *x_scale) {
    const int64_t Kp = (K + TILE_K_CHUNK - 1) / TILE_K_CHUNK * TILE_K_CHUNK;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; m++) quantize_row_bytes(x + m * K, K, Kp, 0, (uint8_t *)xq + m * Kp, x_scale + m);
}

/* Every row of q(x) · wᵀ for the 64 features of `group`, into `out` (row 0's first feature of the group; rows
 * `stride` apart); `*configured_rows`: the tile configuration's row count (0: none loaded yet). */
static void amx_group(const int8_t *xq, const float *x_scale, const int64_t rows, const int64_t K, const int8_t *packed,
                      const int64_t group, const float *w_scale, const float *bias, float *out, const int64_t stride,
                      const int64_t N, int *configured_rows) {
    const int64_t chunks = (K + TILE_K_CHUNK - 1) / TILE_K_CHUNK, Kp = chunks * TILE_K_CHUNK;
    const int8_t *weight = packed + group * chunks * TILE_BLOCK_BYTES;
    int32_t acc[4][AMX_TILE_ROWS * 16];
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_TILE_ROWS) {
        const int block_rows = (int)(rows - m0 < AMX_TILE_ROWS ? rows - m0 : AMX_TILE_ROWS);
        if (block_rows != *configured_rows) amx_configure(*configured_rows = block_rows);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const int8_t *block = weight + chunk * TILE_BLOCK_BYTES;
            _tile_loadd(4, xq + m0 * Kp + chunk * TILE_K_CHUNK, Kp);
            _tile_loadd(5, block, 64); _tile_dpbssd(0, 4, 5);
            _tile_loadd(6, block + 1024, 64); _tile_dpbssd(1, 4, 6);
            _tile_loadd(5, block + 2048, 64); _tile_dpbssd(2, 4, 5);
            _tile_loadd(6, block + 3072, 64); _tile_dpbssd(3, 4, 6);
        }
        _tile_stored(0, acc[0], 64); _tile_stored(1, acc[1], 64);
        _tile_stored(2, acc[2], 64); _tile_stored(3, acc[3], 64);
        amx_store_group(acc, block_rows, m0, group, x_scale, w_scale, bias, out, stride, N);
    }
}

/* Other AMX users on a thread may keep their tile configuration between calls (onnxruntime's MLAS caches it per
 * thread and reloads it only when it sees another): a product puts it back as it was (all zeros: none). */
static void amx_restore(const amx_tile_config *before, const int configured_rows) {
    if (before->palette_id)
        _tile_loadconfig(before);
    else if (configured_rows)
        _tile_release();
}

/* This thread's share of the output groups of q(x) · wᵀ: called by every thread of a team, no barrier. */
static void w8a8_amx_share(const int8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                           const int8_t *packed, const float *w_scale, const float *bias, float *out, const int64_t N) {
    int64_t begin, end;
    thread_share((N + TILE_GROUP - 1) / TILE_GROUP, &begin, &end);
    amx_tile_config before;
    _tile_storeconfig(&before);
    int configured_rows = 0;
    for (int64_t group = begin; group < end; group++)
        amx_group(xq, x_scale, rows, K, packed, group, w_scale, bias, out + group * TILE_GROUP, N, N,
                  &configured_rows);
    amx_restore(&before, configured_rows);
}

/* This thread's share of silu(gate) · up for a gate_up weight [gate; up] of N = 2 · I features, I a multiple of 64:
 * gate group g and up group g + I / 64 cover the same 64 features, computed into `scratch` (this thread's
 * [2, rows, 64]) and combined into out [rows, I] while they are in cache. */
static void w8a8_amx_silu_mul_share(const int8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                                    const int8_t *packed, const float *w_scale, const float *bias, float *out,
                                    const int64_t N, float *scratch) {
    const int64_t half = N / 2, half_groups = half / TILE_GROUP;
    float *gate = scratch, *up = scratch + rows * TILE_GROUP;
    int64_t begin, end;
    thread_share(half_groups, &begin, &end);
    amx_tile_config before;
    _tile_storeconfig(&before);
    int configured_rows = 0;
    for (int64_t group = begin; group < end; group++) {
        amx_group(xq, x_scale, rows, K, packed, group, w_scale, bias, gate, TILE_GROUP, N, &configured_rows);
        amx_group(xq, x_scale, rows, K, packed, group + half_groups, w_scale, bias, up, TILE_GROUP, N,
                  &configured_rows);
        for (int64_t m = 0; m < rows; m++)
            silu_mul_row16(gate + m * TILE_GROUP, up + m * TILE_GROUP, TILE_GROUP, out + m * half + group * TILE_GROUP);
    }
    amx_restore(&before, configured_rows);
}

/* x [rows, K] float32; packed from w8a8_tile_pack (slice-major); w_scale [N] float32; bias [N] float32 or NULL;
 * out [rows, N] float32; xq [rows, ceil(K / 64) * 64] int8 and x_scale [rows] are scratch. Returns 0. */
int w8a8_amx(const float *x, const int64_t rows, const int64_t K, const int8_t *packed, const float *w_scale,
             const float *bias, float *out, const int64_t N, int8_t *xq, float *x_scale, const int threads) {
    #pragma omp parallel num_threads(threads)
    {
        quantize_rows_int8(x, rows, K, xq, x_scale);
        w8a8_amx_share(xq, x_scale, rows, K, packed, w_scale, bias, out, N);
    }
    return 0;
}

/* w8a8_amx's product of x with a gate_up weight [gate; up] (N = 2 · I, I a multiple of 64), returned as
 * out [rows, I] = silu(gate) · up (the decode layer's SiLU); scratch: [threads, 2, rows, 64] float32. Returns 0. */
int w8a8_amx_silu_mul(const float *x, const int64_t rows, const int64_t K, const int8_t *packed, const float *w_scale,
                      const float *bias, float *out, const int64_t N, int8_t *xq, float *x_scale, float *scratch,
                      const int threads) {
    #pragma omp parallel num_threads(threads)
    {
        quantize_rows_int8(x, rows, K, xq, x_scale);
        w8a8_amx_silu_mul_share(xq, x_scale, rows, K, packed, w_scale, bias, out, N,
                                scratch + omp_get_thread_num() * 2 * rows * TILE_GROUP);
    }
    return 0;
}

static void amx_group_outputs(const struct group_operands *p, const int64_t group, const int64_t next_group,
                              float *outputs, int *configured_rows) {
    (void)next_group;
    amx_group(p->xq, p->x_scale, p->rows, p->K, p->packed, group, p->w_scale, p->bias, outputs, TILE_GROUP, p->N,
              configured_rows);
}

/* ids[m] = the index of row m's largest output of q(x) · wᵀ (`w8a8_amx`'s outputs, the same bits, never written
 * out), and with `logprobs` (else NULL) logprobs[m] = the log-softmax there: `row_folds` over the AMX product.
 * Returns 0, or -2 without memory. */
int w8a8_amx_argmax(const float *x, const int64_t rows, const int64_t K, const int8_t *packed, const float *w_scale,
                    const float *bias, int64_t *ids, const int64_t N, int8_t *xq, float *x_scale, float *logprobs,
                    const int threads) {
    struct thread_folds parts;
    if (thread_folds_alloc(&parts, threads, rows) != 0) return -2;
    const struct group_operands operands = {xq, x_scale, rows, K, packed, NULL, w_scale, bias, N};
    int status = 0;
    #pragma omp parallel num_threads(threads)
    {
        quantize_rows_int8(x, rows, K, xq, x_scale);
        amx_tile_config before;
        _tile_storeconfig(&before);
        int configured_rows = 0;
        if (fold_thread_share(&operands, amx_group_outputs, logprobs != NULL, &parts, &configured_rows) != 0) {
            #pragma omp atomic write
            status = -2;
        }
        amx_restore(&before, configured_rows);
    }
    thread_folds_merge(&parts, rows, ids, logprobs);
    return status;
}

#pragma GCC pop_options

/* -- paged_decode_attention (AMX): the BF16 build with q · k on AMX tiles ---------------------------------------
 * `tdpbf16ps` multiplies a tile of 16 rows × 32 bfloat16 by a tile of 16 bfloat16 pairs × 16 columns into 16 × 16
 * float32. A block's positions lie in the cache at a fixed stride, so 16 positions' K vectors (32 dims of each) are
 * one A tile loaded in place; the group's query heads, rounded to bfloat16 as the BF16 build rounds them, are the B
 * tile's columns (at most 16: MAX_GROUP). One instruction scores 16 positions for every head of the group, where
 * the BF16 build takes a `vdpbf16ps` per head and 32 dims of a position, then a reduction. The softmax and Σ weight ·
 * v are the BF16 build's. Taken for a bfloat16 cache of blocks of at least 16 positions on CPUs with AMX-BF16;
 * otherwise the BF16 build's path, unchanged. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,amx-tile,amx-bf16")

#define BF16_PAIRS 32

/* q · k: tile 0 the scores (16 positions × 16 heads, float32), 1 K (16 positions × 32 bfloat16), 2 q (16 pairs of
 * dims × 16 heads × 2). Σ weight · v: 2 V (16 pairs of positions × 16 dims × 2), 3 the weights (a row per head of
 * the group × 32 positions), 4-7 the sums (a row per head × 16 dims, float32). */
static void amx_attention_configure(const int group) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int tile = 0; tile < 8; tile++) config.rows[tile] = (uint8_t)(tile < 3 ? 16 : group), config.colsb[tile] = 64;
    _tile_loadconfig(&config);
}

/* bf16_dot_scores' scores (scores[g * length + p] = scale · q_g · k_p) on AMX tiles, the tiles configured by
 * `amx_attention_configure`; blocks of at least 16 positions (block_shift ≥ 4). Reading ahead, it asks for V's
 * positions as well as K's. A last tile past `length` reads the rest of its block (cache memory, whatever it
 * holds): each score row depends on its own position only, and those rows are not kept. */
static inline __attribute__((always_inline)) void amx_dot_scores(
    const float *q_group, const void *k_cache, const void *v_cache, const int64_t *table, const int block_shift,
    const int64_t kv_heads, const int64_t kvh, const int64_t head_dim, const int64_t group, const int64_t length,
    const int64_t fetch_end, const float scale, float *scores) {
    const int64_t parts = head_dim / BF16_PAIRS, stride = kv_heads * head_dim * (int64_t)sizeof(uint16_t);
    uint16_t q_pairs[MAX_HEAD_DIM / BF16_PAIRS][16][32] __attribute__((aligned(64)));  /* [part][pair][head, 2] */
    float tile[16][16] __attribute__((aligned(64)));  /* [position][head] */
    memset(q_pairs, 0, sizeof(q_pairs[0]) * (size_t)parts);
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++)
            q_pairs[d / BF16_PAIRS][d % BF16_PAIRS / 2][2 * g + d % 2] = bf16_nearest(q_group[g * head_dim + d]);
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t p0 = 0; p0 < length; p0 += 16) {
        for (int64_t m = 0; m < 16; m++) {  /* V too: at this pace, Σ weight · v would otherwise wait on memory */
            prefetch_position(k_cache, table, block_shift, kv_heads, kvh, head_dim, p0 + m + KV_PREFETCH_AHEAD,
                              fetch_end, 1);
            prefetch_position(v_cache, table, block_shift, kv_heads, kvh, head_dim, p0 + m + KV_PREFETCH_AHEAD,
                              fetch_end, 1);
        }
        const uint16_t *keys = key_vector(k_cache, table, block_shift, kv_heads, kvh, head_dim, p0, 1);
        _tile_zero(0);
        for (int64_t i = 0; i < parts; i++) {
            _tile_loadd(1, keys + BF16_PAIRS * i, stride);
            _tile_loadd(2, q_pairs[i], 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, tile, 64);
        const __mmask16 valid = lanes_below(length, p0);
        for (int64_t g = 0; g < group; g++)  /* head g's column, transposed into its row of scores */
            _mm512_mask_storeu_ps(scores + g * length + p0, valid,
                                  _mm512_mul_ps(_mm512_i32gather_ps(column, &tile[0][g], 4), scale16));
    }
}

/* Row r of the V B tiles for 32 dims parts [i0, i0 + parts): positions p and p + 1 (zero at or past `length`)
 * interleaved by `_mm512_unpacklo/hi_epi16` (as the BF16 build interleaves them) into tiles[2i][r] (lo) and
 * tiles[2i + 1][r] (hi), each tile 16 rows of 32 bfloat16. */
static inline __attribute__((always_inline)) void amx_v_pair_row(
    const void *v_cache, const int64_t *table, const int block_shift, const int64_t kv_heads, const int64_t kvh,
    const int64_t head_dim, const int64_t p, const int64_t length, const int64_t i0, const int64_t parts, const int r,
    uint16_t *tiles) {
    const uint16_t *v0 = p < length ? key_vector(v_cache, table, block_shift, kv_heads, kvh, head_dim, p, 1) : NULL;
    const uint16_t *v1 = p + 1 < length ? key_vector(v_cache, table, block_shift, kv_heads, kvh, head_dim, p + 1, 1)
                                        : NULL;
    for (int64_t i = 0; i < parts; i++) {
        const __m512i a = v0 ? _mm512_loadu_si512(v0 + BF16_PAIRS * (i0 + i)) : _mm512_setzero_si512();
        const __m512i b = v1 ? _mm512_loadu_si512(v1 + BF16_PAIRS * (i0 + i)) : _mm512_setzero_si512();
        _mm512_store_si512(tiles + ((2 * i) * 16 + r) * 32, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(tiles + ((2 * i + 1) * 16 + r) * 32, _mm512_unpackhi_epi16(a, b));
    }
}

/* bf16_weighted_values on AMX tiles (the tiles configured by `amx_attention_configure`): 32 positions at a time,
 * the weights of the group's heads (rounded to bfloat16 in place, as there) are one A tile, read in place, and two
 * positions' V vectors interleaved by `_mm512_unpacklo/hi_epi16` (as there) are a row of a B tile, built in `pairs`;
 * each head's sums over 32 dims are two C tiles (the lo and hi halves, put back in order at the end as there), so
 * 64 dims at a time. Positions past `length` in the last 32 have zero V and zero weights. */
static inline __attribute__((always_inline)) void amx_weighted_values(
    float *scores, const void *v_cache, const int64_t *table, const int block_shift, const int64_t kv_heads,
    const int64_t kvh, const int64_t head_dim, const int64_t group, const int64_t length, const int64_t fetch_end,
    const float *total, float *out) {
    const int64_t parts = head_dim / BF16_PAIRS, weight_stride = length * (int64_t)sizeof(float);
    uint16_t pairs[4][16][32] __attribute__((aligned(64)));  /* [part, lo / hi][pair of positions][dim, 2] */
    uint16_t tail[MAX_GROUP][32] __attribute__((aligned(64)));  /* the last 32 positions' weights, zero-padded */
    float sums[4][MAX_GROUP][16] __attribute__((aligned(64)));
    round_weights_bf16(scores, group, length);
    const int64_t whole = length / 32 * 32;
    if (whole < length) {
        memset(tail, 0, sizeof tail);
        for (int64_t g = 0; g < group; g++)
            memcpy(tail[g], (const uint16_t *)(scores + g * length) + whole,
                   (size_t)(length - whole) * sizeof(uint16_t));
    }
    for (int64_t i0 = 0; i0 < parts; i0 += 2) {
        const int64_t parts_here = parts - i0 < 2 ? parts - i0 : 2;
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        for (int64_t p0 = 0; p0 < length; p0 += 32) {
            for (int64_t r = 0; r < 16; r++) {
                const int64_t p = p0 + 2 * r;
                if (i0 == 0)  /* the first pass reads V from memory, a later one (heads over 64 dims) from L2 */
                    for (int64_t j = 0; j < 2; j++)
                        prefetch_position(v_cache, table, block_shift, kv_heads, kvh, head_dim,
                                          p + j + KV_PREFETCH_AHEAD, fetch_end, 1);
                amx_v_pair_row(v_cache, table, block_shift, kv_heads, kvh, head_dim, p, length, i0, parts_here, (int)r,
                               &pairs[0][0][0]);
            }
            if (p0 < whole)
                _tile_loadd(3, (const uint16_t *)scores + p0, weight_stride);
            else
                _tile_loadd(3, tail, 64);
            _tile_loadd(2, pairs[0], 64); _tile_dpbf16ps(4, 3, 2);
            _tile_loadd(2, pairs[1], 64); _tile_dpbf16ps(5, 3, 2);
            if (parts_here == 2) {
                _tile_loadd(2, pairs[2], 64); _tile_dpbf16ps(6, 3, 2);
                _tile_loadd(2, pairs[3], 64); _tile_dpbf16ps(7, 3, 2);
            }
        }
        _tile_stored(4, sums[0], 64); _tile_stored(5, sums[1], 64);
        _tile_stored(6, sums[2], 64); _tile_stored(7, sums[3], 64);
        for (int64_t g = 0; g < group; g++) {
            const __m512 inverse = _mm512_set1_ps(length > 0 ? 1.f / total[g] : 0.f);
            for (int64_t i = 0; i < parts_here; i++)
                store_pair_sums(_mm512_load_ps(sums[2 * i][g]), _mm512_load_ps(sums[2 * i + 1][g]), inverse,
                                out + g * head_dim + BF16_PAIRS * (i0 + i));
        }
    }
}

#define V_AMX
#define V_BF16_DOT
#define V_EXP exp512_amx
#define TILE_ROWS tile_rows_amx
#define ACCUMULATE_V accumulate_v_amx
#define ATTEND_TASKS attend_tasks_amx
#define PAGED_DECODE_ATTEND paged_decode_attend_amx
#define PAGED_DECODE_ATTENTION paged_decode_attention_amx
#include "cpu_attention.inc"
#undef V_BF16_DOT
#undef V_AMX

/* -- paged_prefill_attention (AMX): a prefill chunk's causal attention on AMX tiles ----------------------------
 * The decode kernel attends a chunk's rows one by one: each row rebuilds the tiles of its whole context, and the
 * group's heads fill 7 of a tile's 16 columns. Here the context's K and V are laid out in tile order once per
 * call (per KV head: K as B tiles of 16 positions × 16 pairs of dims, V as B tiles of 16 pairs of positions ×
 * 16 dims × 2, the decode build's interleaving), and 16 query rows of one head are an A tile: one `tdpbf16ps`
 * scores 16 positions for 16 rows, one more weighs 32 positions' V for them. Per (KV head, 16 rows, head):
 * the scores of every position up to the last row's (float32, two passes: exact maxima, no rescaling), each
 * row's softmax numerators over its own causal context (positions past it weigh exactly 0), rounded to bfloat16
 * as the decode build rounds them, then Σ weight · v divided by the float32 total. A row's result depends on its
 * query and its context only, not on the chunk it came in. */

/* K of positions [16 b, 16 b + 16) as a B tile per 32 dims: row r holds dims (2r, 2r + 1) of the 16 positions
 * (one 32-bit gather per row); positions at or past `length` are zero. */
static void amx_pack_keys(const void *k_cache, const int64_t *table, const int block_shift, const int64_t kv_heads,
                          const int64_t kvh, const int64_t head_dim, const int64_t b, const int64_t length,
                          uint16_t *tiles) {
    const int64_t parts = head_dim / BF16_PAIRS, p0 = 16 * b;
    if (p0 >= length) {
        memset(tiles, 0, (size_t)(16 * head_dim) * sizeof(uint16_t));
        return;
    }
    const __mmask16 valid = lanes_below(length, p0);
    const uint16_t *first = key_vector(k_cache, table, block_shift, kv_heads, kvh, head_dim, p0, 1);
    /* 16 positions of one block lie kv_heads · head_dim bfloat16 apart (16 | block_size) */
    const __m512i position = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                                                   15),
                                                _mm512_set1_epi32((int)(kv_heads * head_dim / 2)));
    for (int64_t i = 0; i < parts; i++)
        for (int r = 0; r < 16; r++) {
            const __m512i index = _mm512_add_epi32(position, _mm512_set1_epi32((int)(16 * i + r)));
            _mm512_store_si512(tiles + (i * 16 + r) * 32,
                               _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, index, first, 4));
        }
}

/* V of positions [32 s, 32 s + 32) as B tiles per 32 dims, lo and hi: row r interleaves positions 32 s + 2r and
 * 32 s + 2r + 1 (`_mm512_unpacklo/hi_epi16`, as `amx_weighted_values`); positions at or past `length` are zero. */
static void amx_pack_values(const void *v_cache, const int64_t *table, const int block_shift, const int64_t kv_heads,
                            const int64_t kvh, const int64_t head_dim, const int64_t s, const int64_t length,
                            uint16_t *tiles) {
    for (int r = 0; r < 16; r++)
        amx_v_pair_row(v_cache, table, block_shift, kv_heads, kvh, head_dim, 32 * s + 2 * r, length, 0,
                       head_dim / BF16_PAIRS, r, tiles);
}

/* Row `visible` positions long of scaled scores → bfloat16 softmax numerators in `weights` (zero from `visible` to
 * `width`); returns their float32 total. */
static inline float amx_row_softmax(const float *row, const int64_t visible, const int64_t width, const float scale,
                                    uint16_t *weights) {
    const __m512 scale16 = _mm512_set1_ps(scale);
    __m512 lanes_max = _mm512_set1_ps(-INFINITY);
    int64_t p = 0;
    for (; p < visible; p += 16) {
        const __mmask16 valid = lanes_below(visible, p);
        lanes_max = _mm512_mask_max_ps(lanes_max, valid, lanes_max, _mm512_mul_ps(_mm512_loadu_ps(row + p), scale16));
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(lanes_max));
    __m512 sum = _mm512_setzero_ps();
    for (p = 0; p < width; p += 16) {
        const __mmask16 valid = p >= visible ? 0 : lanes_below(visible, p);
        const __m512 e = _mm512_maskz_mov_ps(
            valid, exp512_amx(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(row + p), scale16), row_max)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(weights + p), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* One (KV head, 16 query rows from t0, head g of the group) task; `scores` [16, width] float32 and `weights`
 * [16, width] bfloat16 are this thread's. */
static void amx_prefill_task(const float *q, const uint16_t *keys, const uint16_t *values, const int64_t num_computed,
                             const int64_t rows, const int64_t heads, const int64_t kv_heads, const int64_t head_dim,
                             const int64_t kvh, const int64_t t0, const int64_t g, const float scale, float *scores,
                             uint16_t *weights, float *out) {
    const int64_t parts = head_dim / BF16_PAIRS, group = heads / kv_heads, head = kvh * group + g;
    const int64_t m = rows - t0 < 16 ? rows - t0 : 16, seen = num_computed + t0 + m;  /* the last row's context */
    const int64_t width = (seen + 31) / 32 * 32;
    uint16_t q_tile[MAX_HEAD_DIM / BF16_PAIRS][16][32] __attribute__((aligned(64)));  /* [part][row][dim] */
    float sums[4][16][16] __attribute__((aligned(64)));
    float total[16];
    memset(q_tile, 0, sizeof(q_tile[0]) * (size_t)parts);
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < parts; i++) {
            const float *x = q + ((t0 + r) * heads + head) * head_dim + BF16_PAIRS * i;
            const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
            _mm512_store_si512(q_tile[i][r], (__m512i)pair);
        }
    for (int64_t b = 0; b < width / 16; b++) {  /* scores, 16 positions × 16 rows a tile */
        _tile_zero(0);
        for (int64_t i = 0; i < parts; i++) {
            _tile_loadd(1, q_tile[i], 64);
            _tile_loadd(2, keys + (b * parts + i) * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, scores + 16 * b, width * (int64_t)sizeof(float));
    }
    for (int64_t r = 0; r < 16; r++) {
        if (r < m)
            total[r] = amx_row_softmax(scores + r * width, num_computed + t0 + r + 1, width, scale, weights + r * width);
        else
            memset(weights + r * width, 0, (size_t)width * sizeof(uint16_t));
    }
    for (int64_t i0 = 0; i0 < parts; i0 += 2) {  /* Σ weight · v, 64 dims at a time */
        const int64_t parts_here = parts - i0 < 2 ? parts - i0 : 2;
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        for (int64_t s = 0; s < width / 32; s++) {
            const uint16_t *tiles = values + (s * parts + i0) * 2 * 512;
            _tile_loadd(3, weights + 32 * s, width * (int64_t)sizeof(uint16_t));
            _tile_loadd(2, tiles, 64); _tile_dpbf16ps(4, 3, 2);
            _tile_loadd(2, tiles + 512, 64); _tile_dpbf16ps(5, 3, 2);
            if (parts_here == 2) {
                _tile_loadd(2, tiles + 1024, 64); _tile_dpbf16ps(6, 3, 2);
                _tile_loadd(2, tiles + 1536, 64); _tile_dpbf16ps(7, 3, 2);
            }
        }
        _tile_stored(4, sums[0], 64); _tile_stored(5, sums[1], 64);
        _tile_stored(6, sums[2], 64); _tile_stored(7, sums[3], 64);
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < parts_here; i++)
                store_pair_sums(_mm512_load_ps(sums[2 * i][r]), _mm512_load_ps(sums[2 * i + 1][r]),
                                _mm512_set1_ps(1.f / total[r]),
                                out + ((t0 + r) * heads + head) * head_dim + BF16_PAIRS * (i0 + i));
    }
}

/* q [rows, H, D] float32: a chunk's rows at positions [num_computed, num_computed + rows) of one sequence, whose
 * K/V (these rows' included) are in the bfloat16 caches [slots, KVH, D] at `block_table`'s blocks; row t attends
 * over positions [0, num_computed + t]. out [rows, H, D] float32. D a multiple of 32 up to MAX_HEAD_DIM, H / KVH up
 * to MAX_GROUP, block_size a power of two of at least 16. Returns 0, -1 on bad sizes, -2 without memory. */
int paged_prefill_attention_amx(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                                const int64_t num_computed, const int64_t rows, const int64_t heads,
                                const int64_t kv_heads, const int64_t head_dim, const int64_t block_size,
                                const float scale, float *out, const int threads) {
    if (head_dim % BF16_PAIRS || head_dim > MAX_HEAD_DIM || heads % kv_heads || heads / kv_heads > MAX_GROUP) return -1;
    if (block_size < 16 || block_size & (block_size - 1)) return -1;
    if (rows <= 0) return 0;
    const int block_shift = __builtin_ctzll((unsigned long long)block_size);
    const int64_t length = num_computed + rows, padded = (length + 31) / 32 * 32, group = heads / kv_heads;
    const int64_t per_head = padded * head_dim;  /* bfloat16 of K (or V) tiles per KV head */
    uint16_t *keys = aligned_alloc(64, (size_t)(2 * kv_heads * per_head) * sizeof(uint16_t));
    if (!keys) return -2;
    uint16_t *values = keys + kv_heads * per_head;
    const int64_t row_tiles = (rows + 15) / 16;
    int status = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * (padded / 16); task++) {
            const int64_t kvh = task / (padded / 16), b = task % (padded / 16);
            amx_pack_keys(k_cache, block_table, block_shift, kv_heads, kvh, head_dim, b, length,
                          keys + kvh * per_head + b * 16 * head_dim);
            if (b % 2 == 0)
                amx_pack_values(v_cache, block_table, block_shift, kv_heads, kvh, head_dim, b / 2, length,
                                values + kvh * per_head + b / 2 * 32 * head_dim);
        }
        float *scores = aligned_alloc(64, (size_t)(16 * padded) * (sizeof(float) + sizeof(uint16_t)));
        if (!scores) {
            #pragma omp atomic write
            status = -2;
        }
        uint16_t *weights = scores ? (uint16_t *)(scores + 16 * padded) : NULL;
        amx_tile_config before;
        _tile_storeconfig(&before);
        amx_attention_configure(16);
        /* Later rows see more positions: the costliest tasks first, handed out one at a time. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < row_tiles * kv_heads * group; task++) {
            if (!scores) continue;
            const int64_t tile = row_tiles - 1 - task / (kv_heads * group), head = task % (kv_heads * group);
            amx_prefill_task(q, keys + head / group * per_head, values + head / group * per_head, num_computed, rows,
                             heads, kv_heads, head_dim, head / group, 16 * tile, head % group, scale, scores, weights,
                             out);
        }
        amx_restore(&before, 1);
        free(scores);
    }
    free(keys);
    return status;
}
#undef BF16_PAIRS

#pragma GCC pop_options
#else  /* this compiler has no AMX intrinsics: the Python side never enables the AMX paths */
int w8a8_amx_enable(void) { return -1; }
int w8a8_amx_argmax(const float *x, const int64_t rows, const int64_t K, const int8_t *packed, const float *w_scale,
                    const float *bias, int64_t *ids, const int64_t N, int8_t *xq, float *x_scale, float *logprobs,
                    const int threads) {
    (void)x, (void)rows, (void)K, (void)packed, (void)w_scale, (void)bias, (void)N, (void)xq, (void)x_scale;
    (void)ids, (void)logprobs, (void)threads;
    return -1;
}
int paged_prefill_attention_amx(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                                const int64_t num_computed, const int64_t rows, const int64_t heads,
                                const int64_t kv_heads, const int64_t head_dim, const int64_t block_size,
                                const float scale, float *out, const int threads) {
    (void)q, (void)k_cache, (void)v_cache, (void)block_table, (void)num_computed, (void)rows, (void)heads;
    (void)kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)out, (void)threads;
    return -1;
}
static void quantize_rows_int8(const float *x, const int64_t rows, const int64_t K, int8_t *xq, float *x_scale) {
    (void)x, (void)rows, (void)K, (void)xq, (void)x_scale;
}
static void w8a8_amx_share(const int8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                           const int8_t *packed, const float *w_scale, const float *bias, float *out, const int64_t N) {
    (void)xq, (void)x_scale, (void)rows, (void)K, (void)packed, (void)w_scale, (void)bias, (void)out, (void)N;
}
static void w8a8_amx_silu_mul_share(const int8_t *xq, const float *x_scale, const int64_t rows, const int64_t K,
                                    const int8_t *packed, const float *w_scale, const float *bias, float *out,
                                    const int64_t N, float *scratch) {
    (void)xq, (void)x_scale, (void)rows, (void)K, (void)packed, (void)w_scale, (void)bias, (void)out, (void)N;
    (void)scratch;
}
static void paged_decode_attend_amx(const float *q, const void *k_cache, const void *v_cache, const int bf16,
                                    const int64_t *block_tables, const int64_t max_blocks, const int64_t *context_lens,
                                    const int64_t rows, const int64_t heads, const int64_t kv_heads,
                                    const int64_t head_dim, const int block_shift, const float scale,
                                    const int fetch_ahead, float *out, int *status) {
    (void)q, (void)k_cache, (void)v_cache, (void)bf16, (void)block_tables, (void)max_blocks, (void)context_lens;
    (void)rows, (void)heads, (void)kv_heads, (void)head_dim, (void)block_shift, (void)scale, (void)fetch_ahead;
    (void)out;
    *status = -1;
}
#endif
