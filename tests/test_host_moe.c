/* The host half of hybrid expert execution (experts/host_moe.h) against the CPU path's arithmetic:
 * each row's host choices, in ascending expert order, each the swiglu MLP of whole matrices one
 * row at a time (the CPU ops table model/forward.c uses), must give the same bits, for every
 * expert format, at the release's shapes and the bundled model's, with and without threads. */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include "base/pool.h"
#include "base/quant.h"
#include "experts/host_moe.h"
#include "test_util.h"

/* A random [rows][cols] weight in fmt (QF_DT_BF16 or a quantised format), owning its bytes. */
static qf_mat rnd_mat(int fmt, int64_t rows, int64_t cols) {
    qf_mat m = {fmt, NULL, rows, cols, NULL};
    float *row = qt_rnd((size_t)cols, 0.05f);
    if (fmt == QF_DT_BF16) {
        uint16_t *d = malloc((size_t)(rows * cols) * 2);
        for (int64_t i = 0; i < rows * cols; i++) {
            float v = 0.05f * qt_frand();
            uint32_t b;
            memcpy(&b, &v, 4);
            d[i] = (uint16_t)(b >> 16);
        }
        m.data = d;
    } else if (fmt == QF_Q_FP8B128) {
        uint8_t *d = malloc((size_t)(rows * cols));
        int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
        float *s = malloc((size_t)(br * bc) * 4);
        for (int64_t i = 0; i < rows * cols; i++) d[i] = qf_f32_to_fp8(300.0f * qt_frand());
        for (int64_t i = 0; i < br * bc; i++) s[i] = 1e-4f * (1.5f + qt_frand());
        m.data = d, m.scales = s;
    } else {
        size_t rb = qf_q_row_bytes(fmt, cols);
        char *d = malloc((size_t)rows * rb);
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t c = 0; c < cols; c++) row[c] = 0.05f * qt_frand();
            qf_q_quantize_row(fmt, row, cols, d + (size_t)r * rb);
        }
        m.data = d;
    }
    free(row);
    return m;
}

static void free_mat(qf_mat *m) { free((void *)m->data), free((void *)m->scales); }

/* y[H] = w * down(silu(gate x) * up x) added to acc, as the CPU path runs one expert on one row. */
static void ref_expert(const qf_backend *be, const qf_expert *x, const float *xn, float w, int H, int I, float *acc) {
    float *g = malloc((size_t)I * 4), *u = malloc((size_t)I * 4), *h = malloc((size_t)I * 4), *y = malloc((size_t)H * 4);
    qf_backend *b = (qf_backend *)be;
    be->ops->matmul(b, &x->gate, xn, 1, g);
    be->ops->matmul(b, &x->up, xn, 1, u);
    be->ops->swiglu(b, g, u, I, 1, I, h);
    be->ops->matmul(b, &x->down, h, 1, y);
    be->ops->axpy(b, acc, y, w, H);
    free(g), free(u), free(h), free(y);
}

/* n rows of K choices among E experts of fmt (some choices the device's: -1), through the host
 * module with pool against ref_expert row by row. */
static void check_job(int fmt, int H, int I, int E, int K, int n, qf_pool *pool) {
    qf_expert *ex = calloc((size_t)E, sizeof *ex);
    for (int e = 0; e < E; e++) ex[e].gate = rnd_mat(fmt, I, H), ex[e].up = rnd_mat(fmt, I, H), ex[e].down = rnd_mat(fmt, H, I);
    float *xn = qt_rnd((size_t)n * H, 1.0f), *w = malloc((size_t)n * K * 4), *y = malloc((size_t)n * H * 4), *ref = calloc((size_t)n * H, 4);
    int32_t *ids = malloc((size_t)n * K * 4);
    for (int r = 0; r < n; r++)
        for (int k = 0; k < K; k++) { /* distinct experts a row; about a third left to the device */
            ids[r * K + k] = (r * 7 + k * 3 + (k > 0 ? 1 : 0)) % E;
            for (int j = 0; j < k; j++)
                if (ids[r * K + j] == ids[r * K + k]) ids[r * K + k] = (ids[r * K + k] + 1) % E, j = -1;
            w[r * K + k] = 0.3f + 0.1f * qt_frand();
        }
    for (int i = 0; i < n * K; i++)
        if ((i * 5) % 3 == 1) ids[i] = -1;
    qf_backend cpu = {qf_cpu_ops_best(), NULL, NULL};
    for (int r = 0; r < n; r++)
        for (int e = 0; e < E; e++)
            for (int k = 0; k < K; k++)
                if (ids[r * K + k] == e) ref_expert(&cpu, &ex[e], xn + (size_t)r * H, w[r * K + k], H, I, ref + (size_t)r * H);
    qf_host_moe *h;
    CHECK(qf_host_moe_create(&h, pool, H, I, K, n) == QF_OK, "%s", qf_last_error());
    memset(y, 0xff, (size_t)n * H * 4); /* NaN where nothing is written */
    qf_host_moe_job j = {ex, E, n, K, xn, ids, w, y};
    CHECK(qf_host_moe_run(h, &j) == QF_OK, "%s", qf_last_error());
    double d = qt_max_abs_diff(y, ref, (int64_t)n * H);
    CHECK(d == 0.0, "host experts, %s %dx%d, %d rows of top-%d, %d threads: %.3g from the CPU path", fmt == QF_DT_BF16 ? "bf16" : qf_qfmt_name(fmt), I, H,
          n, K, pool ? qf_pool_size(pool) : 1, d);
    ids[0] = E, y[0] = 7.0f; /* an id past the experts, then a row count past the bound: refused, y untouched */
    CHECK(qf_host_moe_run(h, &j) == QF_EINVAL && y[0] == 7.0f && strstr(qf_last_error(), "out of range"), "bad id: %s", qf_last_error());
    j.n = n + 1;
    CHECK(qf_host_moe_run(h, &j) == QF_EINVAL && strstr(qf_last_error(), "rows"), "too many rows: %s", qf_last_error());
    qf_host_moe_free(h);
    for (int e = 0; e < E; e++) free_mat(&ex[e].gate), free_mat(&ex[e].up), free_mat(&ex[e].down);
    free(ex), free(xn), free(w), free(y), free(ref), free(ids);
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    qf_pool *pool = qf_pool_create(4);
    int fmts[4] = {QF_DT_BF16, QF_Q_I8B32, QF_Q_I4B32, QF_Q_FP8B128};
    for (int f = 0; f < 4; f++) {
        check_job(fmts[f], 2048, 512, 9, 8, 1, pool); /* Qwen3.6-35B-A3B's experts: a decode row */
        check_job(fmts[f], 2048, 512, 12, 8, 5, f == 0 ? NULL : pool);
    }
    check_job(QF_DT_BF16, 192, 32, 64, 4, 64, pool); /* the bundled model's, a full decode step */
    check_job(QF_DT_BF16, 192, 32, 64, 4, 3, NULL);
    qf_pool_set_spin(pool, 2000); /* as the hybrid's pool: jobs inside the spin, and after it ran out */
    for (int i = 0; i < 3; i++) {
        check_job(QF_DT_BF16, 2048, 512, 9, 8, 1, pool);
        usleep(i == 1 ? 5000 : 200);
    }
    qf_pool_destroy(pool);
    return qt_finish();
}
