/* Running the MTP head (docs/model-spec.md §8.2): the pair (x[t+1], h[t]) at the head's position t becomes
 * u = fc([rmsnorm(embed(x[t+1])) * norm_e | rmsnorm(h[t]) * norm_h]), which runs through the
 * head's decoder layer (m->mtp, a one-layer view of the model) with its own KV cache; the view's
 * final norm (mtp.norm) gives the head's output, and lm_head its logits for x[t+2]. */
#include <stdlib.h>

#include "base/dtype.h"
#include "base/quant.h"
#include "model/model_int.h"
#include "model/workspace.h"

struct qf_mtp_run {
    qf_workspace *ws; /* the view's */
    qf_state *st;     /* the head's KV cache */
    qf_backend *dev;  /* where the head runs (NULL: the host) */
    float *e, *cat, *u, *h; /* the backend's memory; h: the pairs' hidden states, from the host */
    int rows;
};

qf_mtp_run *qf_mtp_run_create(const qf_model *m, int max_rows, int max_ctx) {
    if (!m->mtp || max_rows < 1) return NULL;
    qf_mtp_run *r = calloc(1, sizeof *r);
    size_t H = (size_t)m->cfg.hidden, R = (size_t)max_rows;
    if (!r) return NULL;
    r->rows = max_rows, r->dev = m->mtp->dev;
    r->ws = qf_workspace_create(m->mtp, max_rows);
    r->st = qf_state_create(m->mtp, max_ctx);
    r->e = qf_be_alloc(r->dev, R * H * sizeof(float)), r->cat = qf_be_alloc(r->dev, 2 * R * H * sizeof(float));
    r->u = qf_be_alloc(r->dev, R * H * sizeof(float)), r->h = r->dev ? qf_be_alloc(r->dev, R * H * sizeof(float)) : NULL;
    if (!r->ws || !r->st || !r->e || !r->cat || !r->u || (r->dev && !r->h)) {
        qf_mtp_run_free(r);
        return NULL;
    }
    return r;
}

void qf_mtp_run_free(qf_mtp_run *r) {
    if (!r) return;
    qf_workspace_free(r->ws);
    qf_state_free(r->st);
    qf_be_free(r->dev, r->e), qf_be_free(r->dev, r->cat), qf_be_free(r->dev, r->u), qf_be_free(r->dev, r->h);
    free(r);
}

void qf_mtp_run_reset(qf_mtp_run *r) { qf_state_reset(r->st); }
int qf_mtp_pos(const qf_mtp_run *r) { return r->st->pos; }

/* One full-attention layer and no recurrent state: going back is forgetting the later keys (their
 * pages stay held, written over as the head goes on). */
void qf_mtp_truncate(qf_mtp_run *r, int pos) {
    if (pos >= 0 && pos < r->st->pos) r->st->pos = pos;
}
qf_state *qf_mtp_state(qf_mtp_run *r) { return r->st; }

int qf_mtp_step(const qf_model *m, qf_backend *be, qf_mtp_run *r, const int32_t *next, const float *h, int n, int logits_mode, float *logits,
                int32_t *top1, float *hidden_out) {
    const qf_config *c = &m->cfg;
    int H = c->hidden, V = c->vocab;
    if (n < 1 || n > r->rows) return qf_fail(QF_EINVAL, "MTP step of %d pairs (1..%d)", n, r->rows);
    for (int i = 0; i < n; i++)
        if (next[i] < 0 || next[i] >= V) return qf_fail(QF_EINVAL, "token id %d is outside the vocabulary (0..%d)", next[i], V - 1);
    if (r->dev) qf_be_upload(be, r->h, h, (size_t)n * H * sizeof(float)), h = r->h; /* the forward gave them to the host */
    be->ops->embed(be, &m->embed, next, n, r->e);
    be->ops->rmsnorm(be, r->e, H, m->mtp_norm_e, n, H, c->norm_eps, r->cat, 2 * H);
    be->ops->rmsnorm(be, h, H, m->mtp_norm_h, n, H, c->norm_eps, r->cat + H, 2 * H);
    be->ops->matmul(be, &m->mtp_fc, r->cat, n, r->u);
    qf_seq_step s = {r->st, next, n, logits_mode, logits, top1, 0, 0, r->u, hidden_out, NULL};
    return qf_forward(m->mtp, be, r->ws, &s, 1);
}

int qf_mtp_lm_head_int8(qf_model *m) {
    const qf_mat *w = &m->lm_head;
    if (!m->mtp || w->cols % QF_Q_BLOCK || (w->dtype != QF_DT_BF16 && w->dtype != QF_DT_F16 && w->dtype != QF_DT_F32)) return QF_OK;
    int64_t R = w->rows, C = w->cols, chunk = 4096;
    size_t rb = qf_q_row_bytes(QF_Q_I8B32, C), es = qf_dtype_size(w->dtype);
    uint8_t *q = malloc((size_t)R * rb);
    float *row = malloc((size_t)C * sizeof *row);
    unsigned char *src = m->dev ? malloc((size_t)chunk * C * es) : NULL;
    int rc = q && row && (!m->dev || src) ? QF_OK : qf_fail(QF_ENOMEM, "out of memory for the drafts' int8 lm_head");
    for (int64_t r0 = 0; rc == QF_OK && r0 < R; r0 += chunk) { /* a device's rows come down a chunk at a time */
        int64_t n = R - r0 < chunk ? R - r0 : chunk;
        const unsigned char *rows = (const unsigned char *)w->data + (size_t)r0 * C * es;
        if (m->dev) qf_be_download(m->dev, src, rows, (size_t)n * C * es), rows = src;
        for (int64_t r = 0; r < n; r++) {
            qf_float_row(w->dtype, rows + (size_t)r * C * es, C, row);
            qf_q_quantize_row(QF_Q_I8B32, row, C, q + (size_t)(r0 + r) * rb);
        }
    }
    free(row), free(src);
    void *at = q;
    if (rc == QF_OK && m->dev) {
        at = qf_be_alloc(m->dev, (size_t)R * rb);
        rc = at ? qf_model_keep_dev(m, at) : qf_fail(QF_ENOMEM, "out of device memory for the drafts' int8 lm_head (%zu MB)", (size_t)R * rb >> 20);
        if (rc == QF_OK) qf_be_upload(m->dev, at, q, (size_t)R * rb), rc = qf_be_sync(m->dev);
        else qf_be_free(m->dev, at);
        free(q);
    } else if (rc == QF_OK) rc = qf_model_own(m, q);
    else free(q);
    if (rc != QF_OK) return rc;
    m->mtp->lm_head = (qf_mat){QF_Q_I8B32, at, R, C, NULL};
    if (m->dev) qf_model_dec_check(m->mtp);
    return QF_OK;
}
