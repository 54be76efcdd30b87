/* The model's forward pass written to be read: one sequence, every token from position 0, the MTP
 * head too, each formula of docs/model-spec.md in the order it states it, plain loops, fp32 values with double
 * sums, no backend, no workspace, no batching, nothing fused. It is the yardstick the fast
 * forward (forward.c, every backend) is tested against (tests/test_model.c), and the place to
 * look up what a layer computes. Slow by design: a weight element is decoded each time it is read. */
#include "model/ref_forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/rules.h"

typedef struct ref {
    const qf_model *m;
    const qf_config *c;
    int T;
    float *kbuf, *vbuf; /* one attention layer's keys and values of every position */
} ref;

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static float silu(float x) { return x * sigmoid(x); }
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* y[r] = sum_c W[r][c] x[c] for every row of W. */
static void matvec(const qf_mat *w, const float *x, float *y) {
    for (int64_t r = 0; r < w->rows; r++) {
        double s = 0;
        for (int64_t c = 0; c < w->cols; c++) s += (double)qf_mat_weight(w, r, c) * x[c];
        y[r] = (float)s;
    }
}

/* Zero-centred RMSNorm: g holds 1 + w (spec §3a); the plain gated one takes g = w (§3b). */
static void rmsnorm(const float *x, const float *g, int n, float eps, float *y) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * r * g[i];
}

static void l2norm(float *x, int n, float scale) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)ss + 1e-6f) * scale;
    for (int i = 0; i < n; i++) x[i] *= r;
}

/* Rotate-half RoPE on the first rot_dim dims of one head at position p (§4.2). */
static void rope(const ref *R, float *x, int p) {
    int half = R->c->rot_dim / 2;
    for (int i = 0; i < half; i++) {
        float th = (float)p * R->m->inv_freq[i], cs = cosf(th), sn = sinf(th), a = x[i], b = x[i + half];
        x[i] = a * cs - b * sn;
        x[i + half] = b * cs + a * sn;
    }
}

/* Gated full attention over the sequence (§4): xs [T][hidden] normed inputs, out [T][hidden]. */
static void attention(const ref *R, const qf_layer_w *l, const float *xs, float *out) {
    const qf_config *c = R->c;
    int H = c->hidden, nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim;
    float *qg = malloc((size_t)nh * 2 * hd * sizeof(float)), *q = malloc((size_t)R->T * nh * hd * sizeof(float));
    float *gate = malloc((size_t)R->T * nh * hd * sizeof(float)), *a = malloc((size_t)nh * hd * sizeof(float));
    float *sc = malloc((size_t)R->T * sizeof(float));
    for (int t = 0; t < R->T; t++) { /* projections, per-head norms, RoPE (§4.1, §4.2) */
        const float *x = xs + (size_t)t * H;
        matvec(&l->wq, x, qg);
        for (int h = 0; h < nh; h++) {
            float *qh = q + ((size_t)t * nh + h) * hd;
            rmsnorm(qg + (size_t)h * 2 * hd, l->q_norm, hd, c->norm_eps, qh);
            memcpy(gate + ((size_t)t * nh + h) * hd, qg + (size_t)h * 2 * hd + hd, (size_t)hd * sizeof(float));
            rope(R, qh, t);
        }
        float *k = R->kbuf + (size_t)t * nkv * hd, *v = R->vbuf + (size_t)t * nkv * hd;
        matvec(&l->wk, x, k);
        matvec(&l->wv, x, v);
        for (int g = 0; g < nkv; g++) rmsnorm(k + (size_t)g * hd, l->k_norm, hd, c->norm_eps, k + (size_t)g * hd), rope(R, k + (size_t)g * hd, t);
    }
    for (int t = 0; t < R->T; t++) { /* causal softmax attention, GQA, output gate (§4.3, §4.4) */
        for (int h = 0; h < nh; h++) {
            const float *qh = q + ((size_t)t * nh + h) * hd;
            int g = h / (nh / nkv);
            float mx = -INFINITY;
            for (int s = 0; s <= t; s++) {
                double d = 0;
                for (int i = 0; i < hd; i++) d += (double)qh[i] * R->kbuf[((size_t)s * nkv + g) * hd + i];
                sc[s] = (float)(d / sqrt((double)hd));
                mx = sc[s] > mx ? sc[s] : mx;
            }
            double sum = 0;
            for (int s = 0; s <= t; s++) sum += sc[s] = expf(sc[s] - mx);
            for (int i = 0; i < hd; i++) {
                double o = 0;
                for (int s = 0; s <= t; s++) o += sc[s] * R->vbuf[((size_t)s * nkv + g) * hd + i];
                a[(size_t)h * hd + i] = (float)(o / sum) * sigmoid(gate[((size_t)t * nh + h) * hd + i]);
            }
        }
        matvec(&l->wo, a, out + (size_t)t * H);
    }
    free(qg), free(q), free(gate), free(a), free(sc);
}

/* Causal depthwise conv of the K last pre-conv rows, then SiLU (§5.2): row t of mixed [T][C]. */
static void conv_silu(const ref *R, const qf_layer_w *l, const float *mixed, int C, int t, float *y) {
    int K = R->c->conv_kernel;
    for (int ch = 0; ch < C; ch++) {
        double s = 0;
        for (int j = 0; j < K; j++) {
            int src = t - (K - 1) + j; /* tap K - 1 is the current token */
            if (src >= 0) s += (double)l->conv_w[(size_t)ch * K + j] * mixed[(size_t)src * C + ch];
        }
        y[ch] = silu((float)s);
    }
}

/* Gated DeltaNet over the sequence (§5), the token-by-token rule of §5.6. */
static void deltanet(const ref *R, const qf_layer_w *l, const float *xs, float *out) {
    const qf_config *c = R->c;
    int H = c->hidden, nk = c->lin_k_heads, nv = c->lin_v_heads, dk = c->lin_k_dim, dv = c->lin_v_dim;
    int C = 2 * nk * dk + nv * dv;
    float *mixed = malloc((size_t)R->T * C * sizeof(float)), *y = malloc((size_t)C * sizeof(float));
    float *z = malloc((size_t)nv * dv * sizeof(float)), *b = malloc((size_t)nv * sizeof(float)), *a = malloc((size_t)nv * sizeof(float));
    float *S = calloc((size_t)nv * dk * dv, sizeof(float)), *o = malloc((size_t)nv * dv * sizeof(float)), *u = malloc((size_t)dv * sizeof(float));
    for (int t = 0; t < R->T; t++) matvec(&l->w_qkv, xs + (size_t)t * H, mixed + (size_t)t * C);
    for (int t = 0; t < R->T; t++) {
        const float *x = xs + (size_t)t * H;
        conv_silu(R, l, mixed, C, t, y);
        matvec(&l->w_z, x, z), matvec(&l->w_b, x, b), matvec(&l->w_a, x, a);
        for (int h = 0; h < nk; h++) l2norm(y + (size_t)h * dk, dk, 1.0f / sqrtf((float)dk)), l2norm(y + (size_t)(nk + h) * dk, dk, 1.0f);
        for (int h = 0; h < nv; h++) {
            const float *q = y + (size_t)(h / (nv / nk)) * dk, *k = y + (size_t)(nk + h / (nv / nk)) * dk, *v = y + (size_t)2 * nk * dk + (size_t)h * dv;
            float beta = sigmoid(b[h]), decay = expf(l->neg_A[h] * softplus(a[h] + l->dt_bias[h]));
            float *Sh = S + (size_t)h * dk * dv; /* [i key][j value] */
            for (int i = 0; i < dk * dv; i++) Sh[i] *= decay;
            for (int j = 0; j < dv; j++) {
                double m = 0;
                for (int i = 0; i < dk; i++) m += (double)Sh[(size_t)i * dv + j] * k[i];
                u[j] = beta * (v[j] - (float)m);
            }
            for (int i = 0; i < dk; i++)
                for (int j = 0; j < dv; j++) Sh[(size_t)i * dv + j] += k[i] * u[j];
            for (int j = 0; j < dv; j++) {
                double r = 0;
                for (int i = 0; i < dk; i++) r += (double)Sh[(size_t)i * dv + j] * q[i];
                o[(size_t)h * dv + j] = (float)r;
            }
            rmsnorm(o + (size_t)h * dv, l->gnorm, dv, c->norm_eps, o + (size_t)h * dv); /* gated norm (§5.8): plain gamma, then the gate */
            for (int j = 0; j < dv; j++) o[(size_t)h * dv + j] *= silu(z[(size_t)h * dv + j]);
        }
        matvec(&l->w_out, o, out + (size_t)t * H);
    }
    free(mixed), free(y), free(z), free(b), free(a), free(S), free(o), free(u);
}

/* One SwiGLU expert: y = down . (silu(gate . x) * (up . x)). */
static void swiglu(const qf_mat *gate, const qf_mat *up, const qf_mat *down, const float *x, float *y) {
    float *g = malloc((size_t)gate->rows * sizeof(float)), *u = malloc((size_t)up->rows * sizeof(float));
    matvec(gate, x, g), matvec(up, x, u);
    for (int64_t i = 0; i < gate->rows; i++) g[i] = silu(g[i]) * u[i];
    matvec(down, g, y);
    free(g), free(u);
}

/* The MoE block of one row (§6): softmax routing, top-k renormalised, the shared expert gated. */
static int moe(const ref *R, int L, const qf_layer_w *l, const float *x, float *out) {
    const qf_config *c = R->c;
    int H = c->hidden, E = c->n_experts, K = c->n_experts_used, ti[64];
    float *logits = malloc((size_t)E * sizeof(float)), *y = malloc((size_t)H * sizeof(float)), tw[64], sg;
    int rc = logits && y && K <= 64 ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    if (rc == QF_OK) matvec(&l->router, x, logits), qf_ref_route(logits, E, K, ti, tw);
    memset(out, 0, (size_t)H * sizeof(float));
    for (int j = 0; j < K && rc == QF_OK; j++) {
        qf_expert ex;
        rc = R->m->experts->ops->acquire(R->m->experts, L, ti[j], &ex);
        if (rc != QF_OK) break;
        swiglu(&ex.gate, &ex.up, &ex.down, x, y);
        R->m->experts->ops->release(R->m->experts, L, ti[j]);
        for (int i = 0; i < H; i++) out[i] += tw[j] * y[i];
    }
    if (rc == QF_OK && c->shared_ffn > 0) {
        swiglu(&l->sh_gate, &l->sh_up, &l->sh_down, x, y);
        matvec(&l->sh_gate_w, x, &sg);
        for (int i = 0; i < H; i++) out[i] += sigmoid(sg) * y[i];
    }
    free(logits), free(y);
    return rc;
}

/* h += mixer(norm(h)) for every row, then h += mlp(norm(h)) (§7.1). */
static int layer(ref *R, int L, float *h, float *xs, float *t) {
    const qf_config *c = R->c;
    const qf_layer_w *l = &R->m->layers[L];
    int H = c->hidden, rc = QF_OK;
    for (int r = 0; r < R->T; r++) rmsnorm(h + (size_t)r * H, l->attn_norm, H, c->norm_eps, xs + (size_t)r * H);
    if (l->kind == QF_LAYER_FULL) attention(R, l, xs, t);
    else deltanet(R, l, xs, t);
    for (size_t i = 0; i < (size_t)R->T * H; i++) h[i] += t[i];
    for (int r = 0; r < R->T && rc == QF_OK; r++) {
        const float *x = xs + (size_t)r * H;
        rmsnorm(h + (size_t)r * H, l->ffn_norm, H, c->norm_eps, xs + (size_t)r * H);
        if (c->n_experts > 0) rc = moe(R, L, l, x, t);
        else swiglu(&l->gate, &l->up, &l->down, x, t);
        for (int i = 0; i < H; i++) h[(size_t)r * H + i] += t[i];
    }
    return rc;
}

/* Every layer of m over the rows h ([T][hidden], positions 0..T-1), then the final norm into out. */
static int trunk(const qf_model *m, float *h, int T, float *out) {
    const qf_config *c = &m->cfg;
    int H = c->hidden, kv = c->n_kv_heads * c->head_dim;
    ref R = {m, c, T, malloc((size_t)T * kv * sizeof(float)), malloc((size_t)T * kv * sizeof(float))};
    float *xs = malloc((size_t)T * H * sizeof(float)), *t = malloc((size_t)T * H * sizeof(float));
    int rc = R.kbuf && R.vbuf && xs && t ? QF_OK : qf_fail(QF_ENOMEM, "out of memory for the reference forward of %d tokens", T);
    for (int L = 0; L < c->n_layers && rc == QF_OK; L++) rc = layer(&R, L, h, xs, t);
    for (int r = 0; r < T && rc == QF_OK; r++) rmsnorm(h + (size_t)r * H, m->final_norm, H, c->norm_eps, out + (size_t)r * H);
    free(R.kbuf), free(R.vbuf), free(xs), free(t);
    return rc;
}

static void embed(const qf_model *m, const int32_t *ids, int T, float *h) {
    int H = m->cfg.hidden;
    for (int r = 0; r < T; r++)
        for (int i = 0; i < H; i++) h[(size_t)r * H + i] = qf_mat_weight(&m->embed, ids[r], i);
}

static void lm_head(const qf_model *m, const float *normed, int T, float *logits) {
    for (int r = 0; r < T; r++) matvec(&m->lm_head, normed + (size_t)r * m->cfg.hidden, logits + (size_t)r * m->cfg.vocab);
}

int qf_model_ref_forward(const qf_model *m, const int32_t *ids, int T, float *logits) {
    if (m->dev) return qf_fail(QF_EUNSUPPORTED, "the reference forward reads weights in host memory");
    size_t n = (size_t)T * m->cfg.hidden;
    float *h = malloc(n * sizeof(float)), *normed = malloc(n * sizeof(float));
    int rc = h && normed ? QF_OK : qf_fail(QF_ENOMEM, "out of memory for the reference forward of %d tokens", T);
    if (rc == QF_OK) embed(m, ids, T, h), rc = trunk(m, h, T, normed);
    if (rc == QF_OK) lm_head(m, normed, T, logits);
    free(h), free(normed);
    return rc;
}

/* The MTP head (§8.2): pair t is (ids[t + 1], the model's final-normed state after ids[t]) at
 * position t; u = fc . [norm_e(embed(ids[t + 1])) | norm_h(h_t)] runs through the head's one
 * full-attention layer and MoE (m->mtp, a one-layer view), then its norm and the shared lm_head. */
int qf_model_ref_mtp(const qf_model *m, const int32_t *ids, int T, float *logits) {
    if (m->dev) return qf_fail(QF_EUNSUPPORTED, "the reference forward reads weights in host memory");
    if (!m->mtp) return qf_fail(QF_EINVAL, "the model has no MTP head");
    int H = m->cfg.hidden, P = T - 1;
    float *h = malloc((size_t)T * H * sizeof(float)), *hn = malloc((size_t)T * H * sizeof(float));
    float *pair = malloc((size_t)2 * H * sizeof(float)), *u = malloc((size_t)(P > 0 ? P : 1) * H * sizeof(float));
    int rc = h && hn && pair && u && P > 0 ? QF_OK : qf_fail(QF_ENOMEM, "out of memory for the reference MTP head (or fewer than 2 tokens)");
    if (rc == QF_OK) embed(m, ids, T, h), rc = trunk(m, h, T, hn);
    for (int t = 0; t < P && rc == QF_OK; t++) {
        embed(m, ids + t + 1, 1, h);
        rmsnorm(h, m->mtp_norm_e, H, m->cfg.norm_eps, pair);          /* the embedding first */
        rmsnorm(hn + (size_t)t * H, m->mtp_norm_h, H, m->cfg.norm_eps, pair + H); /* the hidden state second */
        matvec(&m->mtp_fc, pair, u + (size_t)t * H);
    }
    if (rc == QF_OK) rc = trunk(m->mtp, u, P, hn);
    if (rc == QF_OK) lm_head(m, hn, P, logits);
    free(h), free(hn), free(pair), free(u);
    return rc;
}
