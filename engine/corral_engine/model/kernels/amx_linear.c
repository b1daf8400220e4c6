/* bf16 Linear layers with AMX tiles: out[M][N] = bf16(x[M][K] . w[N][K]^T + bias), float32 sums
 * rounded once, on CPUs with AMX (amx_linear_available). oneDNN, which PyTorch's Linear runs, uses
 * the same tiles, but reaches only ~0.8 TFLOP/s on two Sapphire Rapids cores at a prompt step's
 * 2,000 rows (docs/engine-speed.md); this kernel is one loop nest tuned for those shapes.
 *
 * The weight is packed once (amx_linear_pack_bf16) into the tiles' B layout: per 16 output columns
 * and 32 input columns, 16 rows of column pairs, [N/16][K/32][16][16][2]. Rows of x are read as A
 * tiles in place (16 rows x 32 columns, row stride K). A 32 x 32 block of out sums in four float32
 * tiles over K, then each row is rounded to bf16 (vcvtneps2bf16, round to nearest even) with the
 * bias added first. Work items are 256-row x 256-column panels (x's rows in L2, the weight's panel
 * in L2 across them), spread over the threads. A last block of fewer than 32 rows is copied into a
 * zeroed 32-row buffer first. Needs N % 32 == 0 and K % 32 == 0 (amx_linear_fits).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"

#define AMX_LINEAR_PANEL_ROWS 256
#define AMX_LINEAR_PANEL_COLS 256

int amx_linear_available(void) { return amx_usable(); }

int amx_linear_fits(int64_t n, int64_t k) { return n > 0 && k > 0 && n % 32 == 0 && k % 32 == 0; }

#ifdef HAVE_AMX
void amx_linear_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int num_threads) {
    const int64_t kb_count = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t kb = 0; kb < kb_count; kb++) {
            uint16_t *tile = packed + (nb * kb_count + kb) * 512;
            for (int64_t r = 0; r < 16; r++)
                for (int64_t c = 0; c < 16; c++) {
                    const uint16_t *src = w + (nb * 16 + c) * k + kb * 32 + 2 * r;
                    tile[r * 32 + c * 2] = src[0];
                    tile[r * 32 + c * 2 + 1] = src[1];
                }
        }
}

/* Rows [m0, m0 + 32) of x (row stride k) times the weight's columns [n0, n0 + 32), into out. */
static inline void block_32x32(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *out,
                               int64_t out_rows, int64_t n, int64_t k, int64_t n0, float *cbuf) {
    const int64_t kb_count = k / 32;
    const uint16_t *b0 = packed + (n0 / 16) * kb_count * 512, *b1 = b0 + kb_count * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kb_count; kb++) {
        _tile_loadd(4, x + kb * 32, k * 2);
        _tile_loadd(5, x + 16 * k + kb * 32, k * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
    const __m512 bias_lo = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    const __m512 bias_hi = bias ? _mm512_loadu_ps(bias + n0 + 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < out_rows; r++) {
        const float *lo = cbuf + (r / 16) * 512 + (r % 16) * 16, *hi = lo + 256;
        uint16_t *o = out + r * n + n0;
        _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(lo), bias_lo)));
        _mm256_storeu_si256((__m256i *)(o + 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(hi), bias_hi)));
    }
}

/* 0: done; 1: a scratch buffer could not be allocated; 2: no AMX here (nothing written). */
int amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, int64_t m,
                    int64_t n, int64_t k, int num_threads) {
    if (!amx_usable()) return 2;
    float *bias_f32 = NULL;
    if (bias != NULL) {
        bias_f32 = malloc(sizeof(float) * n);
        if (bias_f32 == NULL) return 1;
        for (int64_t i = 0; i < n; i++) bias_f32[i] = bf16_to_f32(bias[i]);
    }
    const int64_t row_panels = (m + AMX_LINEAR_PANEL_ROWS - 1) / AMX_LINEAR_PANEL_ROWS;
    const int64_t col_panels = (n + AMX_LINEAR_PANEL_COLS - 1) / AMX_LINEAR_PANEL_COLS;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *cbuf = malloc(sizeof(float) * 1024);
        uint16_t *tail = m % 32 ? calloc((size_t)(32 * k), sizeof(uint16_t)) : NULL; /* the last rows, padded */
        const int ok = cbuf != NULL && (m % 32 == 0 || tail != NULL);
        if (ok) amx_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < row_panels * col_panels; item++) {
            if (!ok) {
                failed = 1;
                continue;
            }
            /* column panels outer: consecutive items share a panel of the weight */
            const int64_t cp = item / row_panels, rp = item % row_panels;
            const int64_t m_end = (rp + 1) * AMX_LINEAR_PANEL_ROWS < m ? (rp + 1) * AMX_LINEAR_PANEL_ROWS : m;
            const int64_t n_end = (cp + 1) * AMX_LINEAR_PANEL_COLS < n ? (cp + 1) * AMX_LINEAR_PANEL_COLS : n;
            for (int64_t m0 = rp * AMX_LINEAR_PANEL_ROWS; m0 < m_end; m0 += 32) {
                const int64_t rows = m_end - m0 < 32 ? m_end - m0 : 32;
                const uint16_t *a = x + m0 * k;
                if (rows < 32) {
                    memcpy(tail, a, sizeof(uint16_t) * rows * k);
                    a = tail;
                }
                for (int64_t n0 = cp * AMX_LINEAR_PANEL_COLS; n0 < n_end; n0 += 32)
                    block_32x32(a, packed, bias_f32, out + m0 * n, rows, n, k, n0, cbuf);
            }
        }
        if (ok) amx_end();
        free(cbuf);
        free(tail);
    }
    free(bias_f32);
    return failed;
}
#else
void amx_linear_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int num_threads) {
    (void)w, (void)packed, (void)n, (void)k, (void)num_threads;
}

int amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, int64_t m,
                    int64_t n, int64_t k, int num_threads) {
    (void)x, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)num_threads;
    return 2;
}
#endif
