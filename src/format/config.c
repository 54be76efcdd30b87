#include "format/config.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/err.h"

int qf_fail_json(const char *label, const json_error_t *e) {
    if (e->line < 1) { /* never parsed: jansson's text is "unable to open PATH: REASON" or a read error */
        const char *why = strrchr(e->text, ':');
        return qf_fail(QF_EIO, "%s: cannot be read (%s)", label, why && why[1] ? why + 2 : e->text);
    }
    return qf_fail(QF_EFORMAT, "%s: %s (line %d, column %d)", label, e->text, e->line, e->column);
}

typedef struct reader {
    const char *path;
    json_t *obj;
    int rc;
} reader;

/* Required integer field; records the first failure in r->rc. */
static int get_int(reader *r, const char *key, int def, int required) {
    json_t *v = json_object_get(r->obj, key);
    if (!v || json_is_null(v)) {
        if (required && r->rc == QF_OK) r->rc = qf_fail(QF_EFORMAT, "%s: missing field \"%s\"", r->path, key);
        return def;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > (1 << 30)) {
        if (r->rc == QF_OK) r->rc = qf_fail(QF_EFORMAT, "%s: field \"%s\" must be a non-negative integer", r->path, key);
        return def;
    }
    return (int)json_integer_value(v);
}

static double get_num(reader *r, json_t *obj, const char *key, double def) {
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return def;
    if (!json_is_number(v)) {
        if (r->rc == QF_OK) r->rc = qf_fail(QF_EFORMAT, "%s: field \"%s\" must be a number", r->path, key);
        return def;
    }
    return json_number_value(v);
}

/* A number that must lie in [lo, hi] (lo_open: (lo, hi]). */
static void check_range(reader *r, const char *key, double v, double lo, double hi, int lo_open) {
    if (r->rc == QF_OK && (!(lo_open ? v > lo : v >= lo) || !(v <= hi)))
        r->rc = qf_fail(QF_EFORMAT, "%s: field \"%s\" is %g; it must be %s %g and at most %g", r->path, key, v, lo_open ? "above" : "at least", lo, hi);
}

static int read_layer_types(reader *r, qf_config *c) {
    json_t *lt = json_object_get(r->obj, "layer_types");
    if (lt && json_is_array(lt)) {
        if ((int)json_array_size(lt) != c->n_layers)
            return qf_fail(QF_EFORMAT, "%s: layer_types has %zu entries for %d layers", r->path, json_array_size(lt), c->n_layers);
        for (int i = 0; i < c->n_layers; i++) {
            const char *s = json_string_value(json_array_get(lt, (size_t)i));
            if (s && strcmp(s, "linear_attention") == 0) c->layer_kind[i] = QF_LAYER_LINEAR;
            else if (s && strcmp(s, "full_attention") == 0) c->layer_kind[i] = QF_LAYER_FULL;
            else return qf_fail(QF_EFORMAT, "%s: layer_types[%d] is \"%s\"", r->path, i, s ? s : "(not a string)");
        }
        return QF_OK;
    }
    int interval = get_int(r, "full_attention_interval", 4, 0);
    if (interval < 1) return qf_fail(QF_EFORMAT, "%s: full_attention_interval must be >= 1", r->path);
    for (int i = 0; i < c->n_layers; i++) c->layer_kind[i] = (i + 1) % interval == 0 ? QF_LAYER_FULL : QF_LAYER_LINEAR;
    return QF_OK;
}

/* rope_parameters (new) or rope_theta/partial_rotary_factor at the top (old). mrope sections
 * do not matter for text-only input: all three position streams are equal. */
static void read_rope(reader *r, qf_config *c) {
    json_t *rp = json_object_get(r->obj, "rope_parameters");
    if (!json_is_object(rp)) rp = r->obj;
    c->rope_theta = get_num(r, rp, "rope_theta", get_num(r, r->obj, "rope_theta", 10000000.0));
    double partial = get_num(r, rp, "partial_rotary_factor", get_num(r, r->obj, "partial_rotary_factor", 1.0));
    check_range(r, "rope_theta", c->rope_theta, 0, 1e12, 1);
    check_range(r, "partial_rotary_factor", partial, 0, 1, 1);
    c->rot_dim = (int)lround(c->head_dim * partial);
    if (c->rot_dim % 2 || c->rot_dim > c->head_dim || c->rot_dim <= 0)
        if (r->rc == QF_OK) r->rc = qf_fail(QF_EFORMAT, "%s: partial_rotary_factor %g gives an unusable rotary dim %d", r->path, partial, c->rot_dim);
}

static int read_text_config(reader *r, qf_config *c) {
    c->n_layers = get_int(r, "num_hidden_layers", 0, 1);
    c->hidden = get_int(r, "hidden_size", 0, 1);
    c->vocab = get_int(r, "vocab_size", 0, 1);
    c->n_heads = get_int(r, "num_attention_heads", 0, 1);
    c->n_kv_heads = get_int(r, "num_key_value_heads", c->n_heads, 0);
    c->head_dim = get_int(r, "head_dim", c->n_heads ? c->hidden / c->n_heads : 0, 0);
    c->lin_k_heads = get_int(r, "linear_num_key_heads", 0, 1);
    c->lin_v_heads = get_int(r, "linear_num_value_heads", 0, 1);
    c->lin_k_dim = get_int(r, "linear_key_head_dim", 0, 1);
    c->lin_v_dim = get_int(r, "linear_value_head_dim", 0, 1);
    c->conv_kernel = get_int(r, "linear_conv_kernel_dim", 4, 0);
    c->max_pos = get_int(r, "max_position_embeddings", 32768, 0);
    c->norm_eps = (float)get_num(r, r->obj, "rms_norm_eps", 1e-6);
    check_range(r, "max_position_embeddings", c->max_pos, 0, 1 << 30, 1);
    check_range(r, "rms_norm_eps", c->norm_eps, 0, 0.1, 1);
    if (c->arch == QF_ARCH_QWEN35_MOE) {
        c->n_experts = get_int(r, "num_experts", 0, 1);
        c->n_experts_used = get_int(r, "num_experts_per_tok", 0, 1);
        c->expert_ffn = get_int(r, "moe_intermediate_size", 0, 1);
        c->shared_ffn = get_int(r, "shared_expert_intermediate_size", 0, 1);
        c->mtp_layers = get_int(r, "mtp_num_hidden_layers", 0, 0);
    } else {
        c->dense_ffn = get_int(r, "intermediate_size", 0, 1);
    }
    if (r->rc != QF_OK) return r->rc;
    if (c->n_layers < 1 || c->n_layers > QF_MAX_LAYERS) return qf_fail(QF_EFORMAT, "%s: num_hidden_layers %d out of range 1..%d", r->path, c->n_layers, QF_MAX_LAYERS);
    if (c->head_dim > QF_MAX_HEAD_DIM) return qf_fail(QF_EUNSUPPORTED, "%s: head_dim %d is over %d", r->path, c->head_dim, QF_MAX_HEAD_DIM);
    if (!c->hidden || !c->vocab || !c->n_heads || !c->n_kv_heads || c->n_heads % c->n_kv_heads || !c->head_dim)
        return qf_fail(QF_EFORMAT, "%s: inconsistent attention sizes (heads %d, kv heads %d, head_dim %d)", r->path, c->n_heads, c->n_kv_heads, c->head_dim);
    if (!c->lin_k_heads || !c->lin_v_heads || c->lin_v_heads % c->lin_k_heads || !c->lin_k_dim || !c->lin_v_dim || c->conv_kernel < 1)
        return qf_fail(QF_EFORMAT, "%s: inconsistent linear-attention sizes", r->path);
    if (c->arch == QF_ARCH_QWEN35_MOE && (!c->n_experts || !c->n_experts_used || c->n_experts_used > c->n_experts || !c->expert_ffn))
        return qf_fail(QF_EFORMAT, "%s: inconsistent MoE sizes (experts %d, top-k %d)", r->path, c->n_experts, c->n_experts_used);
    read_rope(r, c);
    if (r->rc != QF_OK) return r->rc;
    return read_layer_types(r, c);
}

/* eos_token_id: an id or a list of ids (absent or null: none). */
static int add_eos(qf_config *c, json_t *v, const char *path) {
    if (!v || json_is_null(v)) return QF_OK;
    if (json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < (1 << 30)) {
        int id = (int)json_integer_value(v);
        for (int i = 0; i < c->n_eos; i++)
            if (c->eos_ids[i] == id) return QF_OK;
        if (c->n_eos < QF_MAX_EOS) c->eos_ids[c->n_eos++] = id;
        return QF_OK;
    }
    if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++)
            if (json_is_array(json_array_get(v, i)) || add_eos(c, json_array_get(v, i), path) != QF_OK)
                return qf_fail(QF_EFORMAT, "%s: field \"eos_token_id\" must be a token id or a list of token ids", path);
        return QF_OK;
    }
    return qf_fail(QF_EFORMAT, "%s: field \"eos_token_id\" must be a token id or a list of token ids", path);
}

/* An optional file of the model directory as a JSON object into *out (NULL when it is absent);
 * present, it must parse. */
static int load_optional(const char *path, json_t **out) {
    *out = NULL;
    if (access(path, F_OK) != 0) return QF_OK;
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    if (!j) return qf_fail_json(path, &jerr);
    if (!json_is_object(j)) {
        json_decref(j);
        return qf_fail(QF_EFORMAT, "%s: not a JSON object", path);
    }
    *out = j;
    return QF_OK;
}

/* Optional; when present it must parse, and its sampling defaults must be ones a request could
 * set (the server's ranges), or every request that leaves them out would be refused. */
static int read_generation_config(qf_config *c, const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    json_t *g;
    int rc = load_optional(path, &g);
    if (rc != QF_OK || !g) return rc;
    json_t *eos = json_object_get(g, "eos_token_id");
    if (eos) c->n_eos = 0; /* generation_config governs stopping */
    reader r = {path, g, add_eos(c, eos, path)};
    c->gen_temperature = (float)get_num(&r, g, "temperature", c->gen_temperature);
    c->gen_top_p = (float)get_num(&r, g, "top_p", c->gen_top_p);
    check_range(&r, "temperature", c->gen_temperature, 0, 2, 0);
    check_range(&r, "top_p", c->gen_top_p, 0, 1, 1);
    json_t *tk = json_object_get(g, "top_k");
    if (tk && !json_is_null(tk) && !(json_is_integer(tk) && json_integer_value(tk) >= -1 && json_integer_value(tk) < (1 << 30)) && r.rc == QF_OK)
        r.rc = qf_fail(QF_EFORMAT, "%s: field \"top_k\" must be an integer, -1 or more", path);
    if (json_is_integer(tk)) c->gen_top_k = (int)json_integer_value(tk);
    json_decref(g);
    return r.rc;
}

/* quantization_config: the official block-FP8 layout (quant_method fp8, e4m3, 128 x 128 blocks) or
 * qflash's own (quant_method qflash, written by `qflash quantize`); which tensors are quantised is
 * read from each tensor's dtype at bind time. */
static int read_quant(qf_config *c, json_t *root, json_t *obj, const char *path) {
    json_t *q = json_object_get(root, "quantization_config");
    if (!q) q = json_object_get(obj, "quantization_config");
    if (!q || json_is_null(q)) return QF_OK;
    const char *m = json_string_value(json_object_get(q, "quant_method"));
    if (!json_is_object(q) || !m) return qf_fail(QF_EFORMAT, "%s: quantization_config has no quant_method", path);
    snprintf(c->quant_method, sizeof c->quant_method, "%s", m);
    if (!strcmp(m, "qflash")) return QF_OK;
    if (strcmp(m, "fp8"))
        return qf_fail(QF_EUNSUPPORTED, "%s: quantization_config.quant_method \"%s\" is not supported (qflash reads fp8 and its own qflash)", path, m);
    const char *fmt = json_string_value(json_object_get(q, "fmt"));
    if (fmt && strcmp(fmt, "e4m3"))
        return qf_fail(QF_EUNSUPPORTED, "%s: quantization_config.fmt \"%s\" is not supported (e4m3 only)", path, fmt);
    json_t *bs = json_object_get(q, "weight_block_size");
    if (!json_is_array(bs) || json_array_size(bs) != 2 || json_integer_value(json_array_get(bs, 0)) != 128 ||
        json_integer_value(json_array_get(bs, 1)) != 128)
        return qf_fail(QF_EUNSUPPORTED, "%s: quantization_config.weight_block_size must be [128, 128]", path);
    return QF_OK;
}

static int from_root(qf_config *c, json_t *root, const char *path) {
    memset(c, 0, sizeof *c);
    c->gen_temperature = 1.0f;
    c->gen_top_p = 1.0f;
    int rc = QF_OK;
    json_t *text = json_object_get(root, "text_config");
    json_t *obj = json_is_object(text) ? text : root;
    const char *mt = json_string_value(json_object_get(root, "model_type"));
    if (!json_is_object(root) || !mt) rc = qf_fail(QF_EFORMAT, "%s: no \"model_type\"", path);
    else {
        snprintf(c->model_type, sizeof c->model_type, "%s", mt);
        if (!strcmp(mt, "qwen3_5_moe") || !strcmp(mt, "qwen3_5_moe_text")) c->arch = QF_ARCH_QWEN35_MOE;
        else if (!strcmp(mt, "qwen3_5") || !strcmp(mt, "qwen3_5_text")) c->arch = QF_ARCH_QWEN35;
        else rc = qf_fail(QF_EUNSUPPORTED, "%s: model_type \"%s\" is not supported (qflash runs qwen3_5 and qwen3_5_moe)", path, mt);
    }
    if (rc == QF_OK) {
        reader r = {path, obj, QF_OK};
        rc = read_text_config(&r, c);
        json_t *tie = json_object_get(root, "tie_word_embeddings");
        if (!tie) tie = json_object_get(obj, "tie_word_embeddings");
        c->tie_embeddings = json_is_true(tie);
        if (rc == QF_OK) rc = add_eos(c, json_object_get(obj, "eos_token_id"), path);
        if (rc == QF_OK && !c->n_eos) rc = add_eos(c, json_object_get(root, "eos_token_id"), path);
        if (rc == QF_OK) rc = read_quant(c, root, obj, path);
    }
    return rc;
}

int qf_config_load(qf_config *c, const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) return qf_fail_json(path, &jerr);
    int rc = from_root(c, root, path);
    json_decref(root);
    if (rc == QF_OK) rc = read_generation_config(c, dir);
    return rc;
}

/* "layer_A-B:L" or "layer_A:L" (layers from 1, inclusive) into r (0-based); 0 when malformed. */
static int parse_range(const char *t, int *first, int *last, double *level) {
    int a, b, n = 0;
    double l;
    if (sscanf(t, "layer_%d-%d:%lf%n", &a, &b, &l, &n) == 3 && t[n] == 0) {
    } else if (n = 0, sscanf(t, "layer_%d:%lf%n", &a, &l, &n) == 2 && t[n] == 0) {
        b = a;
    } else {
        return 0;
    }
    *first = a - 1, *last = b - 1, *level = l;
    return a >= 1 && b >= a && b <= QF_MAX_LAYERS * 64;
}

/* sparsity_schedule: a list of ranges, each level in 0..1, no two ranges sharing a layer. */
static void read_schedule(reader *r, json_t *v, qf_flash_config *c) {
    if (!json_is_array(v) || json_array_size(v) > QF_MAX_SPARSITY_RANGES) {
        r->rc = qf_fail(QF_EFORMAT, "%s: field \"sparsity_schedule\" must be a list of at most %d strings like \"layer_1-10:0.3\"", r->path,
                        QF_MAX_SPARSITY_RANGES);
        return;
    }
    for (size_t i = 0; i < json_array_size(v) && r->rc == QF_OK; i++) {
        json_t *e = json_array_get(v, i);
        int a, b;
        double l;
        if (!json_is_string(e) || !parse_range(json_string_value(e), &a, &b, &l)) {
            r->rc = qf_fail(QF_EFORMAT, "%s: sparsity_schedule[%zu] must read \"layer_FIRST-LAST:LEVEL\" (layers from 1)", r->path, i);
            break;
        }
        if (!(l >= 0 && l <= 1)) r->rc = qf_fail(QF_EFORMAT, "%s: sparsity_schedule[%zu] has level %g; levels are 0 to 1", r->path, i, l);
        for (int j = 0; j < c->n_ranges && r->rc == QF_OK; j++)
            if (a <= c->ranges[j].last && b >= c->ranges[j].first)
                r->rc = qf_fail(QF_EFORMAT, "%s: sparsity_schedule[%zu] (layers %d-%d) overlaps sparsity_schedule[%d] (layers %d-%d)", r->path, i, a + 1, b + 1,
                                j, c->ranges[j].first + 1, c->ranges[j].last + 1);
        c->ranges[c->n_ranges].first = a, c->ranges[c->n_ranges].last = b, c->ranges[c->n_ranges].level = (float)l;
        c->n_ranges++;
    }
}

/* trunk_thresholds: [layers][QF_ACT_GROUPS][QF_TRUNK_GRID] non-negative numbers, each row
 * non-decreasing (a larger sparsity never has a smaller threshold). */
static void read_trunk(reader *r, json_t *v, qf_flash_config *c) {
    size_t L = json_is_array(v) ? json_array_size(v) : 0;
    if (!L || L > QF_MAX_LAYERS) {
        r->rc = qf_fail(QF_EFORMAT, "%s: field \"trunk_thresholds\" must be a list of 1 to %d layers (qflash calibrate writes it)", r->path, QF_MAX_LAYERS);
        return;
    }
    for (size_t l = 0; l < L && r->rc == QF_OK; l++) {
        json_t *layer = json_array_get(v, l);
        for (int g = 0; g < QF_ACT_GROUPS && r->rc == QF_OK; g++) {
            json_t *row = json_is_array(layer) && json_array_size(layer) == QF_ACT_GROUPS ? json_array_get(layer, g) : NULL;
            for (int i = 0; i < QF_TRUNK_GRID && r->rc == QF_OK; i++) {
                json_t *t = json_is_array(row) && json_array_size(row) == QF_TRUNK_GRID ? json_array_get(row, i) : NULL;
                double x = json_is_number(t) ? json_number_value(t) : -1;
                if (!(x >= 0 && x < 1e30) || (i && x < c->trunk[l][g][i - 1]))
                    r->rc = qf_fail(QF_EFORMAT, "%s: trunk_thresholds[%zu][%d] must be %d non-negative, non-decreasing numbers (%d groups a layer)", r->path, l, g,
                                    QF_TRUNK_GRID, QF_ACT_GROUPS);
                else c->trunk[l][g][i] = (float)x;
            }
        }
    }
    if (r->rc == QF_OK) c->trunk_layers = (int)L;
}

int qf_flash_config_load(const char *dir, qf_flash_config *out) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config_flash.json", dir);
    memset(out, 0, sizeof *out);
    out->sparsity_level = -1;
    json_t *j;
    int rc = load_optional(path, &j);
    if (rc != QF_OK || !j) return rc;
    reader r = {path, j, QF_OK};
    const char *key;
    json_t *v;
    json_object_foreach(j, key, v) {
        if (r.rc != QF_OK) break;
        if (strcmp(key, "streaming_buffer_size") == 0) {
            double mb = get_num(&r, j, key, 0);
            if (!json_is_null(v)) check_range(&r, key, mb, 0, nextafter(1e9, 0), 1); /* below a petabyte */
            if (r.rc == QF_OK) out->buffer_bytes = (size_t)(mb * 1048576.0);
        } else if (strcmp(key, "sparsity_level") == 0) {
            double l = get_num(&r, j, key, -1);
            if (!json_is_null(v)) check_range(&r, key, l, 0, 1, 0);
            if (r.rc == QF_OK) out->sparsity_level = (float)l;
        } else if (strcmp(key, "sparsity_schedule") == 0) {
            read_schedule(&r, v, out);
        } else if (strcmp(key, "trunk_thresholds") == 0) {
            read_trunk(&r, v, out);
        } else if (strcmp(key, "kv_page_min_context") == 0) {
            double t = get_num(&r, j, key, 0);
            if (!json_is_null(v)) check_range(&r, key, t, 1, 1 << 30, 0);
            if (r.rc == QF_OK) out->kv_min_ctx = (int)t;
        } else {
            r.rc = qf_fail(QF_EFORMAT,
                           "%s: unknown field \"%s\" (known: streaming_buffer_size, sparsity_level, sparsity_schedule, trunk_thresholds, "
                           "kv_page_min_context)",
                           path, key);
        }
    }
    json_decref(j);
    return r.rc;
}

float qf_flash_config_level(const qf_flash_config *c, int layer, float dflt) {
    for (int i = 0; i < c->n_ranges; i++)
        if (layer >= c->ranges[i].first && layer <= c->ranges[i].last) return c->ranges[i].level;
    return c->sparsity_level >= 0 ? c->sparsity_level : dflt;
}

int qf_config_parse(qf_config *c, const char *text, size_t len, const char *label) {
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    if (!root) return qf_fail_json(label, &jerr);
    int rc = from_root(c, root, label);
    json_decref(root);
    return rc;
}
