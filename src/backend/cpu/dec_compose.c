/* The fused decode ops (ops.h qf_dec_ops) written as the chains of plain ops that define them,
 * over any CPU table. Not used by the CPU engine (its MoE goes through the expert store): it lets
 * tests run forward.c's decode path on the CPU against the references, so that path is checked
 * where no GPU is. The scratch is allocated once, at init. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/ops.h"
#include "base/err.h"
#include "base/numeric.h"
#include "backend/rules.h"

typedef struct compose {
    qf_ops ops; /* the base table with .dec set */
    float *scratch;
    size_t cap;
} compose;

#define CTX(be) ((compose *)(be)->dev)
#define BASE(be) (&CTX(be)->ops)

/* pre(x) for n rows of cols into xin (ops.h qf_pre) */
static void pre_rows(qf_backend *be, const float *x, int n, int cols, const qf_pre *p, float *xin) {
    const qf_ops *o = BASE(be);
    memcpy(xin, x, (size_t)n * cols * sizeof(float));
    if (!p || p->kind == QF_PRE_NONE) return;
    if (p->kind == QF_PRE_RMSNORM) {
        o->rmsnorm(be, x, cols, p->w, n, cols, p->eps, xin, cols);
        return;
    }
    for (int t = 0; t < n; t++)
        for (int h = 0; h < cols / p->head; h++) {
            float *v = xin + (size_t)t * cols + (size_t)h * p->head;
            const float *g = p->g + (size_t)t * p->g_stride + (size_t)h * p->g_hstride;
            if (p->kind == QF_PRE_SIGMOID) {
                o->sigmoid_mul(be, v, p->head, g, p->head, 1, p->head);
            } else {
                o->rmsnorm(be, v, p->head, p->w, 1, p->head, p->eps, v, p->head);
                o->swiglu(be, g, v, p->head, 1, p->head, v);
            }
        }
}

static int fits(qf_backend *be, size_t floats) {
    if (floats <= CTX(be)->cap) return 1;
    fprintf(stderr, "qflash: composed decode op needs %zu floats of scratch, has %zu\n", floats, CTX(be)->cap);
    return 0;
}

/* the DeltaNet in_proj epilogue of row t: conv with the row's state, z as is, then the gates */
static void gdn_epi(qf_backend *be, const qf_gdn_epi *e, int t, const float *in, float *out) {
    const qf_ops *o = BASE(be);
    int cd = e->conv_dim, zd = e->z_dim;
    o->conv_silu(be, in, cd, 1, cd, e->conv_k, e->conv_w, e->conv_state[t], out);
    memcpy(out + cd, in + cd, (size_t)(zd + 2 * e->nv) * sizeof(float));
    o->gdn_gates(be, out + cd + zd, out + cd + zd + e->nv, e->dt_bias, e->neg_A, 1, e->nv);
}

/* each row's product out[t] (rows floats) into y: through the epilogue, added, or copied */
static void finish_rows(qf_backend *be, const float *out, int n, int64_t rows, const qf_gdn_epi *epi, int acc, float *y) {
    for (int t = 0; t < n; t++) {
        const float *o = out + t * rows;
        float *yt = y + t * rows;
        if (epi) gdn_epi(be, epi, t, o, yt);
        else if (acc) BASE(be)->axpy(be, yt, o, 1.0f, rows);
        else memcpy(yt, o, (size_t)rows * sizeof(float));
    }
}

static void c_matmul(qf_backend *be, const qf_mat *w, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi, int acc, float *y) {
    int64_t rows = w->rows, cols = w->cols;
    if (!fits(be, (size_t)(n * (cols + rows)))) return;
    float *xin = CTX(be)->scratch, *out = xin + n * cols;
    pre_rows(be, x, n, (int)cols, pre, xin);
    BASE(be)->matmul(be, w, xin, n, out);
    finish_rows(be, out, n, rows, epi, acc, y);
}

static void c_matmul_sparse(qf_backend *be, const qf_mat *wt, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi, int acc,
                            const float *thr, float *y) {
    int64_t rows = wt->cols, cols = wt->rows;
    if (!fits(be, (size_t)(n * (cols + rows)))) return;
    float *xin = CTX(be)->scratch, *out = xin + n * cols;
    pre_rows(be, x, n, (int)cols, pre, xin);
    for (int t = 0; t < n; t++)
        for (int64_t i = 0; i < cols; i++)
            if (fabsf(xin[t * cols + i]) < thr[t]) xin[t * cols + i] = 0.0f;
    BASE(be)->matmul_cols(be, wt, xin, n, out);
    finish_rows(be, out, n, rows, epi, acc, y);
}

static void c_gdn(qf_backend *be, const qf_gdn_dec *a) {
    int qk = a->nk * a->dk, vd = a->nv * a->dv, cd = 2 * qk + vd;
    for (int t = 0; t < a->n; t++) {
        const float *r = a->mixed + (size_t)t * a->stride;
        qf_gdn_args g = {r, r + qk, r + 2 * qk, a->stride, r + cd + vd, r + cd + vd + a->nv, a->S[t], a->out + (size_t)t * vd, 1, a->nk, a->nv, a->dk, a->dv};
        BASE(be)->gdn(be, &g);
    }
}

static void c_attention(qf_backend *be, const qf_attn_dec *a) {
    const qf_ops *o = BASE(be);
    int qd = a->nh * 2 * a->hd, kd = a->nkv * a->hd;
    if (!fits(be, (size_t)(qd + kd))) return;
    float *q = CTX(be)->scratch, *k = q + qd;
    for (int t = 0; t < a->n; t++) {
        const float *r = a->qkv + (size_t)t * a->stride;
        memcpy(q, r, (size_t)qd * sizeof(float));
        memcpy(k, r + a->k_off, (size_t)kd * sizeof(float));
        o->rmsnorm(be, q, 2 * a->hd, a->q_norm, a->nh, a->hd, a->eps, q, 2 * a->hd);
        o->rmsnorm(be, k, a->hd, a->k_norm, a->nkv, a->hd, a->eps, k, a->hd);
        o->rope(be, q, qd, 2 * a->hd, 1, a->nh, a->rot, a->pos[t], a->inv_freq);
        o->rope(be, k, kd, a->hd, 1, a->nkv, a->rot, a->pos[t], a->inv_freq);
        int j = a->n_keys[t] ? a->n_keys[t] - 1 : a->pos[t]; /* the new token's place in the view */
        o->kv_store(be, &a->kv[t], k, r + a->v_off, 1, j, a->nkv, a->hd);
        qf_attn_args at = {q, qd, 2 * a->hd, a->kv[t], a->out + (size_t)t * a->nh * a->hd, 1, j, a->nh, a->nkv, a->hd, a->scale, NULL, 0};
        o->attention(be, &at);
    }
}

static void c_page_select(qf_backend *be, const qf_attn_dec *a, const int *n_pages, const int *budget, int32_t *const *sel) {
    const qf_ops *o = BASE(be);
    int qd = a->nh * 2 * a->hd, nkv = a->nkv, hd = a->hd;
    if (!fits(be, (size_t)qd)) return;
    float *q = CTX(be)->scratch, score[4096];
    for (int t = 0; t < a->n; t++) {
        const qf_kv_view *kv = &a->kv[t];
        int np = n_pages[t];
        if (!budget[t] || np > 4096) continue;
        memcpy(q, a->qkv + (size_t)t * a->stride, (size_t)qd * sizeof(float));
        o->rmsnorm(be, q, 2 * hd, a->q_norm, a->nh, hd, a->eps, q, 2 * hd);
        o->rope(be, q, qd, 2 * hd, 1, a->nh, a->rot, a->pos[t], a->inv_freq);
        for (int p = 0; p < np - 1; p++) {
            const float *sum = kv->base + (size_t)kv->pages[p] * kv->page_stride + kv->s_off;
            score[p] = qf_ref_page_score(q, a->nh, 2 * hd, nkv, sum, sum + (size_t)nkv * hd, hd);
        }
        score[np - 1] = 0.0f;
        int n = qf_ref_page_select(score, np, budget[t], sel[t]);
        for (int i = 0; i < n; i++) sel[t][i] = kv->pages[sel[t][i]];
    }
}

static void c_moe(qf_backend *be, const qf_moe_dec *a) {
    const qf_ops *o = BASE(be);
    int H = a->hidden, I = a->ffn, S = a->sh_ffn, E = a->n_experts, F = I > S ? I : S, ti[64];
    float tw[64];
    if (!fits(be, (size_t)(3 * H + 3 * F)) || a->top_k > 64) return;
    float *xn = CTX(be)->scratch, *acc = xn + H, *y = acc + H, *g = y + H, *u = g + F, *h = u + F;
    for (int t = 0; t < a->n; t++) {
        const float *l = a->rl + (size_t)t * a->rl_stride;
        float *x = a->x + (size_t)t * H;
        o->rmsnorm(be, x, H, a->norm_w, 1, H, a->eps, xn, H);
        qf_ref_route(l, E, a->top_k, ti, tw);
        int kept = a->drop_tau[t] > 0.0f ? qf_ref_route_drop(tw, a->top_k, a->drop_tau[t], a->min_k) : a->top_k;
        for (int k = 0; a->chosen && k < a->top_k; k++) a->chosen[t * a->top_k + k] = k < kept ? ti[k] : -1;
        memset(acc, 0, (size_t)H * sizeof(float));
        for (int k = 0; k < kept; k++) {
            const qf_expert *ex = &a->experts[ti[k]];
            o->matmul(be, &ex->gate, xn, 1, g);
            o->matmul(be, &ex->up, xn, 1, u);
            o->swiglu(be, g, u, I, 1, I, h);
            o->matmul(be, &ex->down, h, 1, y);
            o->axpy(be, acc, y, tw[k], H);
        }
        o->swiglu(be, l + E, l + E + S, S, 1, S, h);
        o->matmul(be, a->sh_down, h, 1, y);
        o->sigmoid_scale_add(be, acc, y, l + E + 2 * S, 1, H);
        o->axpy(be, x, acc, 1.0f, H);
    }
}

static void c_argmax(qf_backend *be, const float *x, int n, int cols, int32_t *out) {
    (void)be;
    for (int t = 0; t < n; t++) out[t] = qf_argmax_f32(x + (size_t)t * cols, cols);
}

/* ---- the draw (ops.h qf_draw), plainly: every token sorted ---- */

typedef struct draw_cand {
    float v;
    int32_t id;
} draw_cand;

static int draw_cmp(const void *a, const void *b) {
    const draw_cand *x = a, *y = b;
    if (x->v != y->v) return x->v < y->v ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Every token kept: the best QF_DRAW_SORTED walked first, then the rest in id order. */
static int32_t draw_every(const float *x, int V, const qf_draw *d, const draw_cand *c, const double *w, double uu) {
    double acc = 0.0, mx = c[0].v;
    for (int i = 0; i < QF_DRAW_SORTED; i++)
        if (uu < (acc += w[i])) return c[i].id;
    float lo = c[QF_DRAW_SORTED - 1].v;
    int lo_id = c[QF_DRAW_SORTED - 1].id, last = lo_id;
    for (int i = 0; i < V; i++) {
        float v = x[i] / d->temperature;
        if (v > lo || (v == lo && i <= lo_id)) continue; /* among the best */
        acc += exp((double)v - mx), last = i;
        if (uu < acc) return i;
    }
    return last;
}

/* One row: penalties in place, then the walk of ops.h's rule over the whole sorted vocabulary. */
static int32_t draw_row(float *x, int V, const qf_draw *d, draw_cand *c, double *w) {
    for (int i = 0; i < d->n_pen; i++) {
        float v = x[d->pen_ids[i]];
        if (d->repetition != 1.0f) v = v > 0.0f ? v / d->repetition : v * d->repetition;
        x[d->pen_ids[i]] = v - d->pen_sub[i];
    }
    if (d->temperature == 0.0f) return qf_argmax_f32(x, V);
    for (int i = 0; i < V; i++) c[i] = (draw_cand){x[i] / d->temperature, i};
    qsort(c, (size_t)V, sizeof *c, draw_cmp);
    int K = d->top_k > 0 && d->top_k < V ? d->top_k : V;
    double mx = c[0].v, sum = 0.0, cum = 0.0, total = 0.0, acc = 0.0;
    for (int i = 0; i < K; i++) sum += w[i] = exp((double)c[i].v - mx);
    int kept = K;
    for (int i = 0; i < K; i++) {
        if (i > 0 && w[i] < d->min_p) {
            kept = i;
            break;
        }
        cum += w[i] / sum;
        if (cum >= d->top_p) {
            kept = i + 1;
            break;
        }
    }
    for (int i = 0; i < kept; i++) total += w[i];
    if (kept == V && V > QF_DRAW_SORTED && d->top_p >= 1.0f && d->min_p <= 0.0f) return draw_every(x, V, d, c, w, d->u * total);
    for (int i = 0; i < kept; i++)
        if (d->u * total < (acc += w[i])) return c[i].id;
    return c[kept - 1].id;
}

static void c_draw(qf_backend *be, float *logits, int n, int cols, const qf_draw *d, int32_t *out) {
    (void)be;
    draw_cand *c = malloc((size_t)cols * sizeof *c);
    double *w = malloc((size_t)cols * sizeof *w);
    for (int r = 0; c && w && r < n; r++)
        if (d[r].on) out[r] = draw_row(logits + (size_t)r * cols, cols, &d[r], c, w);
    free(c), free(w);
}

static const qf_dec_ops k_compose = {c_matmul, c_gdn, c_attention, c_moe, c_argmax, NULL, NULL, c_matmul_sparse, NULL, c_page_select, c_draw};

int qf_cpu_dec_compose_init(qf_backend *be, const qf_ops *base, size_t scratch_floats) {
    compose *c = calloc(1, sizeof *c);
    if (c) c->scratch = malloc(scratch_floats * sizeof(float));
    if (!c || !c->scratch) {
        free(c);
        return qf_fail(QF_ENOMEM, "out of memory (composed decode ops)");
    }
    c->ops = *base;
    c->ops.dec = &k_compose;
    c->cap = scratch_floats;
    be->ops = &c->ops;
    be->dev = c;
    return QF_OK;
}

void qf_cpu_dec_compose_free(qf_backend *be) {
    compose *c = CTX(be);
    if (!c) return;
    free(c->scratch);
    free(c);
    be->dev = NULL;
}
