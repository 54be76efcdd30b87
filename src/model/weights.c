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

static const qf_st_tensor *need(binder *b, const char *name, int ndim, const int64_t *shape) {
    const qf_st_tensor *t = qf_st_find(&b->m->st, name);
    if (!t && b->make && !(t = b->make(b->m, name, ndim, shape))) {
        problem(b, QF_ENOMEM);
        return NULL;
    }
    if (!t) {
        problem(b, qf_fail(QF_EFORMAT, "missing tensor '%s'", name));
        return NULL;
    }
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    if (!ok) {
        char want[128] = "", got[128] = "";
        for (int i = 0; i < ndim; i++) snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", i ? ", " : "", (long long)shape[i]);
        for (int i = 0; i < t->ndim; i++) snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        problem(b, qf_fail(QF_EFORMAT, "tensor '%s' has shape [%s], expected [%s]", name, got, want));
        return NULL;
    }
    if (t->dtype != QF_DT_BF16 && t->dtype != QF_DT_F16 && t->dtype != QF_DT_F32) {
        problem(b, qf_fail(QF_EFORMAT, "tensor '%s' has dtype %s; weights must be BF16, F16 or F32", name, qf_dtype_name(t->dtype)));
        return NULL;
    }
    return t;
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
static qf_mat mat_from(binder *b, const qf_st_tensor *t, int64_t rows, int64_t cols, size_t byte_off) {
    qf_mat w = {t->dtype, (const unsigned char *)t->data + byte_off, rows, cols};
    size_t es = qf_dtype_size(t->dtype);
    if ((uintptr_t)w.data % es) {
        void *copy = malloc((size_t)(rows * cols) * es);
        if (copy) memcpy(copy, w.data, (size_t)(rows * cols) * es);
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
    const qf_st_tensor *t = need(b, name, 2, shape);
    return t ? mat_from(b, t, rows, cols, 0) : (qf_mat){0};
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
    qf_mat w = {t->dtype, t->data, 1, t->n_elem};
    for (int64_t i = 0; i < t->n_elem; i++) {
        float x;
        const unsigned char *p = (const unsigned char *)w.data + (size_t)i * qf_dtype_size(t->dtype);
        uint16_t h;
        if (t->dtype == QF_DT_F32) memcpy(&x, p, 4);
        else {
            memcpy(&h, p, 2);
            x = t->dtype == QF_DT_BF16 ? qf_bf16_to_f32(h) : qf_f16_to_f32(h);
        }
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
        const qf_st_tensor *gu = need(b, n, 3, gu_shape);
        const qf_st_tensor *dn = need(b, lname(b, L, "mlp.experts.down_proj", n, sizeof n), 3, d_shape);
        if (!gu || !dn) return;
        size_t es_gu = qf_dtype_size(gu->dtype), es_dn = qf_dtype_size(dn->dtype);
        for (int64_t e = 0; e < E; e++) {
            qf_expert x;
            x.gate = mat_from(b, gu, I, H, (size_t)(e * 2 * I * H) * es_gu);
            x.up = mat_from(b, gu, I, H, (size_t)((e * 2 + 1) * I * H) * es_gu);
            x.down = mat_from(b, dn, H, I, (size_t)(e * H * I) * es_dn);
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
        qf_layer_w *w = &m->layers[L];
        char n[256];
        w->kind = c->layer_kind[L];
        w->attn_norm = bind_vec1(&b, lname(&b, L, "input_layernorm.weight", n, sizeof n), c->hidden, VEC_PLUS1);
        w->ffn_norm = bind_vec1(&b, lname(&b, L, "post_attention_layernorm.weight", n, sizeof n), c->hidden, VEC_PLUS1);
        if (w->kind == QF_LAYER_FULL) bind_full_attn(&b, w, L);
        else bind_linear_attn(&b, w, L);
        bind_mlp(&b, w, L);
        if (opts && opts->progress) opts->progress(opts->progress_ud, L + 1, c->n_layers);
    }
    if (b.rc == QF_OK && b.experts && !(m->experts = qf_es_resident_create(c->n_layers, c->n_experts, b.experts)))
        b.rc = qf_fail(QF_ENOMEM, "out of memory (expert store)");
    else if (b.rc != QF_OK) {
        free(b.experts);
        qf_fail(b.rc, "%s", b.first);
    }
    return b.rc;
}
