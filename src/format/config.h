/* config.json (+ generation_config.json) of a Qwen3.5/3.6 checkpoint -> qf_config. */
#ifndef QF_FORMAT_CONFIG_H
#define QF_FORMAT_CONFIG_H

#include <stddef.h>

#include "base/numeric.h"

#define QF_MAX_LAYERS 256
#define QF_MAX_EOS    8

enum qf_arch { QF_ARCH_QWEN35 = 1, QF_ARCH_QWEN35_MOE = 2 };
enum qf_layer_kind { QF_LAYER_LINEAR = 0, QF_LAYER_FULL = 1 };

typedef struct qf_config {
    int arch;
    char model_type[64];
    int n_layers, hidden, vocab;
    unsigned char layer_kind[QF_MAX_LAYERS];
    float norm_eps;
    int tie_embeddings;
    /* gated full attention */
    int n_heads, n_kv_heads, head_dim, rot_dim;
    double rope_theta;
    /* Gated DeltaNet */
    int lin_k_heads, lin_v_heads, lin_k_dim, lin_v_dim, conv_kernel;
    /* MLP: MoE or dense SwiGLU */
    int n_experts, n_experts_used, expert_ffn, shared_ffn, dense_ffn;
    int max_pos;
    /* generation */
    int eos_ids[QF_MAX_EOS], n_eos;
    float gen_temperature, gen_top_p;
    int gen_top_k;
    int mtp_layers; /* mtp_num_hidden_layers: the MTP head's decoder layers (docs/model-spec.md §8; 0: none) */
    char quant_method[16]; /* quantization_config.quant_method: "fp8", "qflash" or "" (none) */
} qf_config;

/* Reads dir/config.json and, when present, dir/generation_config.json. Errors name the file and
 * the field; another model_type is QF_EUNSUPPORTED naming it. */
int qf_config_load(qf_config *cfg, const char *dir);
/* dir/config_flash.json: the expert buffer (streaming_buffer_size, MB), the sparsity level
 * (sparsity_level, 0..1) and its per-layer schedule (sparsity_schedule: ["layer_1-10:0.3", ...],
 * layers from 1, ranges may run past the model's layers). Absent file: all unset. An error names
 * the file and the field: a value out of range, a malformed or overlapping range, an unknown key. */
#define QF_MAX_SPARSITY_RANGES 64
/* Trunk activation groups whose inputs sparsity masks, and the calibrated sparsity grid 0.1..0.9. */
enum { QF_ACT_MIX_IN, QF_ACT_MIX_OUT, QF_ACT_SH_IN, QF_ACT_SH_DOWN, QF_ACT_GROUPS };
#define QF_TRUNK_GRID 9
typedef struct qf_flash_config {
    size_t buffer_bytes;  /* 0: none */
    float sparsity_level; /* -1: not set */
    int n_ranges;
    struct {
        int first, last; /* layers, from 0, inclusive */
        float level;
    } ranges[QF_MAX_SPARSITY_RANGES];
    int trunk_layers; /* trunk_thresholds: [layers][QF_ACT_GROUPS][QF_TRUNK_GRID] (0: absent) */
    float trunk[QF_MAX_LAYERS][QF_ACT_GROUPS][QF_TRUNK_GRID];
    int kv_min_ctx; /* kv_page_min_context: the KV level acts from this context on (0: the default) */
} qf_flash_config;
int qf_flash_config_load(const char *dir, qf_flash_config *out);
/* Layer's level (from 0): its range's, else sparsity_level, else dflt. */
float qf_flash_config_level(const qf_flash_config *c, int layer, float dflt);
/* The same from config.json text (no generation_config); label names it in errors. */
int qf_config_parse(qf_config *cfg, const char *text, size_t len, const char *label);

/* A JSON file (or text) jansson could not load, as one error naming it: where it could not be
 * opened or read, why; where it does not parse, the line and column. */
struct json_error_t;
int qf_fail_json(const char *label, const struct json_error_t *e);

/* Derived sizes. */
static inline int qf_cfg_conv_dim(const qf_config *c) {
    return 2 * c->lin_k_heads * c->lin_k_dim + c->lin_v_heads * c->lin_v_dim;
}

#endif
