/* Binding Hugging Face tensor names to qf_model fields: the one place that knows checkpoint
 * names. Every tensor is checked for dtype and shape; with a diag sink every problem is reported
 * and binding continues, so `qflash verify` can list them all. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/dtype.h"
#include "base/numeric.h"
#include "base/quant.h"
#include "model/model_int.h"

typedef struct binder {
    qf_model *m;
    const char *prefix; /* "model.language_model." or "model." */
    qf_diag *diag;
    int rc;
    qf_make_tensor_fn make; /* synthetic model: a tensor that is not there is made by it (NULL: never) */
    qf_expert *experts;     /* [n_layers][n_experts] views, handed to the expert store at the end */
    char first[512]; /* the first problem, which is what a caller without a diag sink sees */
} binder;

static void problem(binder *b, int code) {
    if (b->rc == QF_OK) {
        b->rc = code;
        snprintf(b->first, sizeof b->first, "%s", qf_last_error());
    }
    qf_diag_report(b->diag);
}

static void shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    buf[0] = 0;
    for (int i = 0; i < ndim; i++) snprintf(buf + strlen(buf), cap - strlen(buf), "%s%lld", i ? ", " : "", (long long)shape[i]);
}

static int same_shape(const qf_st_tensor *t, int ndim, const int64_t *shape) {
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    return ok;
}

static void bad_shape(binder *b, const qf_st_tensor *t, int ndim, const int64_t *shape, const char *why) {
    char want[128], got[128];
    shape_str(want, sizeof want, ndim, shape), shape_str(got, sizeof got, t->ndim, t->shape);
    problem(b, qf_fail(QF_EFORMAT, "tensor '%s' has shape [%s], expected [%s]%s", t->name, got, want, why));
}

/* The tensor, made when missing and a maker is set; NULL (reported) when absent. */
static const qf_st_tensor *find(binder *b, const char *name, int ndim, const int64_t *shape) {
    const qf_st_tensor *t = qf_st_find(&b->m->st, name);
    if (!t && b->make && !(t = b->make(b->m, name, ndim, shape))) {
        problem(b, QF_ENOMEM);
        return NULL;
    }
    if (!t) problem(b, qf_fail(QF_EFORMAT, "missing tensor '%s'", name));
    return t;
}

static int float_dtype(int dt) { return dt == QF_DT_BF16 || dt == QF_DT_F16 || dt == QF_DT_F32; }

/* A tensor of floats (BF16, F16 or F32) of exactly this shape. */
static const qf_st_tensor *need(binder *b, const char *name, int ndim, const int64_t *shape) {
    const qf_st_tensor *t = find(b, name, ndim, shape);
    if (!t) return NULL;
    if (!same_shape(t, ndim, shape)) {
        bad_shape(b, t, ndim, shape, "");
        return NULL;
    }
    if (!float_dtype(t->dtype)) {
        problem(b, qf_fail(QF_EFORMAT, "tensor '%s' has dtype %s; it must be BF16, F16 or F32", name, qf_dtype_name(t->dtype)));
        return NULL;
    }
    return t;
}

static float to_f32(const qf_st_tensor *t, int64_t i) {
    const unsigned char *p = (const unsigned char *)t->data + (size_t)i * qf_dtype_size(t->dtype);
    float x;
    uint16_t h;
    if (t->dtype == QF_DT_F32) {
        memcpy(&x, p, 4);
        return x;
    }
    memcpy(&h, p, 2);
    return t->dtype == QF_DT_BF16 ? qf_bf16_to_f32(h) : qf_f16_to_f32(h);
}

/* The weight format of matrices [lead x] rows x cols stored in t: as stored (BF16, F16, F32), the
 * official F8_E4M3 (2-D, with block scales beside it), or qflash's blocked int8 / int4 (U8 rows of
 * blocks, the format told by the row's bytes). 0 (reported) when t is none of them. */
static int mat_format(binder *b, const qf_st_tensor *t, int64_t lead, int64_t rows, int64_t cols) {
    int nd = lead ? 3 : 2;
    int64_t shape[3] = {lead, rows, cols}, *sh = lead ? shape : shape + 1;
    if (float_dtype(t->dtype) || t->dtype == QF_DT_F8_E4M3) {
        if (!same_shape(t, nd, sh)) return bad_shape(b, t, nd, sh, ""), 0;
        if (t->dtype == QF_DT_F8_E4M3 && lead)
            return problem(b, qf_fail(QF_EUNSUPPORTED, "tensor '%s': F8_E4M3 experts are read one by one (mlp.experts.N.*), not fused", t->name)), 0;
        return t->dtype;
    }
    if (t->dtype == QF_DT_U8 && cols % QF_Q_BLOCK == 0) {
        int64_t *last = &sh[nd - 1];
        for (int f = QF_Q_I8B32; f <= QF_Q_I4B32; f++) {
            *last = (int64_t)qf_q_row_bytes(f, cols);
            if (same_shape(t, nd, sh)) return f;
        }
        char why[160];
        snprintf(why, sizeof why, " (qflash int8 rows of %lld weights are %zu bytes, int4 %zu)", (long long)cols, qf_q_row_bytes(QF_Q_I8B32, cols),
                 qf_q_row_bytes(QF_Q_I4B32, cols));
        return bad_shape(b, t, nd, sh, why), 0;
    }
    problem(b, qf_fail(QF_EFORMAT, "tensor '%s' has dtype %s; weights must be BF16, F16, F32, F8_E4M3 (with block scales) or qflash's U8 blocks of %lld-wide rows",
                       t->name, qf_dtype_name(t->dtype), (long long)cols));
    return 0;
}

/* An F8_E4M3 weight's `<name>_scale_inv`: one finite, non-negative scale per 128 x 128 block
 * (BF16, F16 or F32), converted to fp32. */
static const float *fp8_scales(binder *b, const char *name, int64_t rows, int64_t cols) {
    char sn[600];
    snprintf(sn, sizeof sn, "%s_scale_inv", name);
    const qf_st_tensor *t = qf_st_find(&b->m->st, sn);
    int64_t shape[2] = {(rows + QF_FP8_BLOCK - 1) / QF_FP8_BLOCK, (cols + QF_FP8_BLOCK - 1) / QF_FP8_BLOCK};
    if (!t) return problem(b, qf_fail(QF_EFORMAT, "missing tensor '%s' (the block scales of the F8_E4M3 weight '%s')", sn, name)), NULL;
    if (!float_dtype(t->dtype))
        return problem(b, qf_fail(QF_EFORMAT, "tensor '%s' has dtype %s; block scales must be BF16, F16 or F32", sn, qf_dtype_name(t->dtype))), NULL;
    if (!same_shape(t, 2, shape)) {
        char why[200];
        snprintf(why, sizeof why, ": one scale per 128 x 128 block of '%s' [%lld, %lld]", name, (long long)rows, (long long)cols);
        return bad_shape(b, t, 2, shape, why), NULL;
    }
    float *v = malloc((size_t)t->n_elem * sizeof *v);
    if (qf_model_own(b->m, v) != QF_OK) return problem(b, QF_ENOMEM), NULL;
    for (int64_t i = 0; i < t->n_elem; i++)
        if (!((v[i] = to_f32(t, i)) >= 0.0f) || isinf(v[i]))
            return problem(b, qf_fail(QF_EFORMAT, "tensor '%s': block scale %lld is %g (must be finite and >= 0)", sn, (long long)i, (double)v[i])), NULL;
    return v;
}

int qf_model_keep_dev(qf_model *m, void *p) {
    void **nb = realloc(m->dev_bufs, (size_t)(m->n_dev_bufs + 1) * sizeof *nb);
    if (!nb) return qf_fail(QF_ENOMEM, "out of memory");
    m->dev_bufs = nb;
    m->dev_bufs[m->n_dev_bufs++] = p;
    return QF_OK;
}

int qf_model_own(qf_model *m, void *p) {
    if (!p) return qf_fail(QF_ENOMEM, "out of memory");
    if (m->n_owned == m->cap_owned) {
        int cap = m->cap_owned ? m->cap_owned * 2 : 64;
        void **o = realloc(m->owned, (size_t)cap * sizeof *o);
        if (!o) {
            free(p);
            return qf_fail(QF_ENOMEM, "out of memory");
        }
        m->owned = o;
        m->cap_owned = cap;
    }
    m->owned[m->n_owned++] = p;
    return QF_OK;
}

/* A matrix view straight into the map; copied only if the file misaligns it. */
static qf_mat mat_from(binder *b, const qf_st_tensor *t, int fmt, int64_t rows, int64_t cols, size_t byte_off) {
    qf_mat w = {fmt, (const unsigned char *)t->data + byte_off, rows, cols, NULL};
    size_t es = qf_dtype_size(fmt) ? qf_dtype_size(fmt) : 1;
    if ((uintptr_t)w.data % es) {
        void *copy = malloc(qf_mat_bytes(&w));
        if (copy) memcpy(copy, w.data, qf_mat_bytes(&w));
        if (qf_model_own(b->m, copy) != QF_OK) {
            problem(b, QF_ENOMEM);
            return (qf_mat){0};
        }
        w.data = copy;
    }
    return w;
}

static qf_mat bind_mat(binder *b, const char *name, int64_t rows, int64_t cols) {
    int64_t shape[2] = {rows, cols};
    const qf_st_tensor *t = find(b, name, 2, shape);
    int fmt = t ? mat_format(b, t, 0, rows, cols) : 0;
    if (!fmt) return (qf_mat){0};
    qf_mat w = mat_from(b, t, fmt, rows, cols, 0);
    if (fmt == QF_DT_F8_E4M3 && !(w.scales = fp8_scales(b, name, rows, cols))) return (qf_mat){0};
    return w;
}

/* A small tensor converted to fp32, optionally transformed (1 + w, -exp(w)). */
enum vec_fn { VEC_PLAIN, VEC_PLUS1, VEC_NEG_EXP };

static float *bind_vec(binder *b, const char *name, int ndim, const int64_t *shape, enum vec_fn fn) {
    const qf_st_tensor *t = need(b, name, ndim, shape);
    if (!t) return NULL;
    float *v = malloc((size_t)t->n_elem * sizeof *v);
    if (qf_model_own(b->m, v) != QF_OK) {
        problem(b, QF_ENOMEM);
        return NULL;
    }
    for (int64_t i = 0; i < t->n_elem; i++) {
        float x = to_f32(t, i);
        v[i] = fn == VEC_PLUS1 ? 1.0f + x : fn == VEC_NEG_EXP ? -expf(x) : x;
    }
    return v;
}

static float *bind_vec1(binder *b, const char *name, int64_t n, enum vec_fn fn) { return bind_vec(b, name, 1, &n, fn); }

/* Layer-local name: prefix + "layers.L." + suffix. */
static const char *lname(binder *b, int L, const char *suffix, char *buf, size_t cap) {
    snprintf(buf, cap, "%slayers.%d.%s", b->prefix, L, suffix);
    return buf;
}

static void bind_full_attn(binder *b, qf_layer_w *w, int L) {
    const qf_config *c = &b->m->cfg;
    char n[256];
    int64_t hd = c->head_dim, H = c->hidden;
    w->wq = bind_mat(b, lname(b, L, "self_attn.q_proj.weight", n, sizeof n), c->n_heads * 2 * hd, H);
    w->wk = bind_mat(b, lname(b, L, "self_attn.k_proj.weight", n, sizeof n), c->n_kv_heads * hd, H);
    w->wv = bind_mat(b, lname(b, L, "self_attn.v_proj.weight", n, sizeof n), c->n_kv_heads * hd, H);
    w->wo = bind_mat(b, lname(b, L, "self_attn.o_proj.weight", n, sizeof n), H, c->n_heads * hd);
    w->q_norm = bind_vec1(b, lname(b, L, "self_attn.q_norm.weight", n, sizeof n), hd, VEC_PLUS1);
    w->k_norm = bind_vec1(b, lname(b, L, "self_attn.k_norm.weight", n, sizeof n), hd, VEC_PLUS1);
}

static void bind_linear_attn(binder *b, qf_layer_w *w, int L) {
    const qf_config *c = &b->m->cfg;
    char n[256];
    int64_t H = c->hidden, vdim = (int64_t)c->lin_v_heads * c->lin_v_dim, cd = qf_cfg_conv_dim(c);
    w->w_qkv = bind_mat(b, lname(b, L, "linear_attn.in_proj_qkv.weight", n, sizeof n), cd, H);
    w->w_z = bind_mat(b, lname(b, L, "linear_attn.in_proj_z.weight", n, sizeof n), vdim, H);
    w->w_b = bind_mat(b, lname(b, L, "linear_attn.in_proj_b.weight", n, sizeof n), c->lin_v_heads, H);
    w->w_a = bind_mat(b, lname(b, L, "linear_attn.in_proj_a.weight", n, sizeof n), c->lin_v_heads, H);
    w->w_out = bind_mat(b, lname(b, L, "linear_attn.out_proj.weight", n, sizeof n), H, vdim);
    int64_t conv_shape[3] = {cd, 1, c->conv_kernel};
    w->conv_w = bind_vec(b, lname(b, L, "linear_attn.conv1d.weight", n, sizeof n), 3, conv_shape, VEC_PLAIN);
    w->dt_bias = bind_vec1(b, lname(b, L, "linear_attn.dt_bias", n, sizeof n), c->lin_v_heads, VEC_PLAIN);
    w->neg_A = bind_vec1(b, lname(b, L, "linear_attn.A_log", n, sizeof n), c->lin_v_heads, VEC_NEG_EXP);
    w->gnorm = bind_vec1(b, lname(b, L, "linear_attn.norm.weight", n, sizeof n), c->lin_v_dim, VEC_PLAIN);
}

/* Routed experts: fused [E, 2I, H] + [E, H, I] (release layout, gate rows first), or per expert
 * mlp.experts.E.{gate,up,down}_proj.weight (transformers save_pretrained). */
static void bind_experts(binder *b, int L) {
    const qf_config *c = &b->m->cfg;
    char n[256];
    int64_t E = c->n_experts, I = c->expert_ffn, H = c->hidden;
    if (qf_st_find(&b->m->st, lname(b, L, "mlp.experts.gate_up_proj", n, sizeof n)) || b->make) {
        int64_t gu_shape[3] = {E, 2 * I, H}, d_shape[3] = {E, H, I};
        const qf_st_tensor *gu = find(b, n, 3, gu_shape);
        const qf_st_tensor *dn = find(b, lname(b, L, "mlp.experts.down_proj", n, sizeof n), 3, d_shape);
        int fg = gu ? mat_format(b, gu, E, 2 * I, H) : 0, fd = dn ? mat_format(b, dn, E, H, I) : 0;
        if (!fg || !fd) return;
        qf_mat g1 = {fg, NULL, I, H, NULL}, d1 = {fd, NULL, H, I, NULL};
        size_t gb = qf_mat_bytes(&g1), db = qf_mat_bytes(&d1);
        for (int64_t e = 0; e < E; e++) {
            qf_expert x;
            x.gate = mat_from(b, gu, fg, I, H, (size_t)(2 * e) * gb);
            x.up = mat_from(b, gu, fg, I, H, (size_t)(2 * e + 1) * gb);
            x.down = mat_from(b, dn, fd, H, I, (size_t)e * db);
            b->experts[(int64_t)L * E + e] = x;
        }
        return;
    }
    for (int64_t e = 0; e < E; e++) {
        char s[128];
        qf_expert x;
        snprintf(s, sizeof s, "mlp.experts.%lld.gate_proj.weight", (long long)e);
        x.gate = bind_mat(b, lname(b, L, s, n, sizeof n), I, H);
        snprintf(s, sizeof s, "mlp.experts.%lld.up_proj.weight", (long long)e);
        x.up = bind_mat(b, lname(b, L, s, n, sizeof n), I, H);
        snprintf(s, sizeof s, "mlp.experts.%lld.down_proj.weight", (long long)e);
        x.down = bind_mat(b, lname(b, L, s, n, sizeof n), H, I);
        b->experts[(int64_t)L * E + e] = x;
    }
}

static void bind_mlp(binder *b, qf_layer_w *w, int L) {
    const qf_config *c = &b->m->cfg;
    char n[256];
    int64_t H = c->hidden;
    if (c->arch == QF_ARCH_QWEN35) {
        w->gate = bind_mat(b, lname(b, L, "mlp.gate_proj.weight", n, sizeof n), c->dense_ffn, H);
        w->up = bind_mat(b, lname(b, L, "mlp.up_proj.weight", n, sizeof n), c->dense_ffn, H);
        w->down = bind_mat(b, lname(b, L, "mlp.down_proj.weight", n, sizeof n), H, c->dense_ffn);
        return;
    }
    w->router = bind_mat(b, lname(b, L, "mlp.gate.weight", n, sizeof n), c->n_experts, H);
    if (c->shared_ffn > 0) {
        w->sh_gate = bind_mat(b, lname(b, L, "mlp.shared_expert.gate_proj.weight", n, sizeof n), c->shared_ffn, H);
        w->sh_up = bind_mat(b, lname(b, L, "mlp.shared_expert.up_proj.weight", n, sizeof n), c->shared_ffn, H);
        w->sh_down = bind_mat(b, lname(b, L, "mlp.shared_expert.down_proj.weight", n, sizeof n), H, c->shared_ffn);
        w->sh_gate_w = bind_mat(b, lname(b, L, "mlp.shared_expert_gate.weight", n, sizeof n), 1, H);
    }
    bind_experts(b, L);
}

static void bind_globals(binder *b) {
    qf_model *m = b->m;
    const qf_config *c = &m->cfg;
    char n[256];
    snprintf(n, sizeof n, "%sembed_tokens.weight", b->prefix);
    m->embed = bind_mat(b, n, c->vocab, c->hidden);
    snprintf(n, sizeof n, "%snorm.weight", b->prefix);
    m->final_norm = bind_vec1(b, n, c->hidden, VEC_PLUS1);
    if (qf_st_find(&m->st, "lm_head.weight") || !c->tie_embeddings || b->make) m->lm_head = bind_mat(b, "lm_head.weight", c->vocab, c->hidden);
    else m->lm_head = m->embed;
}

/* Decoder layer L under the binder's prefix: its norms, its mixer of the given kind and its MLP. */
static void bind_layer(binder *b, qf_layer_w *w, int L, int kind) {
    char n[256];
    w->kind = kind;
    w->attn_norm = bind_vec1(b, lname(b, L, "input_layernorm.weight", n, sizeof n), b->m->cfg.hidden, VEC_PLUS1);
    w->ffn_norm = bind_vec1(b, lname(b, L, "post_attention_layernorm.weight", n, sizeof n), b->m->cfg.hidden, VEC_PLUS1);
    if (kind == QF_LAYER_FULL) bind_full_attn(b, w, L);
    else bind_linear_attn(b, w, L);
    bind_mlp(b, w, L);
}

/* The MTP head (docs/model-spec.md §8): mtp.fc, its three norms (zero-centred) and one full-attention
 * decoder layer with its MoE, bound through the same checks under the prefix "mtp."; the layer and
 * a one-layer expert store go into m->mtp, a view of m that shares its embeddings, lm_head and RoPE. */
static int bind_mtp(qf_model *m, const qf_load_opts *opts, qf_make_tensor_fn make) {
    const qf_config *c = &m->cfg;
    binder b = {m, "mtp.", opts ? opts->diag : NULL, QF_OK, make, NULL, ""};
    int64_t H = c->hidden;
    qf_model *v = calloc(1, sizeof *v);
    qf_layer_w *w = calloc(1, sizeof *w);
    if (qf_model_own(m, w) != QF_OK || !v || !(b.experts = calloc((size_t)c->n_experts, sizeof *b.experts))) {
        free(v);
        return qf_fail(QF_ENOMEM, "out of memory (MTP head)");
    }
    m->mtp_fc = bind_mat(&b, "mtp.fc.weight", H, 2 * H);
    m->mtp_norm_e = bind_vec1(&b, "mtp.pre_fc_norm_embedding.weight", H, VEC_PLUS1);
    m->mtp_norm_h = bind_vec1(&b, "mtp.pre_fc_norm_hidden.weight", H, VEC_PLUS1);
    v->final_norm = bind_vec1(&b, "mtp.norm.weight", H, VEC_PLUS1);
    bind_layer(&b, w, 0, QF_LAYER_FULL);
    if (b.rc == QF_OK && !(v->experts = qf_es_resident_create(1, c->n_experts, b.experts))) b.rc = qf_fail(QF_ENOMEM, "out of memory (MTP experts)");
    else if (b.rc != QF_OK) free(b.experts);
    if (b.rc != QF_OK) {
        free(v);
        return qf_fail(b.rc, "%s", b.first);
    }
    v->cfg = *c;
    v->cfg.n_layers = 1, v->cfg.layer_kind[0] = QF_LAYER_FULL, v->cfg.mtp_layers = 0;
    v->layers = w;
    m->mtp = v; /* embed, lm_head and inv_freq: qf_model_finish shares them */
    return QF_OK;
}

int qf_model_bind(qf_model *m, const qf_load_opts *opts, qf_make_tensor_fn make) {
    binder b = {m, NULL, opts ? opts->diag : NULL, QF_OK, make, NULL, ""};
    if (make) b.prefix = "model.language_model.";
    else if (qf_st_find(&m->st, "model.language_model.embed_tokens.weight")) b.prefix = "model.language_model.";
    else if (qf_st_find(&m->st, "model.embed_tokens.weight")) b.prefix = "model.";
    else {
        problem(&b, qf_fail(QF_EFORMAT, "missing tensor 'model.language_model.embed_tokens.weight' (nor 'model.embed_tokens.weight')"));
        return b.rc;
    }
    const qf_config *c = &m->cfg;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (qf_model_own(m, m->layers) != QF_OK) return QF_ENOMEM;
    if (c->arch == QF_ARCH_QWEN35_MOE && !(b.experts = calloc((size_t)c->n_layers * (size_t)c->n_experts, sizeof *b.experts)))
        return qf_fail(QF_ENOMEM, "out of memory (expert table)");
    bind_globals(&b);
    for (int L = 0; L < c->n_layers; L++) {
        bind_layer(&b, &m->layers[L], L, c->layer_kind[L]);
        if (opts && opts->progress) opts->progress(opts->progress_ud, L + 1, c->n_layers);
    }
    if (b.rc == QF_OK && b.experts && !(m->experts = qf_es_resident_create(c->n_layers, c->n_experts, b.experts)))
        b.rc = qf_fail(QF_ENOMEM, "out of memory (expert store)");
    else if (b.rc != QF_OK) {
        free(b.experts);
        qf_fail(b.rc, "%s", b.first);
    }
    if (b.rc == QF_OK && c->arch == QF_ARCH_QWEN35_MOE && c->mtp_layers > 0 && (make || qf_st_find(&m->st, "mtp.fc.weight"))) b.rc = bind_mtp(m, opts, make);
    return b.rc;
}
