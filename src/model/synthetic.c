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
#include "model/model_int.h"

/* Qwen3.6-35B-A3B's text_config (shared/docs/model-spec.md §1.1). */
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

const qf_st_tensor *qf_synth_tensor(qf_model *m, const char *name, int ndim, const int64_t *shape) {
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
        rc = qf_model_check_limits(&m->cfg);
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
