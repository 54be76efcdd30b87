/* Block-quantised formats: e4m3 decoding and rounding, int8 / int4 block round trips within half
 * a step, and the reference products against dequantise-then-multiply in double precision, at
 * the expert shapes of Qwen3.6-35B-A3B (2048 x 512 and 512 x 2048). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/quant.h"
#include "test_util.h"

static void test_fp8(void) {
    int bad = 0;
    for (int b = 0; b < 256; b++) {
        float v = qf_fp8_to_f32((uint8_t)b);
        int e = (b >> 3) & 15, m = b & 7;
        double want = (e == 15 && m == 7) ? NAN : (e ? (1 + m / 8.0) * pow(2, e - 7) : m / 8.0 * pow(2, -6)) * ((b & 0x80) ? -1 : 1);
        if (isnan(want)) bad += !isnan(v);
        else bad += v != (float)want || qf_f32_to_fp8(v) != (uint8_t)b;
    }
    CHECK(bad == 0, "%d e4m3 codes decode or re-encode wrongly", bad);
    CHECK(qf_fp8_to_f32(0x7e) == 448.0f && qf_fp8_to_f32(0x38) == 1.0f && qf_fp8_to_f32(0xb8) == -1.0f && qf_fp8_to_f32(0x01) == ldexpf(1, -9),
          "e4m3 landmarks");
    CHECK(qf_f32_to_fp8(1.0625f) == 0x38 && qf_f32_to_fp8(1.1875f) == 0x3a, "ties go to the even mantissa");
    CHECK(qf_f32_to_fp8(1e6f) == 0x7e && qf_f32_to_fp8(-500.0f) == 0xfe && qf_f32_to_fp8(NAN) == 0x7f, "saturation and NaN");
    CHECK(qf_f32_to_fp8(ldexpf(1, -11)) == 0x00 && qf_f32_to_fp8(ldexpf(3, -11)) == 0x01, "subnormal rounding");
}

/* Every weight within half a step of its block (plus the fp16 scale's rounding) after a round trip. */
static void test_round_trip(int fmt) {
    const int64_t cols = 2048;
    float *w = qt_rnd((size_t)cols, 0.05f), *back = malloc((size_t)cols * sizeof(float));
    w[5] = 0.9f, w[40] = -1.3f; /* outliers in two blocks */
    memset(w + 64, 0, 32 * sizeof(float)); /* an all-zero block */
    uint8_t *q = malloc(qf_q_row_bytes(fmt, cols));
    qf_q_quantize_row(fmt, w, cols, q);
    qf_q_dequantize_row(fmt, q, cols, back);
    int bad = 0;
    for (int64_t b = 0; b < cols / QF_Q_BLOCK; b++) {
        float lo = INFINITY, hi = -INFINITY;
        for (int i = 0; i < QF_Q_BLOCK; i++) lo = fminf(lo, w[b * 32 + i]), hi = fmaxf(hi, w[b * 32 + i]);
        float step = fmt == QF_Q_I8B32 ? fmaxf(fabsf(lo), fabsf(hi)) / 127 : (hi - lo) / 15;
        for (int i = 0; i < QF_Q_BLOCK; i++) bad += fabsf(back[b * 32 + i] - w[b * 32 + i]) > 0.502f * step + 1e-3f * step + 1e-12f;
    }
    for (int i = 64; i < 96; i++) bad += back[i] != 0;
    CHECK(bad == 0, "%s: %d weights off by more than half a step", qf_qfmt_name(fmt), bad);
    CHECK(qf_q_row_bytes(fmt, cols) == (size_t)(fmt == QF_Q_I8B32 ? 34 : 20) * 64, "row bytes");
    free(w), free(back), free(q);
}

/* The reference product against dequantise-then-multiply in double precision. */
static void test_products(int fmt, int64_t rows, int64_t cols) {
    int n = 3;
    float *w = qt_rnd((size_t)(rows * cols), 0.05f), *x = qt_rnd((size_t)(n * cols), 1.0f), *y = malloc((size_t)(n * rows) * sizeof(float));
    float *row = malloc((size_t)cols * sizeof(float)), *scales = NULL;
    size_t rb = qf_q_row_bytes(fmt, cols);
    uint8_t *q = malloc(rb * (size_t)rows);
    if (fmt == QF_Q_FP8B128) { /* scale blocks of 128 x 128 as the official checkpoint stores them */
        int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
        scales = malloc((size_t)(br * bc) * sizeof(float));
        for (int64_t i = 0; i < br * bc; i++) scales[i] = 0.0002f * (float)(1 + i % 7);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) q[r * cols + c] = qf_f32_to_fp8(w[r * cols + c] / scales[(r / 128) * bc + c / 128]);
    } else
        for (int64_t r = 0; r < rows; r++) qf_q_quantize_row(fmt, w + r * cols, cols, q + r * rb);
    CHECK(qf_q_matmul_ref(fmt, q, scales, rows, cols, x, n, y) == QF_OK, "%s", qf_last_error());
    double worst = 0, scale = 0;
    for (int64_t o = 0; o < rows; o++) {
        if (fmt == QF_Q_FP8B128) qf_fp8_dequantize_row(q, scales, o, cols, row);
        else qf_q_dequantize_row(fmt, q + o * rb, cols, row);
        for (int t = 0; t < n; t++) {
            double acc = 0;
            for (int64_t i = 0; i < cols; i++) acc += (double)row[i] * x[t * cols + i];
            worst = fmax(worst, fabs(acc - y[t * rows + o]));
            scale = fmax(scale, fabs(acc));
        }
    }
    CHECK(worst <= 1e-5 * scale, "%s %lldx%lld: product off by %.3g of %.3g", qf_qfmt_name(fmt), (long long)rows, (long long)cols, worst, scale);
    free(w), free(x), free(y), free(row), free(scales), free(q);
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    test_fp8();
    test_round_trip(QF_Q_I8B32);
    test_round_trip(QF_Q_I4B32);
    for (int f = QF_Q_I8B32; f <= QF_Q_FP8B128; f++) {
        test_products(f, 512, 2048);
        test_products(f, 2048, 512);
    }
    CHECK(qf_qfmt_parse("int4") == QF_Q_I4B32 && qf_qfmt_parse("fp8") == QF_Q_FP8B128 && qf_qfmt_parse("q4") == QF_Q_NONE, "format names");
    return qt_finish();
}
