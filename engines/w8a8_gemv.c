/* w8a8 matmul for few rows (decode steps): out = (q(x) · wᵀ) · x_scale · w_scale (+ bias), float32 out.
 *
 * Bit-identical to W8A8Linear's torch path (per-row symmetric int8 activations, `torch._int_mm`, then the
 * two float multiplies in the same order), but streams the int8 weight at close to DRAM bandwidth at one
 * row, where oneDNN's `_int_mm` reaches about half of it. AVX-512 VNNI: `vpdpbusd` multiplies unsigned by
 * signed bytes, so activations are shifted to u8 (q + 128) and 128 · Σₖ w[n, k] (`w_sum`, taken once when
 * the layer is built) is subtracted from each dot product — exact in int32.
 *
 * Threads: OpenMP over output rows. Python has loaded torch's libgomp by the time this library is
 * opened, so the two share one runtime and one thread pool (same soname).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

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
