/* Synthetic models: the exact shapes of a real checkpoint (a built-in preset or any config.json),
 * weights generated in memory, deterministically, at the scale a trained model has; no file.
 * Binding goes through the same binder as a checkpoint: whatever tensor it asks for is made. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/dtype.h"
#include "base/hashmap.h"
#include "base/numeric.h"
#include "base/pool.h"
#include "base/quant.h"
#include "model/quantize.h"
#include "model/model_int.h"

/* Qwen3.6-35B-A3B's text_config (docs/model-spec.md §1.1). */
static const char QWEN36_35B_A3B[] =
    "{\"model_type\": \"qwen3_5_moe\", \"tie_word_embeddings\": false, \"text_config\": {"
    "\"model_type\": \"qwen3_5_moe_text\", \"hidden_size\": 2048, \"num_hidden_layers\": 40,"
    "\"full_attention_interval\": 4, \"num_attention_heads\": 16, \"num_key_value_heads\": 2, \"head_dim\": 256,"
    "\"linear_num_key_heads\": 16, \"linear_num_value_heads\": 32, \"linear_key_head_dim\": 128,"
    "\"linear_value_head_dim\": 128, \"linear_conv_kernel_dim\": 4, \"num_experts\": 256, \"num_experts_per_tok\": 8,"
    "\"moe_intermediate_size\": 512, \"shared_expert_intermediate_size\": 512, \"rms_norm_eps\": 1e-6,"
    "\"max_position_embeddings\": 262144, \"vocab_size\": 248320, \"eos_token_id\": 248046,"
    "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 10000000, \"partial_rotary_factor\": 0.25}}}";

typedef struct preset {
    const char *name, *json;
} preset;

static const preset PRESETS[] = {{"qwen3.6-35b-a3b", QWEN36_35B_A3B}, {"qwen3.5-35b-a3b", QWEN36_35B_A3B}};

const char *qf_synth_presets(void) { return "qwen3.6-35b-a3b, qwen3.5-35b-a3b"; }

const char *qf_synth_preset_json(const char *name) {
    for (size_t i = 0; i < sizeof PRESETS / sizeof *PRESETS; i++)
        if (name && strcmp(name, PRESETS[i].name) == 0) return PRESETS[i].json;
    return NULL;
}

/* ---- deterministic fill, in parallel ---- */

enum { CHUNK = 1 << 16 };
enum fill_kind { FILL_UNIFORM, FILL_CONST, FILL_A_LOG, FILL_DT_BIAS };

typedef struct fill {
    void *data;
    int dtype, kind;
    int64_t n;
    float scale; /* uniform half-width, or the constant */
    uint64_t seed;
} fill;

static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float draw(const fill *f, uint64_t *st) {
    *st += 0x9e3779b97f4a7c15ull;
    float u = (float)(mix(*st) >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
    switch (f->kind) {
    case FILL_CONST: return f->scale;
    case FILL_A_LOG: return logf(1.0f + 15.0f * u);        /* A in [1, 16), as HF initialises it */
    case FILL_DT_BIAS: {                                   /* softplus^-1 of dt in [0.001, 0.1) */
        float dt = expf(logf(0.001f) + u * (logf(0.1f) - logf(0.001f)));
        return logf(expm1f(dt));
    }
    default: return (2.0f * u - 1.0f) * f->scale;
    }
}

static void fill_task(void *ctx, int task) {
    const fill *f = ctx;
    int64_t i0 = (int64_t)task * CHUNK, i1 = i0 + CHUNK < f->n ? i0 + CHUNK : f->n;
    uint64_t st = mix(f->seed ^ (uint64_t)task * 0x632be59bd9b4e019ull); /* same values on any thread count */
    for (int64_t i = i0; i < i1; i++) {
        float x = draw(f, &st);
        if (f->dtype == QF_DT_F32) ((float *)f->data)[i] = x;
        else ((uint16_t *)f->data)[i] = qf_f32_to_bf16(x);
    }
}


static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* Trained-model scales: projections and embeddings with std 0.02 (HF's initializer_range), norms
 * at gain 1, the DeltaNet decay and step parameters as HF initialises them. */
static void plan(fill *f, const char *name, const int64_t *shape, int ndim) {
    f->dtype = QF_DT_BF16;
    f->kind = FILL_UNIFORM;
    f->scale = 0.02f * sqrtf(3.0f); /* uniform with std 0.02 */
    if (ends_with(name, "linear_attn.norm.weight")) f->kind = FILL_CONST, f->scale = 1.0f, f->dtype = QF_DT_F32;
    else if (ends_with(name, "norm.weight")) f->kind = FILL_CONST, f->scale = 0.0f; /* stored as w, used as 1 + w */
    else if (ends_with(name, "A_log")) f->kind = FILL_A_LOG, f->dtype = QF_DT_F32;
    else if (ends_with(name, "dt_bias")) f->kind = FILL_DT_BIAS;
    else if (ends_with(name, "conv1d.weight")) f->scale = 1.0f / sqrtf((float)shape[ndim - 1]);
}

/* Fused routed experts in a quantised format (U8 rows of blocks, as `qflash quantize` writes
 * them), drawn directly as codes: uniform codes under one scale (and minimum) a block span the
 * same uniform range, with the same std, as the bf16 experts' values, and cost a random byte each. */
typedef struct qfill {
    fill f;
    uint8_t *out;
    int fmt;
    int64_t rows, cols;
} qfill;

static void put_f16(uint8_t *p, float v) {
    uint16_t h = qf_f32_to_f16(v);
    p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

static void qfill_task(void *ctx, int task) {
    const qfill *q = ctx;
    int64_t per = CHUNK / q->cols > 0 ? CHUNK / q->cols : 1, r0 = (int64_t)task * per, r1 = r0 + per < q->rows ? r0 + per : q->rows;
    int64_t nb = q->cols / QF_Q_BLOCK, rb = (int64_t)qf_q_row_bytes(q->fmt, q->cols), head = q->fmt == QF_Q_I8B32 ? 2 * nb : 4 * nb;
    float a = q->f.scale; /* the uniform half-width */
    uint64_t st = mix(q->f.seed ^ (uint64_t)task * 0x632be59bd9b4e019ull);
    for (int64_t r = r0; r < r1; r++) {
        uint8_t *row = q->out + (size_t)r * (size_t)rb;
        for (int64_t b = 0; b < nb; b++) {
            put_f16(row + 2 * b, q->fmt == QF_Q_I8B32 ? a / 127.0f : 2.0f * a / 15.0f);
            if (q->fmt == QF_Q_I4B32) put_f16(row + 2 * nb + 2 * b, -a);
        }
        for (int64_t i = head; i < rb; i += 8) {
            st += 0x9e3779b97f4a7c15ull;
            uint64_t v = mix(st);
            for (int k = 0; k < 8 && i + k < rb; k++, v >>= 8) row[i + k] = q->fmt == QF_Q_I8B32 && (uint8_t)v == 0x80 ? 0x81 : (uint8_t)v;
        }
    }
}

/* A quantised weight of fmt, [rows, cols] or fused experts [E, rows, cols], as U8 rows of blocks. */
static const qf_st_tensor *synth_quant(qf_model *m, const char *name, int fmt, int ndim, const int64_t *shape) {
    int64_t cols = shape[ndim - 1], lead = ndim == 3 ? shape[0] : 1;
    qfill q = {{0}, NULL, fmt, lead * shape[ndim - 2], cols};
    plan(&q.f, name, shape, ndim);
    q.f.seed = qf_fnv1a(QF_HASH_START, name, strlen(name)) ^ m->synth_seed;
    if (q.cols % QF_Q_BLOCK) return qf_fail(QF_EINVAL, "synthetic %s weight %s: rows of %lld", qf_qfmt_name(q.fmt), name, (long long)q.cols), NULL;
    int64_t rb = (int64_t)qf_q_row_bytes(q.fmt, q.cols), qshape[3] = {shape[0], shape[1], rb};
    if (ndim == 2) qshape[1] = rb;
    if (!(q.out = malloc((size_t)(q.rows * rb)))) return NULL;
    int64_t per = CHUNK / q.cols > 0 ? CHUNK / q.cols : 1;
    int tasks = (int)((q.rows + per - 1) / per);
    if (m->synth_pool) qf_pool_run(m->synth_pool, qfill_task, &q, tasks);
    else
        for (int t = 0; t < tasks; t++) qfill_task(&q, t);
    if (qf_st_add_memory(&m->st, name, QF_DT_U8, ndim, qshape, q.out) != QF_OK) return NULL;
    return qf_st_find(&m->st, name);
}

const qf_st_tensor *qf_synth_tensor(qf_model *m, const char *name, int ndim, const int64_t *shape) {
    if (m->synth_experts && ndim == 3 && (ends_with(name, "mlp.experts.gate_up_proj") || ends_with(name, "mlp.experts.down_proj")))
        return synth_quant(m, name, m->synth_experts, 3, shape);
    if (m->synth_trunk && ndim == 2 && qf_quant_trunk_format(name, m->synth_trunk) == QF_Q_I8B32) return synth_quant(m, name, QF_Q_I8B32, 2, shape);
    fill f = {0};
    plan(&f, name, shape, ndim);
    f.n = 1;
    for (int i = 0; i < ndim; i++) f.n *= shape[i];
    f.seed = qf_fnv1a(QF_HASH_START, name, strlen(name)) ^ m->synth_seed;
    f.data = malloc((size_t)(f.n > 0 ? f.n : 1) * qf_dtype_size(f.dtype));
    if (!f.data) return NULL;
    int tasks = (int)((f.n + CHUNK - 1) / CHUNK);
    if (m->synth_pool) qf_pool_run(m->synth_pool, fill_task, &f, tasks);
    else
        for (int t = 0; t < tasks; t++) fill_task(&f, t);
    if (qf_st_add_memory(&m->st, name, f.dtype, ndim, shape, f.data) != QF_OK) return NULL;
    return qf_st_find(&m->st, name);
}

static int synth_config(qf_config *c, const qf_synth_opts *so) {
    if (so->config_file) {
        FILE *fp = fopen(so->config_file, "rb");
        if (!fp) return qf_fail(QF_EIO, "cannot open %s", so->config_file);
        char *text = malloc(1 << 20);
        size_t n = text ? fread(text, 1, (1 << 20) - 1, fp) : 0;
        fclose(fp);
        if (!text) return qf_fail(QF_ENOMEM, "out of memory");
        int rc = qf_config_parse(c, text, n, so->config_file);
        free(text);
        return rc;
    }
    for (size_t i = 0; i < sizeof PRESETS / sizeof *PRESETS; i++)
        if (so->preset && strcmp(so->preset, PRESETS[i].name) == 0)
            return qf_config_parse(c, PRESETS[i].json, strlen(PRESETS[i].json), PRESETS[i].name);
    return qf_fail(QF_EINVAL, "unknown synthetic model '%s' (known: %s, or --config FILE)", so->preset ? so->preset : "", qf_synth_presets());
}

int qf_model_synthetic(qf_model **out, const qf_synth_opts *so, const qf_load_opts *opts) {
    *out = NULL;
    qf_model *m = calloc(1, sizeof *m);
    if (!m) return qf_fail(QF_ENOMEM, "out of memory");
    int rc = synth_config(&m->cfg, so);
    if (rc == QF_OK && so->layers > 0 && so->layers < m->cfg.n_layers) m->cfg.n_layers = so->layers; /* same shapes, fewer layers */
    if (rc == QF_OK) {
        m->cfg.gen_temperature = 0.0f;
        snprintf(m->cfg.model_type + strlen(m->cfg.model_type), sizeof m->cfg.model_type - strlen(m->cfg.model_type), "%s", " (synthetic)");
        m->synth_seed = so->seed;
        m->synth_experts = so->experts;
        m->synth_trunk = so->trunk;
        m->cfg.mtp_layers = so->mtp ? 1 : 0; /* the preset names none: the head is asked for */
        if (so->experts && so->experts != QF_Q_I8B32 && so->experts != QF_Q_I4B32)
            rc = qf_fail(QF_EINVAL, "synthetic experts are bf16, int8 or int4 (not %s)", qf_qfmt_name(so->experts));
        if (so->trunk && so->trunk != QF_Q_I8B32) rc = qf_fail(QF_EINVAL, "a synthetic trunk is bf16 or int8 (not %s)", qf_qfmt_name(so->trunk));
        if (rc == QF_OK) rc = qf_model_check_limits(&m->cfg);
    }
    if (rc == QF_OK) {
        m->synth_pool = qf_pool_create(qf_cpu_count()); /* NULL: filled on this thread */
        rc = qf_model_bind(m, opts, qf_synth_tensor);
        qf_pool_destroy(m->synth_pool);
        m->synth_pool = NULL;
    }
    if (rc == QF_OK) rc = qf_model_finish(m);
    if (rc != QF_OK) {
        qf_model_free(m);
        return rc;
    }
    *out = m;
    return QF_OK;
}
