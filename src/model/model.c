/* Model load/free, per-sequence state and the forward workspace. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_int.h"
#include "model/workspace.h"

int qf_model_check_limits(const qf_config *c) {
    if (c->lin_k_dim > 512 || c->lin_v_dim > 512 || c->conv_kernel > 16 || c->conv_kernel < 2)
        return qf_fail(QF_EUNSUPPORTED, "linear-attention head dims %d/%d or conv kernel %d beyond what qflash supports (512, 2..16)",
                       c->lin_k_dim, c->lin_v_dim, c->conv_kernel);
    return QF_OK;
}

int qf_model_finish(qf_model *m) {
    int half = m->cfg.rot_dim / 2;
    m->inv_freq = malloc((size_t)(half > 0 ? half : 1) * sizeof *m->inv_freq);
    int rc = qf_model_own(m, m->inv_freq);
    /* fp32 as in HF: base ** (2i / rot), then its reciprocal */
    for (int i = 0; rc == QF_OK && i < half; i++)
        m->inv_freq[i] = 1.0f / powf((float)m->cfg.rope_theta, (float)(2 * i) / (float)m->cfg.rot_dim);
    if (m->mtp) m->mtp->embed = m->embed, m->mtp->lm_head = m->lm_head, m->mtp->inv_freq = m->inv_freq;
    return rc;
}

int qf_model_load(qf_model **out, const char *dir, const qf_load_opts *opts) {
    *out = NULL;
    qf_model *m = calloc(1, sizeof *m);
    if (!m) return qf_fail(QF_ENOMEM, "out of memory");
    int rc = qf_config_load(&m->cfg, dir);
    if (rc == QF_OK) rc = qf_model_check_limits(&m->cfg);
    if (rc == QF_OK) rc = qf_st_open_dir(&m->st, dir, opts ? opts->diag : NULL);
    if (rc == QF_OK) rc = qf_model_bind(m, opts, NULL);
    if (rc == QF_OK) rc = qf_model_finish(m);
    if (rc != QF_OK) {
        qf_model_free(m); /* cleanup never touches the error message */
        return rc;
    }
    *out = m;
    return QF_OK;
}

void qf_model_free(qf_model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_dev_bufs; i++) qf_be_free(m->dev, m->dev_bufs[i]);
    free(m->dev_bufs);
    qf_es_destroy(m->experts);
    if (m->mtp) qf_es_destroy(m->mtp->experts), free(m->mtp); /* the rest of the view is m's */
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->trunk_thr);
    qf_st_close(&m->st);
    free(m);
}

/* ---- workspace ---- */

static int imax(int a, int b) { return a > b ? a : b; }

qf_workspace *qf_workspace_create(const qf_model *m, int max_rows) {
    const qf_config *c = &m->cfg;
    if (max_rows < 1) return NULL;
    qf_workspace *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    int H = c->hidden, R = max_rows, cd = qf_cfg_conv_dim(c), vd = c->lin_v_heads * c->lin_v_dim;
    int qd = c->n_heads * 2 * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    int F = imax(imax(c->expert_ffn, c->shared_ffn), c->dense_ffn);
    int K = c->n_experts_used > 0 ? c->n_experts_used : 1, E = c->n_experts > 0 ? c->n_experts : 1;
    w->max_rows = R, w->hidden = H;
    w->max_logit_rows = R < 64 ? R : 64;
    size_t total = 0;
    /* regions start on 256-byte boundaries: device kernels load activations 16 bytes at a time */
#define CARVE(field, n) (total = (total + 63) & ~(size_t)63, w->field##_off = total, total += (size_t)(n))
    CARVE(x, R * H);
    CARVE(xn, R * H);
    CARVE(tmp, R * H);
    /* big and rl also hold a one-row step's fused products (see qf_layer_w.in_proj / ffn_in) */
    CARVE(big, imax(R * imax(cd, qd), imax(cd + vd + 2 * c->lin_v_heads, qd + 2 * kvd)));
    CARVE(conv, R * cd);
    CARVE(kb, R * kvd);
    CARVE(vb, R * kvd);
    CARVE(z, R * vd);
    CARVE(bb, R * c->lin_v_heads);
    CARVE(aa, R * c->lin_v_heads);
    CARVE(core, R * imax(vd, c->n_heads * c->head_dim));
    CARVE(rl, imax(R * E, E + 2 * c->shared_ffn + 1));
    CARVE(topw, R * K);
    CARVE(asw, R * K);
    CARVE(ex_in, R * H);
    CARVE(ex_g, R * F);
    CARVE(ex_u, R * F);
    CARVE(ex_h, R * F);
    CARVE(ex_out, R * H);
    CARVE(moe, R * H);
    CARVE(shs, R);
    CARVE(att, (size_t)ATT_SCRATCH_ROWS * 16 * (size_t)(c->head_dim + 2)); /* decode attention split over keys */
    CARVE(lrows, w->max_logit_rows * H);
    CARVE(lg, (size_t)w->max_logit_rows * (size_t)c->vocab);
    int D = R < QF_DEC_ROWS ? R : QF_DEC_ROWS;
    CARVE(dec, D * imax(cd + vd + 2 * c->lin_v_heads, qd + 2 * kvd));
    CARVE(drl, D * (E + 2 * c->shared_ffn + 1));
    CARVE(amax, w->max_logit_rows);
#undef CARVE
    w->dev = m->dev;
    w->act_floats = (size_t)R * (size_t)imax(imax(H, vd), imax(c->n_heads * c->head_dim, F));
    w->f = qf_be_alloc(m->dev, total * sizeof(float));
    w->ints = malloc(((size_t)R * K * 2 + (size_t)E + 1 + (size_t)R) * sizeof(int));
    if (!w->f || !w->ints) {
        qf_workspace_free(w);
        return NULL;
    }
    w->topi = w->ints;
    w->asr = w->topi + R * K;
    w->counts = w->asr + R * K;
    w->lrow_src = w->counts + E + 1;
    return w;
}

int qf_workspace_reserve_prompt(qf_workspace *w, int tokens) {
    if (w->px) return qf_fail(QF_EINVAL, "the workspace has its prompt buffer already");
    if (tokens <= w->max_rows) return QF_OK;
    w->px = qf_be_alloc(w->dev, (size_t)tokens * (size_t)w->hidden * sizeof(float));
    if (!w->px) return qf_fail(QF_ENOMEM, "out of memory for a prompt buffer of %d tokens", tokens);
    w->px_tokens = tokens;
    return QF_OK;
}

void qf_workspace_free(qf_workspace *w) {
    if (!w) return;
    qf_be_free(w->dev, w->px);
    qf_be_free(w->dev, w->f);
    free(w->ints);
    free(w->act_host);
    free(w);
}

int qf_workspace_rows(const qf_workspace *ws) { return ws->max_rows; }

void qf_workspace_set_hook(qf_workspace *ws, qf_hidden_hook fn, void *ud) {
    ws->hook = fn;
    ws->hook_ud = ud;
}

qf_sparsity_counts qf_workspace_sparsity(const qf_workspace *ws) { return ws->sparsity; }

int qf_workspace_set_act_hook(qf_workspace *ws, qf_act_hook fn, void *ud) {
    ws->act_hook = fn;
    ws->act_ud = ud;
    if (fn && ws->dev && !ws->act_host && !(ws->act_host = malloc(ws->act_floats * sizeof(float))))
        return ws->act_hook = NULL, qf_fail(QF_ENOMEM, "out of memory for the calibration hook's copy");
    return QF_OK;
}

void qf_workspace_set_ep(qf_workspace *ws, qf_ep *ep) { ws->ep = ep; }

void qf_workspace_set_route_hook(qf_workspace *ws, qf_route_hook fn, void *ud) {
    ws->route_hook = fn;
    ws->route_ud = ud;
}
