/* The batched forward pass (docs/model-spec.md §4-§7): every projection runs once over the rows of
 * all sequences in the batch; convolution, the delta rule, RoPE and attention run per sequence
 * on its own state. All compute goes through the backend ops table. */
#include "model/forward_int.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/numeric.h"
#include "backend/rules.h"

/* ---- sparsity (model.h): levels per row, the trunk's masks on the host path ---- */

/* Row r's sparsity level in layer L: 0 in a prompt (a sequence of more than one row), else its
 * sequence's when the step sets one, else the model's. */
float fw_row_level(const fwd *f, int r, int L) {
    if (f->dec) {
        const qf_seq_step *q = &f->seqs[f->rseq[r]];
        return q->n > 1 ? 0.0f : q->sparsity_set ? q->sparsity : f->m->sparsity[L];
    }
    for (int s = 0, r0 = 0; s < f->n_seqs; r0 += f->seqs[s].n, s++)
        if (r < r0 + f->seqs[s].n) return f->seqs[s].n > 1 ? 0.0f : f->seqs[s].sparsity_set ? f->seqs[s].sparsity : f->m->sparsity[L];
    return 0.0f;
}

/* The calibration hook sees x dense; then the mixer's groups lose their entries under the row's
 * threshold, in place. Returns whether any row was masked (its product may then read only the
 * kept columns). Host path only: a device's x is not host memory, and its decode steps mask in
 * their fused products. */
static int trunk_group(fwd *f, int L, int group, float *x, int rows, int dim) {
    if (f->m->dev) { /* the hook reads a host copy (calibration: a prompt's eager steps) */
        if (f->ws->act_hook && (size_t)rows * (size_t)dim <= f->ws->act_floats) {
            qf_be_download(f->be, f->ws->act_host, x, (size_t)rows * (size_t)dim * sizeof(float));
            f->ws->act_hook(f->ws->act_ud, L, group, f->ws->act_host, rows, dim);
        }
        return 0;
    }
    if (f->ws->act_hook) f->ws->act_hook(f->ws->act_ud, L, group, x, rows, dim);
    if (group != QF_ACT_MIX_IN && group != QF_ACT_MIX_OUT) return 0;
    f->ws->sparsity.trunk += (uint64_t)rows * dim;
    int masked = 0;
    for (int r = 0; r < rows; r++) {
        float thr = qf_sparsity_trunk_threshold(f->m, L, group, fw_row_level(f, r, L)), *xr = x + (size_t)r * dim;
        if (thr <= 0.0f) continue;
        masked = 1;
        for (int i = 0; i < dim; i++)
            if (fabsf(xr[i]) < thr) xr[i] = 0.0f, f->ws->sparsity.trunk_zeroed++;
    }
    return masked;
}

/* Row r's level for the experts' rule (0 when that level is kept off). */
float fw_expert_level(const fwd *f, int r, int L) { return f->m->sparse_off & QF_SPARSE_EXPERTS ? 0.0f : fw_row_level(f, r, L); }

/* ---- sparsity's KV level: pages summarised, chosen, attended through a view of them ---- */

/* The pages row r (one new token of st) attends to in layer L, 0: every key. */
int fw_kv_budget(const fwd *f, int r, int L, const qf_state *st) {
    return qf_sparsity_kv_pages(f->m, fw_row_level(f, r, L), st->pos + 1, qf_kv_pool_page_tokens(st->kv));
}

/* Before a step's layers: a one-token sequence whose full layers will choose pages has the key
 * summaries of every full page before its own (a device's step launches the op even for none,
 * so a recorded step keeps its shape). */
static void kv_prepare(fwd *f) {
    const qf_config *c = &f->m->cfg;
    for (int s = 0, r0 = 0; s < f->n_seqs; r0 += f->seqs[s].n, s++) {
        qf_state *st = f->seqs[s].st;
        int on = 0, full = st->pos / qf_kv_pool_page_tokens(st->kv);
        int row = f->dec ? s : r0; /* a decode step's first wave holds every sequence's first row, in order */
        for (int L = 0; L < c->n_layers && f->seqs[s].n == 1 && !on; L++) on = c->layer_kind[L] == QF_LAYER_FULL && fw_kv_budget(f, row, L, st) > 0;
        if (!on || (!f->m->dev && full <= st->kv_summarized)) continue;
        for (int L = 0; L < c->n_layers; L++) {
            if (c->layer_kind[L] != QF_LAYER_FULL) continue;
            qf_kv_view kv = qf_state_kv_view(st, L);
            f->be->ops->kv_summarize(f->be, &kv, st->kv_summarized < full ? st->kv_summarized : full, full, c->n_kv_heads, c->head_dim);
        }
        st->kv_summarized = full;
    }
}

/* A generated token's pages in a full layer, and those its choice of budget (0: all) skips. */
void fw_kv_count(fwd *f, const qf_seq_step *q, int budget) {
    if (q->n != 1) return;
    int np = q->st->pos / qf_kv_pool_page_tokens(q->st->kv) + 1;
    f->ws->sparsity.kv_pages += (uint64_t)np, f->ws->sparsity.kv_skipped += budget ? (uint64_t)(np - budget) : 0;
}

/* On the host path: the budget pages of st a token's query heads q (stride 2 hd) choose in layer
 * L, as a view of them (st->sel its page table); *last gets the new token's place in it. */
static qf_kv_view kv_choose(fwd *f, int L, qf_state *st, const float *q, int budget, int *last) {
    const qf_config *c = &f->m->cfg;
    qf_kv_view kv = qf_state_kv_view(st, L);
    int PT = kv.page_tokens, np = st->pos / PT + 1, nkv = c->n_kv_heads, hd = c->head_dim;
    for (int p = 0; p < np - 1; p++) {
        const float *sum = kv.base + (size_t)st->pages[p] * kv.page_stride + kv.s_off;
        st->score[p] = qf_ref_page_score(q, c->n_heads, 2 * hd, nkv, sum, sum + (size_t)nkv * hd, hd);
    }
    st->score[np - 1] = 0.0f; /* always chosen */
    int n = qf_ref_page_select(st->score, np, budget, st->sel);
    for (int i = 0; i < n; i++) st->sel[i] = st->pages[st->sel[i]];
    kv.pages = st->sel;
    *last = (n - 1) * PT + st->pos % PT;
    return kv;
}

/* A mixer's out product: through the transposed copy when the input was masked. */
static void out_product(fwd *f, int L, const qf_mat *w, const qf_mat *wt, float *x, int dim, float *out) {
    int masked = trunk_group(f, L, QF_ACT_MIX_OUT, x, f->N, dim);
    if (masked && wt->data) f->be->ops->matmul_cols(f->be, wt, x, f->N, out);
    else f->be->ops->matmul(f->be, w, x, f->N, out);
}

/* A mixer's one-row in product into the fused layout (in_proj's rows one after another): through
 * the transposed copy when the input was masked, else the fused matrix. 0: the separate products
 * are to run (several rows, or no fused matrix). */
static int in_product_fused(fwd *f, const qf_layer_w *w, const float *xn, int masked, float *y) {
    if (f->N != 1) return 0;
    if (masked && w->in_t.data) f->be->ops->matmul_cols(f->be, &w->in_t, xn, 1, y);
    else if (w->in_proj.data) f->be->ops->matmul(f->be, &w->in_proj, xn, 1, y);
    else return 0;
    return 1;
}

/* ---- Gated DeltaNet (§5) ---- */
static void linear_attn(fwd *f, int L, const float *xn, int masked, float *out) {
    const qf_model *m = f->m;
    const qf_config *c = &m->cfg;
    const qf_layer_w *w = &m->layers[L];
    qf_backend *be = f->be;
    qf_workspace *ws = f->ws;
    int N = f->N, cd = qf_cfg_conv_dim(c), nv = c->lin_v_heads, dv = c->lin_v_dim;
    int qk = c->lin_k_heads * c->lin_k_dim;
    float *mixed = WS(ws, big), *conv = WS(ws, conv), *z = WS(ws, z), *bb = WS(ws, bb), *aa = WS(ws, aa);
    float *core = WS(ws, core);
    if (in_product_fused(f, w, xn, masked, mixed)) { /* one row: the four products are one, their outputs adjacent */
        z = mixed + cd, bb = z + nv * dv, aa = bb + nv;
    } else {
        OPS->matmul(be, &w->w_qkv, xn, N, mixed);
        OPS->matmul(be, &w->w_z, xn, N, z);
        OPS->matmul(be, &w->w_b, xn, N, bb);
        OPS->matmul(be, &w->w_a, xn, N, aa);
    }
    OPS->gdn_gates(be, bb, aa, w->dt_bias, w->neg_A, N, nv); /* bb becomes beta, aa becomes g */
    for (int s = 0, r0 = 0; s < f->n_seqs; r0 += f->seqs[s].n, s++) {
        qf_seq_step *q = &f->seqs[s];
        float *cv = conv + (size_t)r0 * cd;
        OPS->conv_silu(be, mixed + (size_t)r0 * cd, cd, q->n, cd, c->conv_kernel, w->conv_w, q->st->conv[L], cv);
        qf_gdn_args a = {cv, cv + qk, cv + 2 * qk, cd, bb + r0 * nv, aa + r0 * nv, q->st->ssm[L],
                         core + (size_t)r0 * nv * dv, q->n, c->lin_k_heads, nv, c->lin_k_dim, dv};
        OPS->gdn(be, &a);
    }
    /* gated RMSNorm per v-head: norm(o) * w * silu(z) */
    OPS->rmsnorm(be, core, dv, w->gnorm, N * nv, dv, c->norm_eps, core, dv);
    OPS->swiglu(be, z, core, dv, N * nv, dv, core);
    out_product(f, L, &w->w_out, &w->out_t, core, nv * dv, out);
}

/* ---- gated full attention (§4) ---- */
static void full_attn(fwd *f, int L, const float *xn, int masked, float *out) {
    const qf_model *m = f->m;
    const qf_config *c = &m->cfg;
    const qf_layer_w *w = &m->layers[L];
    qf_backend *be = f->be;
    qf_workspace *ws = f->ws;
    int N = f->N, nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim;
    float *qg = WS(ws, big), *kb = WS(ws, kb), *vb = WS(ws, vb), *core = WS(ws, core);
    if (in_product_fused(f, w, xn, masked, qg)) {
        kb = qg + nh * 2 * hd, vb = kb + nkv * hd;
    } else {
        OPS->matmul(be, &w->wq, xn, N, qg);
        OPS->matmul(be, &w->wk, xn, N, kb);
        OPS->matmul(be, &w->wv, xn, N, vb);
    }
    OPS->rmsnorm(be, qg, 2 * hd, w->q_norm, N * nh, hd, c->norm_eps, qg, 2 * hd);
    OPS->rmsnorm(be, kb, hd, w->k_norm, N * nkv, hd, c->norm_eps, kb, hd);
    for (int s = 0, r0 = 0; s < f->n_seqs; r0 += f->seqs[s].n, s++) {
        qf_seq_step *q = &f->seqs[s];
        int pos0 = q->st->pos;
        float *qs = qg + (size_t)r0 * nh * 2 * hd, *ks = kb + (size_t)r0 * nkv * hd;
        OPS->rope(be, qs, nh * 2 * hd, 2 * hd, q->n, nh, c->rot_dim, pos0, m->inv_freq);
        OPS->rope(be, ks, nkv * hd, hd, q->n, nkv, c->rot_dim, pos0, m->inv_freq);
        qf_kv_view kv = qf_state_kv_view(q->st, L);
        OPS->kv_store(be, &kv, ks, vb + (size_t)r0 * nkv * hd, q->n, pos0, nkv, hd);
        int budget = q->n == 1 && !m->dev ? fw_kv_budget(f, r0, L, q->st) : 0, at = pos0;
        if (budget) kv = kv_choose(f, L, q->st, qs, budget, &at);
        fw_kv_count(f, q, budget);
        qf_attn_args a = {qs, nh * 2 * hd, 2 * hd, kv, core + (size_t)r0 * nh * hd, q->n, at, nh, nkv, hd, 1.0f / sqrtf((float)hd),
                          WS(ws, att), (size_t)ATT_SCRATCH_ROWS * 16 * (size_t)(hd + 2)};
        OPS->attention(be, &a);
    }
    OPS->sigmoid_mul(be, core, hd, qg + hd, 2 * hd, N * nh, hd);
    out_product(f, L, &w->wo, &w->out_t, core, nh * hd, out);
}

/* ---- MLPs (§6) ---- */
/* down_group >= 0: the down product's input is layer L's trunk group of that name (x's rows are
 * the step's rows); -1: never masked. */
static void swiglu_mlp(fwd *f, const qf_mat *g, const qf_mat *u, const qf_mat *d, const float *x, int n, float *out, int L, int down_group) {
    qf_backend *be = f->be;
    qf_workspace *ws = f->ws;
    int ffn = (int)g->rows;
    OPS->matmul(be, g, x, n, WS(ws, ex_g));
    OPS->matmul(be, u, x, n, WS(ws, ex_u));
    OPS->swiglu(be, WS(ws, ex_g), WS(ws, ex_u), ffn, n, ffn, WS(ws, ex_h));
    if (down_group >= 0) trunk_group(f, L, down_group, WS(ws, ex_h), n, ffn);
    OPS->matmul(be, d, WS(ws, ex_h), n, out);
}

/* Rows grouped by expert, ascending rows within a group: group e is asr[counts[e] .. counts[e+1]),
 * with its weights in asw (a dropped choice, -1, in none). */
static void group_rows(const int *topi, const float *topw, int n, int K, int E, int *counts, int *asr, float *asw) {
    memset(counts, 0, (size_t)(E + 1) * sizeof(int));
    for (int i = 0; i < n * K; i++)
        if (topi[i] >= 0) counts[topi[i] + 1]++;
    for (int e = 0; e < E; e++) counts[e + 1] += counts[e];
    /* counts[e] now is the end of group e-1; use it as the fill cursor of group e, then shift back */
    for (int r = 0; r < n; r++)
        for (int k = 0; k < K; k++) {
            int e = topi[r * K + k];
            if (e < 0) continue;
            int slot = counts[e]++;
            asr[slot] = r;
            asw[slot] = topw[r * K + k];
        }
    for (int e = E; e > 0; e--) counts[e] = counts[e - 1]; /* restore group starts */
    counts[0] = 0;
}

/* Softmax over all experts, top-k, renormalise (fp32); then rows are grouped by expert. */
static void route(fwd *f, int L, const float *logits) {
    const qf_config *c = &f->m->cfg;
    qf_workspace *ws = f->ws;
    int E = c->n_experts, K = c->n_experts_used;
    float *topw = WS(ws, topw), *asw = WS(ws, asw);
    for (int r = 0; r < f->N; r++) {
        float level = fw_expert_level(f, r, L);
        qf_ref_route(logits + (size_t)r * E, E, K, ws->topi + r * K, topw + r * K);
        if (level > 0.0f) { /* dropped experts leave their places as -1 */
            int kept = qf_ref_route_drop(topw + r * K, K, qf_sparsity_expert_tau(level, K), qf_sparsity_min_k(K));
            for (int k = kept; k < K; k++) ws->topi[r * K + k] = -1;
            ws->sparsity.experts_dropped += (uint64_t)(K - kept);
        }
        ws->sparsity.experts += (uint64_t)K;
    }
    if (ws->route_hook) ws->route_hook(ws->route_ud, L, ws->topi, f->N, K, WS(ws, x), c->hidden);
    group_rows(ws->topi, topw, f->N, K, E, ws->counts, ws->asr, asw);
}

/* fused: the one-row product of ffn_in (router logits, then the shared expert's gate, up and gate
 * logit), or NULL. */
static int shared_expert(fwd *f, int L, float *xn, const float *fused, float *out) {
    const qf_config *c = &f->m->cfg;
    const qf_layer_w *w = &f->m->layers[L];
    qf_backend *be = f->be;
    qf_workspace *ws = f->ws;
    if (c->shared_ffn > 0) {
        float *shs = WS(ws, shs), *ex_out = WS(ws, ex_out), *h = WS(ws, ex_h);
        int S = c->shared_ffn;
        if (fused) {
            const float *g = fused + c->n_experts, *u = g + S;
            OPS->swiglu(be, g, u, S, 1, S, h);
            OPS->matmul(be, &w->sh_down, h, 1, ex_out);
            OPS->sigmoid_scale_add(be, out, ex_out, u + S, 1, c->hidden);
            return QF_OK;
        }
        trunk_group(f, L, QF_ACT_SH_IN, xn, f->N, c->hidden); /* calibration's view only: the shared expert runs dense */
        swiglu_mlp(f, &w->sh_gate, &w->sh_up, &w->sh_down, xn, f->N, ex_out, L, QF_ACT_SH_DOWN);
        OPS->matmul(be, &w->sh_gate_w, xn, f->N, shs);
        OPS->sigmoid_scale_add(be, out, ex_out, shs, f->N, c->hidden);
    }
    return QF_OK;
}

/* An expert this rank holds on one dispatched row (experts/ep.h's callback). */
typedef struct ep_call {
    fwd *f;
    int L;
} ep_call;

static int ep_expert(void *ctx, int e, const float *x, float *y) {
    ep_call *c = ctx;
    qf_expert_store *es = c->f->m->experts;
    qf_expert ex;
    int rc = es->ops->acquire(es, c->L, e, &ex);
    if (rc != QF_OK) return rc;
    swiglu_mlp(c->f, &ex.gate, &ex.up, &ex.down, x, 1, y, c->L, -1);
    es->ops->release(es, c->L, e);
    return QF_OK;
}

/* The routed experts across the ranks (ws->ep), their outputs summed a row at a time in ascending
 * expert order with the model's own axpy: the one-rank loop's sums, bit for bit. */
static int moe_ep(fwd *f, int L, const float *xn, float *out) {
    qf_workspace *ws = f->ws;
    qf_backend *be = f->be;
    int H = f->m->cfg.hidden, K = f->m->cfg.n_experts_used;
    const float *topw = WS(ws, topw);
    ep_call c = {f, L};
    int rc = qf_ep_moe(ws->ep, xn, f->N, ws->topi, topw, ep_expert, &c, NULL);
    if (rc != QF_OK) return rc;
    memset(out, 0, (size_t)f->N * H * sizeof(float));
    for (int r = 0; r < f->N; r++) {
        const int32_t *ti = ws->topi + (size_t)r * K;
        for (int k = qf_ep_next_choice(ti, K, -1); k >= 0; k = qf_ep_next_choice(ti, K, ti[k]))
            OPS->axpy(be, out + (size_t)r * H, qf_ep_output(ws->ep, r, k), topw[(size_t)r * K + k], H);
    }
    return QF_OK;
}

/* The routed experts on the host for n rows of xn grouped by expert (group_rows): out = their
 * weighted sum, each row's in ascending expert order; each expert acquired once, its rows run
 * the workspace's rows at a time (a CPU product gives a row the same bits in any batch). */
static int routed_experts(fwd *f, int L, const float *xn, int n, const int *counts, const int *asr, const float *asw, float *out) {
    const qf_model *m = f->m;
    qf_backend *be = f->be;
    qf_workspace *ws = f->ws;
    int H = m->cfg.hidden, R = ws->max_rows;
    float *ex_in = WS(ws, ex_in), *ex_out = WS(ws, ex_out);
    memset(out, 0, (size_t)n * H * sizeof(float));
    for (int e = 0; e < m->cfg.n_experts; e++) {
        int g0 = counts[e], cnt = counts[e + 1] - g0;
        if (!cnt) continue;
        qf_expert ex;
        int rc = m->experts->ops->acquire(m->experts, L, e, &ex);
        if (rc != QF_OK) return rc;
        for (int j0 = 0; j0 < cnt; j0 += R) {
            int b = cnt - j0 < R ? cnt - j0 : R;
            for (int j = 0; j < b; j++) memcpy(ex_in + (size_t)j * H, xn + (size_t)asr[g0 + j0 + j] * H, (size_t)H * sizeof(float));
            swiglu_mlp(f, &ex.gate, &ex.up, &ex.down, ex_in, b, ex_out, L, -1);
            for (int j = 0; j < b; j++) OPS->axpy(be, out + (size_t)asr[g0 + j0 + j] * H, ex_out + (size_t)j * H, asw[g0 + j0 + j], H);
        }
        m->experts->ops->release(m->experts, L, e);
    }
    return QF_OK;
}

/* The next layer's router on this layer's MoE input (the residual has yet to take this layer's
 * MoE): each row's top prefetch_n experts, which the store reads ahead while this layer's experts
 * run. Not for steps whose guesses would fill half a layer (a prompt chunk). The logits go to the
 * lm_head rows, unused until the step's end. */
static void prefetch_next(fwd *f, int L, const float *xn) {
    const qf_model *m = f->m;
    int E = m->cfg.n_experts, n = m->prefetch_n < E ? m->prefetch_n : E, N = f->N, ids[512], k = 0;
    if (N * n > E / 2 || N * n > 512) return;
    qf_backend *be = f->be;
    float *rl = WS(f->ws, lg);
    OPS->matmul(be, &m->layers[L + 1].router, xn, N, rl);
    for (int r = 0; r < N; r++) {
        const float *l = rl + (size_t)r * E;
        for (int j = 0; j < n; j++) { /* the j-th largest: ties to the lower id, as qf_ref_route */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = k - j; i < k && !taken; i++) taken = ids[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            ids[k++] = best;
        }
    }
    m->experts->ops->prefetch(m->experts, L + 1, ids, k);
}

int fw_moe(fwd *f, int L, float *xn, float *out) {
    const qf_model *m = f->m;
    const qf_config *c = &m->cfg;
    const qf_layer_w *w = &m->layers[L];
    qf_backend *be = f->be;
    qf_workspace *ws = f->ws;
    int H = c->hidden, N = f->N;
    const float *fused = N == 1 && w->ffn_in.data ? WS(ws, rl) : NULL;
    OPS->matmul(be, fused ? &w->ffn_in : &w->router, xn, N, WS(ws, rl));
    if (OPS->moe) { /* a device routes and runs the experts itself */
        qf_expert_table t;
        int wide = N > QF_DEC_ROWS && m->experts->ops->wide_table; /* a device records steps of QF_DEC_ROWS rows at most */
        int rc = wide ? m->experts->ops->wide_table(m->experts, L, N, &t) : m->experts->ops->table(m->experts, L, &t);
        if (rc != QF_OK) return rc;
        qf_moe_args a = {t.experts, c->n_experts, c->n_experts_used, N, H, c->expert_ffn, WS(ws, rl), xn, out, t.dev, t.chosen, QF_EXPERT_ID_ROWS, t.cache};
        OPS->moe(be, &a);
        return shared_expert(f, L, xn, fused, out);
    }
    route(f, L, WS(ws, rl));
    if (m->prefetch_n > 0 && L + 1 < c->n_layers && m->experts->ops->prefetch) prefetch_next(f, L, xn);
    if (ws->ep) {
        int rc = moe_ep(f, L, xn, out);
        return rc == QF_OK ? shared_expert(f, L, xn, fused, out) : rc;
    }
    int rc = routed_experts(f, L, xn, N, ws->counts, ws->asr, WS(ws, asw), out);
    return rc == QF_OK ? shared_expert(f, L, xn, fused, out) : rc;
}

static int check_batch(const qf_model *m, const qf_workspace *ws, const qf_seq_step *seqs, int n_seqs, int *N) {
    *N = 0;
    for (int s = 0; s < n_seqs; s++) {
        const qf_seq_step *q = &seqs[s];
        if (q->n < 1) return qf_fail(QF_EINVAL, "sequence %d of the batch has no tokens", s);
        if (q->sparsity_set && !(q->sparsity >= 0.0f && q->sparsity <= 1.0f)) return qf_fail(QF_EINVAL, "sparsity level %g is outside 0..1", q->sparsity);
        if (q->logits_mode == QF_LOGITS_DRAW && (!q->draw || !q->top1 || !q->logits)) return qf_fail(QF_EINVAL, "sequence %d draws without its draw, pick or logits", s);
        if ((q->logits_mode == QF_LOGITS_PICKS || q->logits_mode == QF_LOGITS_TOP1) && !q->top1) return qf_fail(QF_EINVAL, "sequence %d picks without a place for them", s);
        if (q->sparsity_set && q->sparsity > 0.0f && !qf_model_sparsity_ready(m))
            return qf_fail(QF_EUNSUPPORTED, "a sparsity level above 0 on this device needs the model loaded with one (its transposed weights)");
        for (int i = 0; !q->inputs && i < q->n; i++)
            if (q->tokens[i] < 0 || q->tokens[i] >= m->cfg.vocab)
                return qf_fail(QF_EINVAL, "token id %d at position %d is outside the vocabulary (0..%d)", q->tokens[i], i, m->cfg.vocab - 1);
        *N += q->n;
    }
    if (*N > ws->max_rows) return qf_fail(QF_EINVAL, "batch of %d tokens exceeds the workspace (%d)", *N, ws->max_rows);
    /* pages last: a failure above must leave every state as it was */
    for (int s = 0; s < n_seqs; s++) {
        int rc = qf_state_reserve(seqs[s].st, seqs[s].n);
        if (rc != QF_OK) return rc;
    }
    return QF_OK;
}

/* The greedy picks of n rows of logits: on the device when it can, else on the host (where the
 * logits then are). */
void fw_pick(fwd *f, const float *rows, int n, int32_t *out) {
    qf_backend *be = f->be;
    int V = f->m->cfg.vocab;
    if (OPS->dec) {
        int32_t *amax = (int32_t *)WS(f->ws, amax);
        OPS->dec->argmax(be, rows, n, V, amax);
        qf_be_download(be, out, amax, (size_t)n * sizeof(int32_t));
        return;
    }
    for (int t = 0; t < n; t++) out[t] = qf_argmax_f32(rows + (size_t)t * V, V); /* the CPU tables have no device: rows are host memory */
}

/* Final norm + lm_head for the wanted rows: ALL rows straight into the caller's buffer, LAST rows
 * gathered from every sequence and projected together so lm_head is read once per step. */
void fw_logits(fwd *f) {
    const qf_model *m = f->m;
    qf_backend *be = f->be;
    qf_workspace *ws = f->ws;
    int H = m->cfg.hidden, V = m->cfg.vocab, n_last = 0, R = ws->max_logit_rows;
    float *x = WS(ws, x), *lrows = WS(ws, lrows), *lg = WS(ws, lg);
    for (int s = 0, r0 = 0; s < f->n_seqs; r0 += f->seqs[s].n, s++) {
        qf_seq_step *q = &f->seqs[s];
        if (q->logits_mode == QF_LOGITS_ALL || q->logits_mode == QF_LOGITS_PICKS) { /* through lg in chunks: q->logits is host memory */
            for (int i0 = 0; i0 < q->n; i0 += R) {
                int cnt = q->n - i0 < R ? q->n - i0 : R;
                OPS->rmsnorm(be, x + (size_t)(r0 + i0) * H, H, m->final_norm, cnt, H, m->cfg.norm_eps, lrows, H);
                OPS->matmul(be, &m->lm_head, lrows, cnt, lg);
                if (q->logits_mode == QF_LOGITS_PICKS) fw_pick(f, lg, cnt, q->top1 + i0);
                else qf_be_download(be, q->logits + (size_t)i0 * V, lg, (size_t)cnt * V * sizeof(float));
            }
        } else if (q->logits_mode == QF_LOGITS_LAST || q->logits_mode == QF_LOGITS_TOP1 || q->logits_mode == QF_LOGITS_DRAW) {
            ws->lrow_src[n_last++] = s;
        }
    }
    int keep = n_last <= R && OPS->dec && OPS->dec->draw; /* lg holds every wanted row after the step: DRAW rows drawn from there */
    f->lg_rows = keep ? n_last : 0;
    for (int i0 = 0; i0 < n_last; i0 += R) {
        int cnt = n_last - i0 < R ? n_last - i0 : R;
        for (int j = 0; j < cnt; j++) {
            int s = ws->lrow_src[i0 + j], row = -1;
            for (int k = 0; k <= s; k++) row += f->seqs[k].n;
            OPS->rmsnorm(be, x + (size_t)row * H, H, m->final_norm, 1, H, m->cfg.norm_eps, lrows + (size_t)j * H, H);
        }
        OPS->matmul(be, &m->lm_head, lrows, cnt, lg);
        for (int j = 0; j < cnt; j++) {
            qf_seq_step *q = &f->seqs[ws->lrow_src[i0 + j]];
            if (q->logits_mode == QF_LOGITS_LAST || (q->logits_mode == QF_LOGITS_DRAW && !keep)) fw_draw_on_host(be, q, lg + (size_t)j * V, V);
            else if (q->logits_mode == QF_LOGITS_DRAW) q->top1[0] = 0;
            else fw_pick(f, lg + (size_t)j * V, 1, q->top1);
        }
    }
}

/* What fixes the sequence of kernels of a step: its sequences' row counts, the outputs wanted, their
 * sparsity and the expert cache (a cache given slots later adds kernels to the step). Which states
 * and buffers, and the positions, only change the kernels' arguments (set again on a replay), so
 * one recording serves every batch of the same shape whatever its sequences. */
static uint64_t step_key(const qf_model *m, const qf_seq_step *seqs, int n_seqs) {
    uint64_t h = (1469598103934665603ull ^ (uint64_t)n_seqs) * 1099511628211ull ^ m->sparsity_gen; /* levels are the kernels' arguments */
    qf_expert_table t = {0};
    if (m->experts && m->experts->ops->table(m->experts, 0, &t) == QF_OK) h = (h ^ (uint64_t)(uintptr_t)t.cache) * 1099511628211ull;
    for (int s = 0; s < n_seqs; s++) {
        uint32_t lv;
        memcpy(&lv, &seqs[s].sparsity, sizeof lv);
        float level = seqs[s].sparsity;
        for (int L = 0; !seqs[s].sparsity_set && L < m->cfg.n_layers; L++) level = L == 0 || m->sparsity[L] > level ? m->sparsity[L] : level;
        int kv_on = seqs[s].n == 1 && qf_sparsity_kv_pages(m, level, seqs[s].st->pos + 1, qf_kv_pool_page_tokens(seqs[s].st->kv)) > 0;
        uint64_t v[8] = {(uint64_t)seqs[s].n, (uint64_t)seqs[s].logits_mode, seqs[s].sparsity_set ? (uint64_t)lv + 1 : 0, (uint64_t)kv_on, /* kv_on: the step's page choices */
                         !seqs[s].logits, !seqs[s].top1, !seqs[s].inputs, !seqs[s].hidden};
        for (int i = 0; i < 8; i++) h = (h ^ v[i]) * 1099511628211ull;
    }
    return h;
}

/* One layer for the f->N rows of x (the prompt path). */
/* Layer L's mixer on the step's rows of x (x += mixer(norm(x))), then xn = the MLP's input. */
static void mix_layer(fwd *f, int L, float *x) {
    const qf_config *c = &f->m->cfg;
    const qf_layer_w *w = &f->m->layers[L];
    qf_backend *be = f->be;
    int H = c->hidden;
    float *xn = WS(f->ws, xn), *tmp = WS(f->ws, tmp);
    OPS->rmsnorm(be, x, H, w->attn_norm, f->N, H, c->norm_eps, xn, H);
    int masked = trunk_group(f, L, QF_ACT_MIX_IN, xn, f->N, H);
    if (w->kind == QF_LAYER_FULL) full_attn(f, L, xn, masked, tmp);
    else linear_attn(f, L, xn, masked, tmp);
    OPS->axpy(be, x, tmp, 1.0f, (int64_t)f->N * H);
    OPS->rmsnorm(be, x, H, w->ffn_norm, f->N, H, c->norm_eps, xn, H);
}

static int prompt_layer(fwd *f, int L, float *x) {
    const qf_model *m = f->m;
    const qf_config *c = &m->cfg;
    const qf_layer_w *w = &m->layers[L];
    qf_backend *be = f->be;
    int H = c->hidden, rc = QF_OK;
    float *xn = WS(f->ws, xn), *tmp = WS(f->ws, tmp);
    mix_layer(f, L, x);
    if (c->arch == QF_ARCH_QWEN35_MOE) rc = fw_moe(f, L, xn, tmp);
    else swiglu_mlp(f, &w->gate, &w->up, &w->down, xn, f->N, tmp, L, -1);
    if (rc == QF_OK) OPS->axpy(be, x, tmp, 1.0f, (int64_t)f->N * H);
    return rc;
}

/* A step that failed part-way: the device's bracket is closed with the step abandoned (a device
 * error it held is not the first one) and rc returned. The sequences' states hold part of the
 * step: their requests fail. */
static int step_fail(qf_backend *be, int rc) {
    if (!OPS->step_end) return rc;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", qf_last_error());
    OPS->step_end(be, 1);
    return qf_fail(rc, "%s", msg);
}

/* The step's rows of x: each sequence's tokens embedded (or its input rows), one after another, or
 * in a decode step's waves. */
static void embed_rows(fwd *f, float *x) {
    const qf_model *m = f->m;
    qf_backend *be = f->be;
    int H = m->cfg.hidden;
    for (int s = 0, r0 = 0; s < f->n_seqs; r0 += f->seqs[s].n, s++) {
        const qf_seq_step *q = &f->seqs[s];
        for (int i = 0; i < q->n; i += f->waves > 1 ? 1 : q->n) {
            int row = f->waves > 1 ? fw_seq_row(f, s, i) : r0 + i, n = f->waves > 1 ? 1 : q->n;
            if (q->inputs) qf_be_copy(be, x + (size_t)row * H, q->inputs + (size_t)i * H, (size_t)n * H * sizeof(float));
            else OPS->embed(be, &m->embed, q->tokens + i, n, x + (size_t)row * H);
        }
    }
}

/* On a device the store stages whole layers for steps wider than a decode step; on the host a
 * layer's MoE runs over the whole prompt at once (host_layer). */
static int layered_ok(const qf_model *m, const qf_workspace *ws) {
    if (ws->px_tokens <= ws->max_rows || !m->experts || ws->ep) return 0;
    return m->dev ? m->experts->ops->wide_table && ws->max_rows > QF_DEC_ROWS : ws->pxn != NULL;
}

int qf_forward_lone_rows(const qf_model *m, const qf_workspace *ws) { return layered_ok(m, ws) ? ws->px_tokens : ws->max_rows; }

static int forward_layered(const qf_model *m, qf_backend *be, qf_workspace *ws, qf_state *st, const int32_t *tokens, int n, float *logits_out);

/* One layer of a layered prompt on the host: the mixer and the routing a chunk at a time (the
 * states grow in order), then the routed experts over every row of the prompt at once, so each
 * expert is read once a layer for the whole prompt (a RAM cache smaller than a layer reads the
 * layer once, not once a chunk); then the shared expert and the residual a chunk at a time. The
 * sums and their order per row are the chunked path's (prompt_layer): the same bits. */
static int host_layer(fwd *f, int L, qf_seq_step *q, const int32_t *tokens, int n, int p0) {
    qf_workspace *ws = f->ws;
    qf_backend *be = f->be;
    const qf_config *c = &f->m->cfg;
    int H = c->hidden, K = c->n_experts_used, E = c->n_experts, R = ws->max_rows;
    for (int i = 0; i < n; i += R) {
        q->tokens = tokens + i, q->n = f->N = n - i < R ? n - i : R;
        q->st->pos = p0 + i;
        mix_layer(f, L, ws->px + (size_t)i * H);
        memcpy(ws->pxn + (size_t)i * H, WS(ws, xn), (size_t)f->N * H * sizeof(float));
        OPS->matmul(be, &f->m->layers[L].router, WS(ws, xn), f->N, WS(ws, rl));
        route(f, L, WS(ws, rl));
        memcpy(ws->ptopi + (size_t)i * K, ws->topi, (size_t)f->N * K * sizeof(int));
        memcpy(ws->ptopw + (size_t)i * K, WS(ws, topw), (size_t)f->N * K * sizeof(float));
    }
    group_rows(ws->ptopi, ws->ptopw, n, K, E, ws->pcounts, ws->pasr, ws->pasw);
    int rc = routed_experts(f, L, ws->pxn, n, ws->pcounts, ws->pasr, ws->pasw, ws->pmo);
    for (int i = 0; i < n && rc == QF_OK; i += R) {
        q->tokens = tokens + i, q->n = f->N = n - i < R ? n - i : R;
        float *out = ws->pmo + (size_t)i * H;
        rc = shared_expert(f, L, ws->pxn + (size_t)i * H, NULL, out);
        OPS->axpy(be, ws->px + (size_t)i * H, out, 1.0f, (int64_t)f->N * H);
    }
    return rc;
}

int qf_forward(const qf_model *m, qf_backend *be, qf_workspace *ws, qf_seq_step *seqs, int n_seqs) {
    const qf_seq_step *q0 = &seqs[0];
    if (n_seqs == 1 && q0->n > ws->max_rows && q0->n <= ws->px_tokens && layered_ok(m, ws) && !q0->inputs && !q0->hidden &&
        (q0->logits_mode == QF_LOGITS_NONE || q0->logits_mode == QF_LOGITS_LAST))
        return forward_layered(m, be, ws, q0->st, q0->tokens, q0->n, q0->logits_mode == QF_LOGITS_LAST ? q0->logits : NULL);
    fwd f = {.m = m, .be = be, .ws = ws, .seqs = seqs, .n_seqs = n_seqs};
    int rc = check_batch(m, ws, seqs, n_seqs, &f.N);
    if (rc != QF_OK) return rc;
    const qf_config *c = &m->cfg;
    int H = c->hidden;
    float *x = WS(ws, x), *xn = WS(ws, xn);
    if (m->experts && m->experts->ops->step) m->experts->ops->step(m->experts);
    int dec = fw_dec_usable(&f);
    if (dec) fw_dec_rows(&f);
    if (OPS->step_begin) OPS->step_begin(be, dec || f.N <= QF_GRAPH_ROWS ? step_key(m, seqs, n_seqs) : 0, f.N);
    kv_prepare(&f);
    embed_rows(&f, x);
    if (ws->hook && !m->dev) ws->hook(ws->hook_ud, 0, x, f.N, H);
    if (dec) {
        for (int L = 0; L < c->n_layers && rc == QF_OK; L++) rc = fw_dec_layer(&f, L);
        if (rc != QF_OK) return step_fail(be, rc);
        for (int s = 0; s < n_seqs; s++) seqs[s].st->pos += seqs[s].n;
        fw_dec_logits(&f);
        rc = OPS->step_end ? OPS->step_end(be, 0) : QF_OK;
        return rc == QF_OK ? fw_draw_after(&f) : rc;
    }
    for (int L = 0; L < c->n_layers; L++) {
        if ((rc = prompt_layer(&f, L, x)) != QF_OK) return step_fail(be, rc);
        if (ws->hook && !m->dev && L + 1 < c->n_layers) ws->hook(ws->hook_ud, L + 1, x, f.N, H);
    }
    if (ws->hook && !m->dev) {
        OPS->rmsnorm(be, x, H, m->final_norm, f.N, H, c->norm_eps, xn, H);
        ws->hook(ws->hook_ud, c->n_layers, xn, f.N, H);
    }
    fw_hidden_out(&f, x, xn);
    for (int s = 0; s < n_seqs; s++) seqs[s].st->pos += seqs[s].n;
    fw_logits(&f);
    rc = OPS->step_end ? OPS->step_end(be, 0) : QF_OK;
    return rc == QF_OK ? fw_draw_after(&f) : rc;
}

/* A prompt longer than the workspace's rows, layer by layer: every chunk passes layer L before any
 * passes L + 1, with the hidden states of all of them in ws->px, so a device store that stages a
 * layer's experts (wide_table) copies each layer once for the whole prompt, not once per chunk, and
 * on the host each expert is read once a layer (host_layer). The chunks of a layer run in order,
 * so attention and DeltaNet states grow as in qf_forward_seq. */
static int forward_layered(const qf_model *m, qf_backend *be, qf_workspace *ws, qf_state *st, const int32_t *tokens, int n, float *logits_out) {
    const qf_config *c = &m->cfg;
    int H = c->hidden, R = ws->max_rows, p0 = st->pos, rc = QF_OK;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab)
            return qf_fail(QF_EINVAL, "token id %d at position %d is outside the vocabulary (0..%d)", tokens[i], i, c->vocab - 1);
    if ((rc = qf_state_reserve(st, n)) != QF_OK) return rc;
    if (m->experts->ops->step) m->experts->ops->step(m->experts);
    if (OPS->step_begin) OPS->step_begin(be, 0, n); /* more rows than a recorded step: run as it goes */
    for (int i = 0; i < n; i += R) OPS->embed(be, &m->embed, tokens + i, n - i < R ? n - i : R, ws->px + (size_t)i * H);
    qf_seq_step q = {st, NULL, 0, QF_LOGITS_NONE, NULL, NULL, 0, 0, NULL, NULL, NULL};
    fwd f = {.m = m, .be = be, .ws = ws, .seqs = &q, .n_seqs = 1};
    for (int L = 0; L < c->n_layers && rc == QF_OK; L++) {
        if (ws->pxn) {
            rc = host_layer(&f, L, &q, tokens, n, p0);
            continue;
        }
        for (int i = 0; i < n && rc == QF_OK; i += R) {
            q.tokens = tokens + i, q.n = f.N = n - i < R ? n - i : R;
            st->pos = p0 + i;
            rc = prompt_layer(&f, L, ws->px + (size_t)i * H);
        }
    }
    st->pos = p0 + (rc == QF_OK ? n : 0);
    if (rc != QF_OK) return step_fail(be, rc);
    int last = (n - 1) / R * R; /* the last chunk's rows to where fw_logits() reads them */
    q.tokens = tokens + last, q.n = f.N = n - last, q.logits_mode = logits_out ? QF_LOGITS_LAST : QF_LOGITS_NONE, q.logits = logits_out;
    if (OPS->zero) { /* device memory: 0 + x is x */
        OPS->zero(be, WS(ws, x), (size_t)f.N * H * sizeof(float));
        OPS->axpy(be, WS(ws, x), ws->px + (size_t)last * H, 1.0f, (int64_t)f.N * H);
    } else {
        memcpy(WS(ws, x), ws->px + (size_t)last * H, (size_t)f.N * H * sizeof(float));
    }
    fw_logits(&f);
    return OPS->step_end ? OPS->step_end(be, 0) : QF_OK;
}

int qf_forward_seq(const qf_model *m, qf_backend *be, qf_workspace *ws, qf_state *st, const int32_t *tokens, int n,
                   int logits_mode, float *logits_out) {
    if (n < 1) return qf_fail(QF_EINVAL, "no tokens to run");
    if (n > ws->max_rows && n <= ws->px_tokens && layered_ok(m, ws) && logits_mode != QF_LOGITS_ALL)
        return forward_layered(m, be, ws, st, tokens, n, logits_mode == QF_LOGITS_LAST ? logits_out : NULL);
    for (int i = 0; i < n; i += ws->max_rows) {
        int cnt = n - i < ws->max_rows ? n - i : ws->max_rows;
        int last = i + cnt == n;
        qf_seq_step s = {st, tokens + i, cnt, QF_LOGITS_NONE, NULL, NULL, 0, 0, NULL, NULL, NULL};
        if (logits_mode == QF_LOGITS_ALL) {
            s.logits_mode = QF_LOGITS_ALL;
            s.logits = logits_out + (size_t)i * m->cfg.vocab;
        } else if (last && logits_mode == QF_LOGITS_LAST) {
            s.logits_mode = QF_LOGITS_LAST;
            s.logits = logits_out;
        }
        int rc = qf_forward(m, be, ws, &s, 1);
        if (rc != QF_OK) return rc;
    }
    return QF_OK;
}
