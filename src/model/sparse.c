/* Activation-aware sparsity's model state (model.h): the levels per layer, the trunk's
 * thresholds, and the transposed copies of the mixers' products that let a sparse input skip the
 * weight columns it does not use. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/dtype.h"
#include "model/model_int.h"

/* The device's memory (or the host's, with no device) of bytes at src, into dst on the host. */
static void fetch(qf_model *m, void *dst, const void *src, size_t bytes) {
    if (m->dev) qf_be_download(m->dev, dst, src, bytes);
    else memcpy(dst, src, bytes);
}

/* out = the transpose of parts stacked by rows (same dtype and columns), where the weights live. */
static int transpose_parts(qf_model *m, qf_mat *const *parts, int n, qf_mat *out) {
    int64_t R = 0, C = parts[0]->cols;
    for (int i = 0; i < n; i++) {
        if (!parts[i]->data || parts[i]->cols != C || parts[i]->dtype != parts[0]->dtype)
            return qf_fail(QF_EUNSUPPORTED, "trunk sparsity: a mixer's projections differ in type or width");
        if (!qf_dtype_size(parts[i]->dtype) || qf_is_quant(parts[i]->dtype))
            return qf_fail(QF_EUNSUPPORTED, "trunk sparsity needs a bf16, f16 or f32 trunk (this one is %s)", qf_dtype_name(parts[i]->dtype));
        R += parts[i]->rows;
    }
    size_t es = qf_dtype_size(parts[0]->dtype), bytes = (size_t)(R * C) * es;
    char *src = malloc(bytes), *dst = malloc(bytes);
    if (!src || !dst) {
        free(src), free(dst);
        return qf_fail(QF_ENOMEM, "out of memory transposing %zu bytes of weights", bytes);
    }
    for (int i = 0, r0 = 0; i < n; r0 += (int)parts[i]->rows, i++) fetch(m, src + (size_t)r0 * C * es, parts[i]->data, (size_t)(parts[i]->rows * C) * es);
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) memcpy(dst + (size_t)(c * R + r) * es, src + (size_t)(r * C + c) * es, es);
    free(src);
    *out = (qf_mat){parts[0]->dtype, dst, C, R, NULL};
    if (!m->dev) return qf_model_own(m, dst);
    void *d = qf_be_alloc(m->dev, bytes);
    if (!d || qf_model_keep_dev(m, d) != QF_OK) {
        qf_be_free(m->dev, d), free(dst);
        out->data = NULL;
        return qf_fail(QF_ENOMEM, "out of device memory for %zu bytes of transposed weights", bytes);
    }
    qf_be_upload(m->dev, d, dst, bytes);
    free(dst);
    out->data = d;
    return QF_OK;
}

static int prepare_layer(qf_model *m, int L) {
    qf_layer_w *w = &m->layers[L];
    qf_mat *full[] = {&w->wq, &w->wk, &w->wv}, *lin[] = {&w->w_qkv, &w->w_z, &w->w_b, &w->w_a}, *fused[] = {&w->in_proj};
    int is_full = w->kind == QF_LAYER_FULL;
    qf_mat *const *parts = w->in_proj.data ? fused : is_full ? full : lin;
    int rc = transpose_parts(m, parts, w->in_proj.data ? 1 : is_full ? 3 : 4, &w->in_t);
    qf_mat *o[] = {is_full ? &w->wo : &w->w_out};
    return rc == QF_OK ? transpose_parts(m, o, 1, &w->out_t) : rc;
}

/* On a device the decode steps carry sparsity (the prompt path runs dense), so its fused ops must
 * take the rule: a device without them refuses a level above 0. */
static int device_takes_sparsity(const qf_model *m) {
    return !m->dev || (m->dec_ok && m->dev->ops->dec && m->dev->ops->dec->matmul_sparse);
}

int qf_model_set_sparsity(qf_model *m, const float *levels) {
    int any = 0, rc = QF_OK;
    for (int L = 0; levels && L < m->cfg.n_layers; L++) {
        if (!(levels[L] >= 0.0f && levels[L] <= 1.0f)) return qf_fail(QF_EINVAL, "sparsity level %g of layer %d is outside 0..1", levels[L], L + 1);
        any |= levels[L] > 0.0f;
    }
    if (any && !device_takes_sparsity(m)) return qf_fail(QF_EUNSUPPORTED, "sparsity levels above 0 need the device's fused decode ops, which this model does not run");
    for (int L = 0; any && L < m->cfg.n_layers && rc == QF_OK; L++)
        if (!m->layers[L].in_t.data && m->cfg.arch == QF_ARCH_QWEN35_MOE) rc = prepare_layer(m, L);
    if (rc != QF_OK) return rc;
    for (int L = 0; L < m->cfg.n_layers; L++) m->sparsity[L] = levels ? levels[L] : 0.0f;
    m->sparse = any;
    m->sparsity_gen++;
    return QF_OK;
}

int qf_model_sparsity_ready(const qf_model *m) {
    return !m->dev || (device_takes_sparsity(m) && (m->cfg.arch != QF_ARCH_QWEN35_MOE || m->layers[0].in_t.data));
}

size_t qf_model_sparsity_bytes(const qf_model *m) {
    size_t bytes = 0;
    for (int L = 0; m->cfg.arch == QF_ARCH_QWEN35_MOE && L < m->cfg.n_layers; L++) {
        const qf_layer_w *w = &m->layers[L];
        const qf_mat *in[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w_qkv, &w->w_z, &w->w_b, &w->w_a, &w->w_out};
        for (int i = w->kind == QF_LAYER_FULL ? 0 : 4; i < (w->kind == QF_LAYER_FULL ? 4 : 9); i++)
            bytes += qf_mat_bytes(in[i]);
    }
    return bytes;
}

int qf_model_set_trunk_thresholds(qf_model *m, const float *thr) {
    size_t n = (size_t)m->cfg.n_layers * QF_ACT_GROUPS * QF_TRUNK_GRID;
    for (size_t i = 0; thr && i < n; i++)
        if (!(thr[i] >= 0.0f) || (i % QF_TRUNK_GRID && thr[i] < thr[i - 1]))
            return qf_fail(QF_EINVAL, "trunk threshold %zu is negative or below the one before", i);
    free(m->trunk_thr);
    m->trunk_thr = NULL;
    m->sparsity_gen++;
    if (!thr) return QF_OK;
    if (!(m->trunk_thr = malloc(n * sizeof(float)))) return qf_fail(QF_ENOMEM, "out of memory");
    memcpy(m->trunk_thr, thr, n * sizeof(float));
    return QF_OK;
}

void qf_model_sparse_off(qf_model *m, int parts) {
    m->sparse_off = parts;
    m->sparsity_gen++;
}

int qf_sparsity_kv_pages(const qf_model *m, float level, int ctx, int page_tokens) {
    int min_ctx = m->kv_min_ctx > 0 ? m->kv_min_ctx : QF_KV_MIN_CTX;
    if (level <= 0.0f || (m->sparse_off & QF_SPARSE_KV) || ctx < min_ctx) return 0;
    int pages = (ctx + page_tokens - 1) / page_tokens, least = (QF_KV_MIN_BUDGET + page_tokens - 1) / page_tokens;
    int budget = (int)ceil((double)pages * (1.0 - (double)level));
    budget = budget < least ? least : budget < 2 ? 2 : budget;
    return budget < pages ? budget : 0;
}

float qf_sparsity_trunk_threshold(const qf_model *m, int L, int group, float level) {
    if (!m->trunk_thr || level <= 0.0f || (m->sparse_off & QF_SPARSE_TRUNK)) return 0.0f;
    const float *grid = m->trunk_thr[L][group];
    float pos = qf_sparsity_trunk_target(level) * 10.0f;
    if (pos >= QF_TRUNK_GRID) return grid[QF_TRUNK_GRID - 1];
    int i = (int)pos;
    float lo = i ? grid[i - 1] : 0.0f, hi = grid[i];
    return lo + (hi - lo) * (pos - (float)i);
}
