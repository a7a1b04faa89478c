/* CPU kernels for decode steps of few rows, where PyTorch's per-op costs and oneDNN's one-row GEMM
 * leave most of the memory bandwidth unused. AVX-512 (F, BW, VNNI); loaded by engines/cpu_kernels.py.
 *
 * Threads: OpenMP. Python has loaded torch's libgomp by the time this library is opened, so the two
 * share one runtime and one thread pool (same soname).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* -- w8a8_gemv ---------------------------------------------------------------------------------------
 * w8a8 matmul for few rows: out = (q(x) · wᵀ) · x_scale · w_scale (+ bias), float32 out.
 *
 * Bit-identical to W8A8Linear's torch path (per-row symmetric int8 activations, `torch._int_mm`, then the
 * two float multiplies in the same order), but streams the int8 weight at close to DRAM bandwidth at one
 * row, where oneDNN's `_int_mm` reaches about half of it. AVX-512 VNNI: `vpdpbusd` multiplies unsigned by
 * signed bytes, so activations are shifted to u8 (q + 128) and 128 · Σₖ w[n, k] (`w_sum`, taken once when
 * the layer is built) is subtracted from each dot product — exact in int32.
 * Threads split the output rows.
 */

#define MAX_ROWS 8

static inline __attribute__((always_inline)) void dot_rows(
    const int64_t rows, const uint8_t *xq, const float *x_scale, const int64_t K, const int8_t *w,
    const int32_t *w_sum, const float *w_scale, const float *bias, float *out, const int64_t N,
    const int64_t n_begin, const int64_t n_end) {
    const int64_t chunks = K / 64;
    const __mmask64 tail = (K % 64) ? (((__mmask64)1 << (K % 64)) - 1) : 0;
    for (int64_t n = n_begin; n < n_end; n++) {
        const int8_t *w_row = w + n * K;
        __m512i acc[MAX_ROWS];
        for (int64_t m = 0; m < rows; m++) acc[m] = _mm512_setzero_si512();
        for (int64_t c = 0; c < chunks; c++) {
            const __m512i w_chunk = _mm512_loadu_si512((const void *)(w_row + c * 64));
            for (int64_t m = 0; m < rows; m++)
                acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512((const void *)(xq + m * K + c * 64)), w_chunk);
        }
        if (tail) {
            const __m512i w_chunk = _mm512_maskz_loadu_epi8(tail, w_row + chunks * 64);
            for (int64_t m = 0; m < rows; m++)
                acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_maskz_loadu_epi8(tail, xq + m * K + chunks * 64), w_chunk);
        }
        for (int64_t m = 0; m < rows; m++) {
            const int32_t dot = _mm512_reduce_add_epi32(acc[m]) - 128 * w_sum[n];
            const float y = ((float)dot * x_scale[m]) * w_scale[n];
            out[m * N + n] = bias ? y + bias[n] : y;
        }
    }
}

/* Per-row scale max|x| / 127 (at least 1e-12 / 127) and x / scale rounded half to even, as torch.round. */
static void quantize_rows(const float *x, const int64_t rows, const int64_t K, uint8_t *xq, float *x_scale) {
    for (int64_t m = 0; m < rows; m++) {
        const float *x_row = x + m * K;
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x_row[k]));
        const float scale = fmaxf(amax, 1e-12f) / 127.f;
        x_scale[m] = scale;
        for (int64_t k = 0; k < K; k++) xq[m * K + k] = (uint8_t)((int32_t)nearbyintf(x_row[k] / scale) + 128);
    }
}

int w8a8_gemv_max_rows(void) { return MAX_ROWS; }

/* x [rows, K] float32; w [N, K] int8; w_sum [N] int32; w_scale [N] float32; bias [N] float32 or NULL;
 * out [rows, N] float32; xq [rows, K] and x_scale [rows] are scratch. Returns 0, or -1 if rows > MAX_ROWS. */
int w8a8_gemv(const float *x, const int64_t rows, const int64_t K, const int8_t *w, const int32_t *w_sum,
              const float *w_scale, const float *bias, float *out, const int64_t N, uint8_t *xq, float *x_scale,
              const int threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    quantize_rows(x, rows, K, xq, x_scale);
    #pragma omp parallel num_threads(threads)
    {
        const int64_t count = omp_get_num_threads(), index = omp_get_thread_num();
        const int64_t per_thread = (N + count - 1) / count;
        const int64_t begin = index * per_thread < N ? index * per_thread : N;
        const int64_t end = begin + per_thread < N ? begin + per_thread : N;
        switch (rows) {  /* a constant row count per case: the accumulators stay in registers */
#define ROWS(r) case r: dot_rows(r, xq, x_scale, K, w, w_sum, w_scale, bias, out, N, begin, end); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
    }
    return 0;
}

/* -- paged_decode_attention --------------------------------------------------------------------------
 * One query token per row attending over its sequence's context in the paged KV cache, read in place
 * through the block table (no gathered copy, no mask): row t sees positions [0, context_lens[t]).
 * K/V are float32 or bfloat16 (widened exactly); scores, softmax and the weighted sum in float32.
 * Query heads sharing a KV head are done together, so each K/V vector is read once per group.
 * Threads split the (row, KV head) pairs.
 */
#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

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

/* e^x for x ≤ 0 (softmax numerators), to about 2 ulp: e^x = 2^n · e^r with n = round(x / ln 2),
 * |r| ≤ ln 2 / 2, e^r by Cephes' expf polynomial; below -87 it is 0, as the scalar expf's denormals
 * would make no difference to the softmax either. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(y, n);
}

/* Where position p's K (or V) vector of KV head kvh lives in the paged cache. */
static inline const void *key_vector(const void *cache, const int64_t *table, const int64_t block_size,
                                     const int64_t kv_heads, const int64_t kvh, const int64_t head_dim,
                                     const int64_t p, const int bf16) {
    const int64_t index = ((table[p / block_size] * block_size + p % block_size) * kv_heads + kvh) * head_dim;
    return bf16 ? (const void *)((const uint16_t *)cache + index) : (const void *)((const float *)cache + index);
}

int paged_decode_attention_limits(int64_t *max_head_dim, int64_t *max_group) {
    *max_head_dim = MAX_HEAD_DIM;
    *max_group = MAX_GROUP;
    return 0;
}

/* q [T, H, D] float32; k_cache/v_cache [slots, KVH, D] (bf16 != 0: bfloat16, else float32);
 * block_tables [T, max_blocks] int64; context_lens [T] int64; out [T, H, D] float32.
 * D a multiple of 16 up to MAX_HEAD_DIM, H / KVH up to MAX_GROUP. Returns 0, or -1 on bad sizes. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, const int bf16,
                           const int64_t *block_tables, const int64_t max_blocks, const int64_t *context_lens,
                           const int64_t rows, const int64_t heads, const int64_t kv_heads, const int64_t head_dim,
                           const int64_t block_size, const float scale, float *out, const int threads) {
    const int64_t group = heads / kv_heads, vectors = head_dim / 16;
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || heads % kv_heads || group > MAX_GROUP) return -1;
    int64_t longest = 0;
    for (int64_t t = 0; t < rows; t++) longest = context_lens[t] > longest ? context_lens[t] : longest;
    int status = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * (longest > 0 ? longest : 1)));
        if (!scores) {
            #pragma omp atomic write
            status = -1;
        }
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * kv_heads; task++) {
            if (!scores) continue;
            const int64_t t = task / kv_heads, kvh = task % kv_heads, length = context_lens[t];
            const int64_t *table = block_tables + t * max_blocks;
            const float *q_group = q + (t * heads + kvh * group) * head_dim;
            __m512 acc[MAX_HEAD_DIM / 16];
            float maximum[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) maximum[g] = -INFINITY;
            int64_t p = 0;
            for (; p + 4 <= length; p += 4) {  /* scores q·k, four positions at a time: one reduction for four */
                const void *k_rows[4];
                for (int j = 0; j < 4; j++)
                    k_rows[j] = key_vector(k_cache, table, block_size, kv_heads, kvh, head_dim, p + j, bf16);
                for (int64_t g = 0; g < group; g++) {
                    __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                    for (int64_t i = 0; i < vectors; i++) {
                        const __m512 q_part = _mm512_loadu_ps(q_group + g * head_dim + 16 * i);
                        for (int j = 0; j < 4; j++) dot[j] = _mm512_fmadd_ps(q_part, load16(k_rows[j], 16 * i, bf16), dot[j]);
                    }
                    const __m128 four = _mm_mul_ps(hsum4_ps(dot[0], dot[1], dot[2], dot[3]), _mm_set1_ps(scale));
                    _mm_storeu_ps(scores + g * length + p, four);
                    for (int j = 0; j < 4; j++) maximum[g] = fmaxf(maximum[g], scores[g * length + p + j]);
                }
            }
            for (; p < length; p++) {
                const void *k_row = key_vector(k_cache, table, block_size, kv_heads, kvh, head_dim, p, bf16);
                for (int64_t g = 0; g < group; g++) {
                    __m512 dot = _mm512_setzero_ps();
                    for (int64_t i = 0; i < vectors; i++)
                        dot = _mm512_fmadd_ps(_mm512_loadu_ps(q_group + g * head_dim + 16 * i), load16(k_row, 16 * i, bf16), dot);
                    const float score = _mm512_reduce_add_ps(dot) * scale;
                    scores[g * length + p] = score;
                    maximum[g] = fmaxf(maximum[g], score);
                }
            }
            float total[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) {  /* softmax numerators, in place, sixteen at a time */
                float *row = scores + g * length;
                const __m512 row_max = _mm512_set1_ps(maximum[g]);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t p = 0; p < length; p += 16) {
                    const __mmask16 mask = length - p >= 16 ? 0xFFFF : (__mmask16)((1u << (length - p)) - 1);
                    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + p), row_max));
                    _mm512_mask_storeu_ps(row + p, mask, e);
                    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
                }
                total[g] = _mm512_reduce_add_ps(sum);
            }
            __m512 sums[MAX_GROUP][MAX_HEAD_DIM / 16];
            for (int64_t g = 0; g < group; g++)
                for (int64_t i = 0; i < vectors; i++) sums[g][i] = _mm512_setzero_ps();
            for (p = 0; p < length; p++) {  /* Σ weight · v, each V vector read once for the group */
                const void *v_row = key_vector(v_cache, table, block_size, kv_heads, kvh, head_dim, p, bf16);
                for (int64_t i = 0; i < vectors; i++) acc[i] = load16(v_row, 16 * i, bf16);
                for (int64_t g = 0; g < group; g++) {
                    const __m512 weight = _mm512_set1_ps(scores[g * length + p]);
                    for (int64_t i = 0; i < vectors; i++) sums[g][i] = _mm512_fmadd_ps(weight, acc[i], sums[g][i]);
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const __m512 inverse = _mm512_set1_ps(length > 0 ? 1.f / total[g] : 0.f);
                float *o = out + (t * heads + kvh * group + g) * head_dim;
                for (int64_t i = 0; i < vectors; i++) _mm512_storeu_ps(o + 16 * i, _mm512_mul_ps(sums[g][i], inverse));
            }
        }
        free(scores);
    }
    return status;
}
