/* The forward workspace: one float block carved into named regions, sized once for its rows. */
#include <stdlib.h>
#include <string.h>

#include "model/model_int.h"
#include "model/workspace.h"

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
    w->max_rows = R, w->hidden = H, w->top_k = K, w->n_experts = E;
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
    w->f_bytes = total * sizeof(float);
    w->f = qf_be_alloc(m->dev, w->f_bytes);
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
    size_t rows = (size_t)tokens * (size_t)w->hidden, picks = (size_t)tokens * (size_t)w->top_k;
    w->px = qf_be_alloc(w->dev, rows * sizeof(float));
    if (!w->px) return qf_fail(QF_ENOMEM, "out of memory for a prompt buffer of %d tokens", tokens);
    w->px_tokens = tokens;
    if (w->dev) return QF_OK;
    w->pxn = malloc(rows * sizeof(float)), w->pmo = malloc(rows * sizeof(float));
    w->ptopw = malloc(picks * sizeof(float)), w->pasw = malloc(picks * sizeof(float));
    w->ptopi = malloc(picks * sizeof(int)), w->pasr = malloc(picks * sizeof(int)), w->pcounts = malloc(((size_t)w->n_experts + 1) * sizeof(int));
    if (!w->pxn || !w->pmo || !w->ptopw || !w->pasw || !w->ptopi || !w->pasr || !w->pcounts) return qf_fail(QF_ENOMEM, "out of memory for a prompt buffer of %d tokens", tokens);
    return QF_OK;
}

void qf_workspace_free(qf_workspace *w) {
    if (!w) return;
    qf_be_free(w->dev, w->px);
    free(w->pxn), free(w->pmo), free(w->ptopw), free(w->pasw), free(w->ptopi), free(w->pasr), free(w->pcounts);
    qf_be_free(w->dev, w->f);
    free(w->ints);
    free(w->act_host);
    free(w);
}

int qf_workspace_rows(const qf_workspace *ws) { return ws->max_rows; }

size_t qf_workspace_bytes(const qf_workspace *ws) { return ws->f_bytes + (size_t)ws->px_tokens * (size_t)ws->hidden * sizeof(float); }

static void widest(qf_scratch_shape *s, const qf_mat *w) {
    if (!w->data) return;
    s->mat_cols = w->cols > s->mat_cols ? w->cols : s->mat_cols;
    s->mat_rows = w->rows > s->mat_rows ? w->rows : s->mat_rows;
}

/* A layer's products (the fused ones and their parts alike) and sparsity's outputs: in_proj's and
 * the mixer's out projection's rows. */
static void layer_shape(qf_scratch_shape *s, const qf_layer_w *w, int sparse) {
    const qf_mat *mats[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w_qkv, &w->w_z, &w->w_b, &w->w_a, &w->w_out, &w->router,
                            &w->sh_gate, &w->sh_up, &w->sh_down, &w->sh_gate_w, &w->gate, &w->up, &w->down, &w->in_proj, &w->ffn_in};
    for (size_t i = 0; i < sizeof mats / sizeof *mats; i++) widest(s, mats[i]);
    if (!sparse) return;
    int64_t in = w->in_proj.data ? w->in_proj.rows : w->kind == QF_LAYER_FULL ? w->wq.rows + w->wk.rows + w->wv.rows
                                                                                : w->w_qkv.rows + w->w_z.rows + w->w_b.rows + w->w_a.rows;
    int64_t out = w->kind == QF_LAYER_FULL ? w->wo.rows : w->w_out.rows;
    s->sparse_out = in > s->sparse_out ? in : s->sparse_out;
    s->sparse_out = out > s->sparse_out ? out : s->sparse_out;
}

void qf_model_scratch_shape(const qf_model *m, const qf_workspace *ws, int sparse, qf_scratch_shape *s) {
    const qf_config *c = &m->cfg;
    *s = (qf_scratch_shape){.rows = ws->max_rows, .tokens = ws->px_tokens > ws->max_rows ? ws->px_tokens : ws->max_rows, .hidden = c->hidden,
                            .expert_ffn = c->expert_ffn, .n_experts = c->n_experts, .top_k = c->n_experts_used, .n_heads = c->n_heads,
                            .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim, .gdn_heads = c->lin_v_heads, .gdn_dk = c->lin_k_dim, .gdn_dv = c->lin_v_dim};
    widest(s, &m->lm_head);
    widest(s, &m->mtp_fc);
    for (int L = 0; L < c->n_layers; L++) layer_shape(s, &m->layers[L], sparse);
    if (m->mtp) layer_shape(s, &m->mtp->layers[0], 0);
}

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
