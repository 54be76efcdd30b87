#include "model/forward_int.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/numeric.h"

/* ---- decode steps through the device's fused ops (ops.h qf_dec_ops): 6-7 launches a layer ---- */

/* Decode steps take one token (or input row: the MTP head's) a sequence, or a sequence's few tokens
 * whose every logit is wanted (a verify of drafts; model.h QF_DEC_CHAIN): the rows then chain
 * through the sequence's state. */
int fw_dec_usable(const fwd *f) {
    if (!f->be->ops->dec || !f->m->dec_ok || f->N > QF_DEC_ROWS) return 0;
    for (int s = 0; s < f->n_seqs; s++) {
        const qf_seq_step *q = &f->seqs[s];
        if (q->n > 1 && (q->inputs || q->n > QF_DEC_CHAIN || (q->logits_mode != QF_LOGITS_ALL && q->logits_mode != QF_LOGITS_PICKS))) return 0;
    }
    return 1;
}

void fw_dec_rows(fwd *f) {
    int t = 0;
    f->dec = 1, f->waves = 0;
    for (int i = 0; t < f->N; i++) {
        f->wave[f->waves++] = t;
        for (int s = 0; s < f->n_seqs; s++)
            if (f->seqs[s].n > i) f->rseq[t] = s, f->roff[t] = i, t++;
    }
    f->wave[f->waves] = t;
}

/* The row of sequence s's i-th token. */
int fw_seq_row(const fwd *f, int s, int i) {
    for (int t = f->wave[i]; t < f->wave[i + 1]; t++)
        if (f->rseq[t] == s) return t;
    return -1;
}

static qf_state *row_state(const fwd *f, int t) { return f->seqs[f->rseq[t]].st; }

/* Each row's threshold for layer L's trunk group; whether the product is to be the sparse one
 * (some row masks, and the device and the layer have what it needs; not beside chained rows, whose
 * conv epilogue must take a channel's rows in order). */
static int dec_thresholds(const fwd *f, int L, int group, float *thr) {
    int any = 0;
    if (f->waves > 1) return 0;
    for (int t = 0; t < f->N; t++) any |= (thr[t] = qf_sparsity_trunk_threshold(f->m, L, group, fw_row_level(f, t, L))) > 0.0f;
    return any && f->be->ops->dec->matmul_sparse && f->m->layers[L].in_t.data;
}

/* Attention of the step's rows, a wave at a time (each wave's keys are stored before the next
 * wave attends). 1: the output heads are gated already. */
static int dec_attend(fwd *f, qf_attn_dec *a) {
    qf_backend *be = f->be;
    const qf_dec_ops *d = OPS->dec;
    int gated = 0, vd = a->nh * a->hd;
    for (int i = 0; i < f->waves; i++) {
        int t0 = f->wave[i], n = f->wave[i + 1] - t0;
        qf_attn_dec r = *a;
        r.qkv = a->qkv + (size_t)t0 * a->stride, r.n = n, r.out = a->out + (size_t)t0 * vd;
        for (int t = 0; t < n; t++) r.kv[t] = a->kv[t0 + t], r.pos[t] = a->pos[t0 + t], r.n_keys[t] = a->n_keys[t0 + t];
        gated = d->attn_gate && d->attn_gate(be, &r);
        if (!gated) d->attention(be, &r);
    }
    return gated;
}

static void dec_full_attn(fwd *f, int L, const qf_pre *norm) {
    const qf_config *c = &f->m->cfg;
    const qf_layer_w *w = &f->m->layers[L];
    qf_backend *be = f->be;
    const qf_dec_ops *d = OPS->dec;
    int nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, stride = (int)w->in_proj.rows;
    float *big = WS(f->ws, dec), *core = WS(f->ws, core), thr[QF_DEC_ROWS];
    if (dec_thresholds(f, L, QF_ACT_MIX_IN, thr)) d->matmul_sparse(be, &w->in_t, WS(f->ws, x), f->N, norm, NULL, 0, thr, big);
    else d->matmul(be, &w->in_proj, WS(f->ws, x), f->N, norm, NULL, 0, big);
    qf_attn_dec a = {big, stride, nh * 2 * hd, nh * 2 * hd + nkv * hd, f->N, nh, nkv, hd, c->rot_dim, w->q_norm, w->k_norm, f->m->inv_freq,
                     c->norm_eps, 1.0f / sqrtf((float)hd), {{0}}, {0}, core, {0}};
    int np[QF_DEC_ROWS], budget[QF_DEC_ROWS], any = 0;
    int32_t *sel[QF_DEC_ROWS];
    for (int t = 0; t < f->N; t++) {
        qf_state *st = row_state(f, t);
        a.kv[t] = qf_state_kv_view(st, L), a.pos[t] = st->pos + f->roff[t];
        np[t] = a.pos[t] / a.kv[t].page_tokens + 1, budget[t] = fw_kv_budget(f, t, L, st), sel[t] = st->sel_dev ? st->sel_dev : st->sel;
        any |= budget[t] > 0;
        if (f->roff[t] == 0) fw_kv_count(f, &f->seqs[f->rseq[t]], any && d->page_select ? budget[t] : 0);
    }
    if (any && d->page_select) {
        d->page_select(be, &a, np, budget, sel);
        for (int t = 0; t < f->N; t++)
            if (budget[t]) a.kv[t].pages = sel[t], a.n_keys[t] = (budget[t] - 1) * a.kv[t].page_tokens + a.pos[t] % a.kv[t].page_tokens + 1;
    }
    int gated = dec_attend(f, &a); /* core is gated already */
    qf_pre gate = {QF_PRE_SIGMOID, NULL, big + hd, stride, 2 * hd, hd, 0.0f};
    if (dec_thresholds(f, L, QF_ACT_MIX_OUT, thr)) d->matmul_sparse(be, &w->out_t, core, f->N, gated ? NULL : &gate, NULL, 1, thr, WS(f->ws, x));
    else d->matmul(be, &w->wo, core, f->N, gated ? NULL : &gate, NULL, 1, WS(f->ws, x));
}

/* The DeltaNet steps of the step's rows, a wave at a time, or as one chain where the step is one
 * sequence's rows (a verify alone). 1: out is gn(out). */
static int dec_delta(fwd *f, const qf_gdn_dec *g, const qf_pre *gn) {
    qf_backend *be = f->be;
    const qf_dec_ops *d = OPS->dec;
    int chain = f->n_seqs == 1 && f->waves > 1, normed = 0;
    for (int i = 0; i < (chain ? 1 : f->waves); i++) {
        int t0 = chain ? 0 : f->wave[i], n = chain ? f->N : f->wave[i + 1] - t0;
        qf_gdn_dec r = *g;
        qf_pre rn = *gn;
        r.mixed = g->mixed + (size_t)t0 * g->stride, r.n = n, r.out = g->out + (size_t)t0 * g->nv * g->dv, r.chain = chain;
        for (int t = 0; t < n; t++) r.S[t] = g->S[t0 + t];
        rn.g = gn->g + (size_t)t0 * gn->g_stride;
        normed = d->gdn_gn && d->gdn_gn(be, &r, &rn);
        if (!normed) d->gdn(be, &r);
    }
    return normed;
}

static void dec_linear_attn(fwd *f, int L, const qf_pre *norm) {
    const qf_config *c = &f->m->cfg;
    const qf_layer_w *w = &f->m->layers[L];
    qf_backend *be = f->be;
    const qf_dec_ops *d = OPS->dec;
    int nv = c->lin_v_heads, dv = c->lin_v_dim, cd = qf_cfg_conv_dim(c), stride = (int)w->in_proj.rows;
    float *big = WS(f->ws, dec), *core = WS(f->ws, core), thr[QF_DEC_ROWS];
    qf_gdn_epi e = {cd, nv * dv, nv, c->conv_kernel, w->conv_w, w->dt_bias, w->neg_A, {0}};
    qf_gdn_dec g = {big, stride, f->N, c->lin_k_heads, nv, c->lin_k_dim, dv, {0}, core, 0};
    /* chained rows share their sequence's conv state: the product's epilogue takes a channel's rows in order */
    for (int t = 0; t < f->N; t++) e.conv_state[t] = row_state(f, t)->conv[L], g.S[t] = row_state(f, t)->ssm[L];
    if (dec_thresholds(f, L, QF_ACT_MIX_IN, thr)) d->matmul_sparse(be, &w->in_t, WS(f->ws, x), f->N, norm, &e, 0, thr, big);
    else d->matmul(be, &w->in_proj, WS(f->ws, x), f->N, norm, &e, 0, big);
    qf_pre gn = {QF_PRE_GATED_NORM, w->gnorm, big + cd, stride, dv, dv, c->norm_eps};
    int normed = dec_delta(f, &g, &gn); /* core is gn(core) already */
    if (dec_thresholds(f, L, QF_ACT_MIX_OUT, thr)) d->matmul_sparse(be, &w->out_t, core, f->N, normed ? NULL : &gn, NULL, 1, thr, WS(f->ws, x));
    else d->matmul(be, &w->w_out, core, f->N, normed ? NULL : &gn, NULL, 1, WS(f->ws, x));
}

int fw_dec_layer(fwd *f, int L) {
    const qf_model *m = f->m;
    const qf_config *c = &m->cfg;
    const qf_layer_w *w = &m->layers[L];
    qf_backend *be = f->be;
    qf_pre an = {QF_PRE_RMSNORM, w->attn_norm, NULL, 0, 0, 0, c->norm_eps}, fn = an;
    fn.w = w->ffn_norm;
    float *rl = WS(f->ws, drl);
    qf_expert_table t;
    int rc = m->experts->ops->table(m->experts, L, &t);
    if (rc != QF_OK) return rc;
    qf_moe_dec mo = {t.experts, c->n_experts, c->n_experts_used, f->N, c->hidden, c->expert_ffn, c->shared_ffn, w->ffn_norm, c->norm_eps, rl,
                     (int)w->ffn_in.rows, &w->sh_down, WS(f->ws, x), t.dev, t.chosen, t.cache, {0}, qf_sparsity_min_k(c->n_experts_used)};
    for (int r = 0; r < f->N; r++) {
        float level = fw_expert_level(f, r, L);
        mo.drop_tau[r] = level > 0.0f ? qf_sparsity_expert_tau(level, c->n_experts_used) : 0.0f;
    }
    if (w->kind == QF_LAYER_FULL) dec_full_attn(f, L, &an);
    else dec_linear_attn(f, L, &an);
    OPS->dec->matmul(be, &w->ffn_in, WS(f->ws, x), f->N, &fn, NULL, 0, rl);
    OPS->dec->moe(be, &mo);
    return QF_OK;
}

/* A DRAW row the backend cannot draw (no draw op, or its logits leave lg before the step ends):
 * its logits go to the host like a LAST row's, and *top1 = -1 says the caller samples them. Else
 * *top1 = 0 until draw_after sets it. */
void fw_draw_on_host(qf_backend *be, qf_seq_step *q, const float *row, int V) {
    qf_be_download(be, q->logits, row, (size_t)V * sizeof(float));
    if (q->logits_mode == QF_LOGITS_DRAW) q->top1[0] = -1;
}

/* The final-normed hidden states of the rows whose sequence asks for them (qf_seq_step.hidden). */
void fw_hidden_out(fwd *f, const float *x, float *xn) {
    const qf_model *m = f->m;
    qf_backend *be = f->be;
    int H = m->cfg.hidden, any = 0;
    for (int s = 0; s < f->n_seqs; s++) any |= f->seqs[s].hidden != NULL;
    if (!any) return;
    OPS->rmsnorm(be, x, H, m->final_norm, f->N, H, m->cfg.norm_eps, xn, H);
    for (int t = 0; f->dec && t < f->N; t++) { /* a decode step's rows are in waves */
        const qf_seq_step *q = &f->seqs[f->rseq[t]];
        if (q->hidden) qf_be_download(be, q->hidden + (size_t)f->roff[t] * H, xn + (size_t)t * H, (size_t)H * sizeof(float));
    }
    for (int s = 0, r0 = 0; !f->dec && s < f->n_seqs; r0 += f->seqs[s].n, s++)
        if (f->seqs[s].hidden) qf_be_download(be, f->seqs[s].hidden, xn + (size_t)r0 * H, (size_t)f->seqs[s].n * H * sizeof(float));
}

/* Final norm + lm_head over every row, then each sequence's logits (its rows') or pick (its last
 * row's), and the normed hidden states a sequence asks for. */
void fw_dec_logits(fwd *f) {
    const qf_model *m = f->m;
    qf_backend *be = f->be;
    int V = m->cfg.vocab;
    float *lg = WS(f->ws, lg);
    int32_t *amax = (int32_t *)WS(f->ws, amax);
    qf_pre fin = {QF_PRE_RMSNORM, m->final_norm, NULL, 0, 0, 0, m->cfg.norm_eps};
    int any = 0, top1 = 0;
    for (int s = 0; s < f->n_seqs; s++) {
        int mode = f->seqs[s].logits_mode;
        any |= mode != QF_LOGITS_NONE, top1 |= mode == QF_LOGITS_TOP1 || mode == QF_LOGITS_PICKS;
    }
    fw_hidden_out(f, WS(f->ws, x), WS(f->ws, xn));
    if (!any) return;
    OPS->dec->matmul(be, &m->lm_head, WS(f->ws, x), f->N, &fin, NULL, 0, lg);
    if (top1) OPS->dec->argmax(be, lg, f->N, V, amax);
    f->lg_rows = f->N;
    for (int t = 0; t < f->N; t++) {
        qf_seq_step *q = &f->seqs[f->rseq[t]];
        int i = f->roff[t];
        if (q->logits_mode == QF_LOGITS_ALL) qf_be_download(be, q->logits + (size_t)i * V, lg + (size_t)t * V, (size_t)V * sizeof(float));
        else if (q->logits_mode == QF_LOGITS_PICKS) qf_be_download(be, q->top1 + i, amax + t, sizeof(int32_t));
        else if (i < q->n - 1) continue; /* the other modes want the last row's */
        else if (q->logits_mode == QF_LOGITS_LAST || (q->logits_mode == QF_LOGITS_DRAW && !OPS->dec->draw)) fw_draw_on_host(be, q, lg + (size_t)t * V, V);
        else if (q->logits_mode == QF_LOGITS_DRAW) q->top1[0] = 0;
        else if (q->logits_mode == QF_LOGITS_TOP1) qf_be_download(be, q->top1, amax + t, sizeof(int32_t));
    }
}

/* The row of lg holding sequence s's last logits (the prompt path: *j counts the wanted sequences). */
static int lg_row(const fwd *f, int s, int *j) {
    int mode = f->seqs[s].logits_mode;
    if (f->dec) return fw_seq_row(f, s, f->seqs[s].n - 1);
    return mode == QF_LOGITS_LAST || mode == QF_LOGITS_TOP1 || mode == QF_LOGITS_DRAW ? (*j)++ : -1;
}

/* The DRAW rows after the step, where lg holds their logits (lg_row): the backend's draw, ids into
 * *top1. Not inside the step: the penalty lists are uploaded as they are, which a recorded step
 * could not repeat. */
int fw_draw_after(fwd *f) {
    qf_backend *be = f->be;
    qf_draw d[QF_DEC_ROWS];
    int n = 0, V = f->m->cfg.vocab, rows[QF_DEC_ROWS];
    for (int s = 0, j = 0; s < f->n_seqs; s++) {
        int row = lg_row(f, s, &j);
        const qf_seq_step *q = &f->seqs[s];
        if (row < 0 || row >= f->lg_rows || row >= QF_DEC_ROWS || q->logits_mode != QF_LOGITS_DRAW || q->top1[0] == -1) continue;
        for (; n < row; n++) d[n].on = 0;
        d[n] = *q->draw, d[n].on = 1, rows[n] = s, n++;
    }
    if (!n) return QF_OK;
    int32_t ids[QF_DEC_ROWS], *amax = (int32_t *)WS(f->ws, amax);
    OPS->dec->draw(be, WS(f->ws, lg), n, V, d, amax);
    qf_be_download(be, ids, amax, (size_t)n * sizeof(int32_t));
    int rc = qf_be_sync(be);
    for (int r = 0; rc == QF_OK && r < n; r++)
        if (d[r].on) f->seqs[rows[r]].top1[0] = ids[r];
    return rc;
}
