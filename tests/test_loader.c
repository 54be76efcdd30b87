/* The loader and `qflash verify` on broken model directories built from the MoE fixture: each
 * must fail with a message naming the problem (and, for verify, exit 1), and a valid sharded copy
 * must load. argv[2] is the qflash binary. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <math.h>

#include "backend/rules.h"
#include "base/mapfile.h"
#include "base/quant.h"
#include "format/sha256.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "test_util.h"

static const char *qflash_bin;
static char tmp_root[256];
static json_t *orig_hdr;   /* the fixture's header */
static const unsigned char *orig_data;
static size_t orig_data_len;
static qf_mapfile orig;
static const char *cfg_from = "tests/data/qwen35moe-tiny"; /* whose config files make_dir copies */

static void write_bytes(const char *path, const void *a, size_t na, const void *b, size_t nb) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "FATAL: cannot write %s\n", path);
        exit(2);
    }
    fwrite(a, 1, na, f);
    if (nb) fwrite(b, 1, nb, f);
    fclose(f);
}

static void write_text(const char *path, const char *s) { write_bytes(path, s, strlen(s), NULL, 0); }

/* A fresh directory holding the fixture's config files. */
static const char *make_dir(const char *name) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmp_root, name);
    mkdir(path, 0755);
    const char *files[] = {"config.json", "generation_config.json"};
    for (int i = 0; i < 2; i++) {
        char *text, src[600], dst[600];
        snprintf(src, sizeof src, "%s/%s", cfg_from, files[i]);
        if (qf_read_file(qt_path(src), &text, NULL)) exit(2);
        snprintf(dst, sizeof dst, "%s/%s", path, files[i]);
        write_text(dst, text);
        free(text);
    }
    return path;
}

static void write_st_raw(const char *dir, const char *file, const char *hdr, size_t hlen, const void *data, size_t dlen) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    unsigned char *buf = malloc(8 + hlen);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    memcpy(buf + 8, hdr, hlen);
    write_bytes(path, buf, 8 + hlen, data, dlen);
    free(buf);
}

static void write_st(const char *dir, const char *file, json_t *hdr, const void *data, size_t dlen) {
    char *s = json_dumps(hdr, JSON_COMPACT);
    write_st_raw(dir, file, s, strlen(s), data, dlen);
    free(s);
}

/* Writes the tensors whose names satisfy keep() into one file with fresh offsets. */
static void write_subset(const char *dir, const char *file, int (*keep)(const char *), json_t *index_map) {
    json_t *h = json_object();
    unsigned char *data = malloc(orig_data_len);
    size_t off = 0;
    const char *k;
    json_t *v;
    json_object_foreach(orig_hdr, k, v) {
        if (!strcmp(k, "__metadata__") || !keep(k)) continue;
        json_t *o = json_deep_copy(v), *offs = json_object_get(v, "data_offsets");
        size_t b = (size_t)json_integer_value(json_array_get(offs, 0)), e = (size_t)json_integer_value(json_array_get(offs, 1));
        memcpy(data + off, orig_data + b, e - b);
        json_object_set_new(o, "data_offsets", json_pack("[II]", (json_int_t)off, (json_int_t)(off + e - b)));
        json_object_set_new(h, k, o);
        if (index_map) json_object_set_new(index_map, k, json_string(file));
        off += e - b;
    }
    write_st(dir, file, h, data, off);
    json_decref(h);
    free(data);
}

static int keep_all(const char *n) { return n != NULL; }
static int is_layer3(const char *n) { return strstr(n, "layers.3.") != NULL; }
static int not_layer3(const char *n) { return !is_layer3(n); }

/* Library load and `qflash verify` must both fail naming `want`. */
static void expect_failure(const char *dir, const char *want) {
    qf_model *m = NULL;
    int rc = qf_model_load(&m, dir, NULL);
    CHECK(rc != QF_OK && m == NULL, "%s: loaded although broken", dir);
    CHECK(strstr(qf_last_error(), want) != NULL, "%s: message '%s' lacks '%s'", dir, qf_last_error(), want);
    char cmd[1200], out[8192];
    snprintf(cmd, sizeof cmd, "'%s' verify --no-hash '%s' 2>&1", qflash_bin, dir);
    int status = qt_run_capture(cmd, out, sizeof out);
    CHECK(status == 1, "%s: verify exit status %d", dir, status);
    CHECK(strstr(out, want) && strstr(out, "problem: "), "%s: verify output lacks '%s':\n%s", dir, want, out);
}

static json_t *hdr_copy(void) { return json_deep_copy(orig_hdr); }
static json_t *entry(json_t *h, const char *suffix) {
    char name[256];
    snprintf(name, sizeof name, "model.language_model.layers.%s", suffix);
    return json_object_get(h, name);
}

static void case_truncated(void) {
    const char *d = make_dir("truncated");
    write_st_raw(d, "model.safetensors", (const char *)orig.data + 8, orig.size - 8 - orig_data_len, orig_data, orig_data_len - 128);
    expect_failure(d, "past the end of the data");
    expect_failure(d, "truncated/model.safetensors");
}

static void case_header_len(void) {
    const char *d = make_dir("header_len");
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    unsigned char *buf = malloc(orig.size);
    memcpy(buf, orig.data, orig.size);
    uint64_t bad = orig.size + 100;
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(bad >> (8 * i));
    write_bytes(path, buf, orig.size, NULL, 0);
    free(buf);
    expect_failure(d, "runs past the end of the file");
}

static void case_bad_json(void) {
    const char *d = make_dir("bad_json");
    write_st_raw(d, "model.safetensors", "{\"a\": [1, 2", 11, orig_data, orig_data_len);
    expect_failure(d, "header is not valid JSON");
}

/* The fixture's data under a changed header h (consumed), in a fresh directory; both the loader
 * and verify must fail naming want. */
static void expect_header_failure(const char *name, json_t *h, const char *want) {
    const char *d = make_dir(name);
    write_st(d, "model.safetensors", h, orig_data, orig_data_len);
    json_decref(h);
    expect_failure(d, want);
}

/* A copy of the fixture's header with one field of one layer tensor replaced. */
static json_t *with_field(const char *suffix, const char *key, json_t *value) {
    json_t *h = hdr_copy();
    json_object_set_new(entry(h, suffix), key, value);
    return h;
}

static void case_bad_headers(void) {
    json_t *offsets = json_object_get(entry(orig_hdr, "0.input_layernorm.weight"), "data_offsets");
    expect_header_failure("overlap", with_field("0.post_attention_layernorm.weight", "data_offsets", json_deep_copy(offsets)), "overlap");
    expect_header_failure("size_mismatch", with_field("0.input_layernorm.weight", "shape", json_pack("[i]", 129)),
                          "shape x dtype = 258 bytes but data_offsets span 256");
    expect_header_failure("unknown_dtype", with_field("0.input_layernorm.weight", "dtype", json_string("Q4_K")), "unknown dtype 'Q4_K'");
    expect_header_failure("wrong_shape", with_field("0.linear_attn.in_proj_qkv.weight", "shape", json_pack("[ii]", 128, 256)),
                          "has shape [128, 256], expected [256, 128]");
    json_t *h = hdr_copy();
    json_object_del(h, "model.language_model.layers.3.self_attn.k_norm.weight");
    expect_header_failure("missing_tensor", h, "missing tensor 'model.language_model.layers.3.self_attn.k_norm.weight'");
}

static void case_duplicate(void) {
    const char *d = make_dir("duplicate");
    char *s = json_dumps(orig_hdr, JSON_COMPACT);
    /* the same key twice: append a second copy of the first entry */
    const char *key = "\"lm_head.weight\":";
    char *at = strstr(s, key), *end = strchr(at, '}');
    size_t len = strlen(s);
    char *dup = malloc(len + (size_t)(end - at) + 8);
    memcpy(dup, s, len - 1);
    size_t o = len - 1;
    dup[o++] = ',';
    memcpy(dup + o, at, (size_t)(end - at) + 1);
    o += (size_t)(end - at) + 1;
    dup[o++] = '}';
    write_st_raw(d, "model.safetensors", dup, o, orig_data, orig_data_len);
    free(dup);
    free(s);
    expect_failure(d, "duplicate");
}

static void case_unsupported_type(void) {
    const char *d = make_dir("model_type");
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", d);
    write_text(path, "{\"model_type\": \"llama\", \"hidden_size\": 64}");
    write_subset(d, "model.safetensors", not_layer3, NULL);
    expect_failure(d, "model_type \"llama\" is not supported");
}

static void write_index(const char *dir, json_t *map) {
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    json_t *idx = json_pack("{s:{s:i}, s:O}", "metadata", "total_size", 0, "weight_map", map);
    json_dump_file(idx, path, 0);
    json_decref(idx);
}

static void case_sharded(void) {
    const char *d = make_dir("sharded");
    json_t *map = json_object();
    write_subset(d, "model-00001-of-00002.safetensors", not_layer3, map);
    write_subset(d, "model-00002-of-00002.safetensors", is_layer3, map);
    write_index(d, map);
    qf_model *m = NULL;
    CHECK(qf_model_load(&m, d, NULL) == QF_OK, "sharded load: %s", qf_last_error());
    CHECK(m && m->st.n_files == 2, "sharded: %d files", m ? m->st.n_files : 0);
    qf_model_free(m);
    /* the same index with the second shard gone */
    const char *d2 = make_dir("missing_shard");
    write_subset(d2, "model-00001-of-00002.safetensors", not_layer3, NULL);
    write_index(d2, map);
    json_decref(map);
    expect_failure(d2, "missing shard 'model-00002-of-00002.safetensors'");
}

static int run_verify(const char *args, char *out, size_t cap) {
    char cmd[1600];
    snprintf(cmd, sizeof cmd, "'%s' verify %s 2>&1", qflash_bin, args);
    return qt_run_capture(cmd, out, cap);
}

static void case_manifest(void) {
    char good[64], manifest[600], args[1400], out[8192], hex[65];
    snprintf(good, sizeof good, "%s", make_dir("manifest"));
    write_subset(good, "model.safetensors", not_layer3, NULL);
    write_subset(good, "model.safetensors", not_layer3, NULL);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", good);
    CHECK(qf_sha256_file(path, hex) == QF_OK, "%s", qf_last_error());
    snprintf(manifest, sizeof manifest, "%s/manifest.txt", tmp_root);
    char text[400];
    snprintf(text, sizeof text, "%s  config.json\n%064d  model.safetensors\n", hex, 0);
    write_text(manifest, text);
    snprintf(args, sizeof args, "'%s' --manifest '%s'", good, manifest);
    /* layer 3 is missing, and the weights' hash is wrong: both are reported, config.json is not */
    CHECK(run_verify(args, out, sizeof out) == 1, "verify passed:\n%s", out);
    CHECK(strstr(out, "model.safetensors: sha256") && strstr(out, "does not match the manifest"), "%s", out);
    CHECK(!strstr(out, "config.json: sha256"), "config.json reported:\n%s", out);
    CHECK(strstr(out, "missing tensor"), "%s", out);
    snprintf(args, sizeof args, "'%s'", qt_path("models/qwen36moe-code-14m"));
    CHECK(run_verify(args, out, sizeof out) == 0, "the bundled model fails verify:\n%s", out);
    CHECK(strstr(out, "OK: ") && strstr(out, "sha256 "), "%s", out);
    /* the random fixture has weights but no tokenizer: it loads, yet run and serve could not use it */
    snprintf(args, sizeof args, "--no-hash '%s'", qt_path("tests/data/qwen35moe-tiny"));
    CHECK(run_verify(args, out, sizeof out) == 1 && strstr(out, "tokenizer.json is missing"), "%s", out);
}

/* A fixture copy whose config.json (cfg 1) or generation_config.json (cfg 0) has key set to the
 * JSON value text; the load and verify must both fail naming want. */
static void bad_value(const char *name, int cfg, const char *key, const char *value, const char *want) {
    char dir[600], path[700], *text;
    snprintf(dir, sizeof dir, "%s", make_dir(name));
    write_subset(dir, "model.safetensors", keep_all, NULL);
    snprintf(path, sizeof path, "%s/%s", dir, cfg ? "config.json" : "generation_config.json");
    if (qf_read_file(path, &text, NULL)) exit(2);
    json_t *j = json_loads(text, 0, NULL), *v = json_loads(value, JSON_DECODE_ANY, NULL);
    json_t *obj = json_object_get(j, "text_config") ? json_object_get(j, "text_config") : j;
    if (!strncmp(key, "rope_", 5) || !strncmp(key, "partial_", 8)) /* where the loader reads them first */
        obj = json_object_get(obj, "rope_parameters") ? json_object_get(obj, "rope_parameters") : obj;
    json_object_set_new(obj, key, v);
    char *out = json_dumps(j, 0);
    write_text(path, out);
    free(out), free(text), json_decref(j);
    expect_failure(dir, want);
}

/* Values that load cleanly but break later (or never make sense) are refused at load, naming the
 * file and the field. */
static void case_config_values(void) {
    bad_value("rope_theta", 1, "rope_theta", "-1", "rope_theta");
    bad_value("eps", 1, "rms_norm_eps", "0", "rms_norm_eps");
    bad_value("max_pos", 1, "max_position_embeddings", "0", "max_position_embeddings");
    bad_value("partial", 1, "partial_rotary_factor", "2", "partial_rotary_factor");
    bad_value("eos_cfg", 1, "eos_token_id", "\"</s>\"", "eos_token_id");
    bad_value("gen_temp", 0, "temperature", "5", "generation_config.json: field \"temperature\"");
    bad_value("gen_top_p", 0, "top_p", "0", "generation_config.json: field \"top_p\"");
    bad_value("gen_top_k", 0, "top_k", "2.5", "generation_config.json: field \"top_k\"");
    bad_value("gen_eos", 0, "eos_token_id", "[1, \"x\"]", "generation_config.json: field \"eos_token_id\"");
    bad_value("quant_awq", 1, "quantization_config", "{\"quant_method\": \"awq\"}", "quantization_config.quant_method \"awq\" is not supported");
    bad_value("quant_block", 1, "quantization_config", "{\"quant_method\": \"fp8\", \"weight_block_size\": [64, 64]}",
              "quantization_config.weight_block_size must be [128, 128]");
    const char *d = make_dir("gen_malformed");
    char path[700];
    write_subset(d, "model.safetensors", keep_all, NULL);
    snprintf(path, sizeof path, "%s/generation_config.json", d);
    write_text(path, "{\"temperature\": 0.7,");
    expect_failure(d, "generation_config.json: string or '}' expected near end of file (line 1, column 20)");
    d = make_dir("no_config");
    write_subset(d, "model.safetensors", keep_all, NULL);
    snprintf(path, sizeof path, "%s/config.json", d);
    unlink(path);
    expect_failure(d, "no_config/config.json: cannot be read (No such file or directory)");
}

/* A fresh directory tmp_root/name with links to n files of the model directory from (a repository path). */
static void link_model(char *dir, size_t cap, const char *name, const char *from, const char *const *files, int n) {
    char src[4096], dst[1400], rel[700];
    snprintf(dir, cap, "%s/%s", tmp_root, name);
    mkdir(dir, 0755);
    for (int i = 0; i < n; i++) {
        snprintf(rel, sizeof rel, "%s/%s", from, files[i]);
        if (!realpath(qt_path(rel), src)) exit(2);
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        CHECK(symlink(src, dst) == 0, "symlink %s", dst);
    }
}

/* The bundled model with a chat template the engine does not take (an include, on line 3): verify
 * says it cannot be used and names the construct and line. */
static void case_bad_template(void) {
    char dir[600], dst[700];
    const char *files[] = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"};
    link_model(dir, sizeof dir, "bad_template", "models/qwen36moe-code-14m", files, 4);
    snprintf(dst, sizeof dst, "%s/tokenizer_config.json", dir);
    write_text(dst, "{\"chat_template\": \"{% for m in messages %}[{{ m.role }}] {{ m.content }}\\n{% endfor %}\\n{% include 'more.jinja' %}\"}");
    char args[800], out[8192];
    snprintf(args, sizeof args, "--no-hash '%s'", dir);
    CHECK(run_verify(args, out, sizeof out) == 1 && strstr(out, "chat template cannot be used") && strstr(out, "line 3: the statement 'include'"), "%s", out);
}

/* A config_flash.json whose schedule overlaps: verify names the field. */
static void case_bad_config_flash(void) {
    char dir[600], dst[700];
    const char *files[] = {"config.json", "model.safetensors"};
    link_model(dir, sizeof dir, "bad_flash", "tests/data/qwen35moe-tiny", files, 2);
    snprintf(dst, sizeof dst, "%s/config_flash.json", dir);
    write_text(dst, "{\"sparsity_schedule\": [\"layer_1-2:0.3\", \"layer_2-3:0.6\"]}");
    char args[800], out[8192];
    snprintf(args, sizeof args, "--no-hash '%s'", dir);
    CHECK(run_verify(args, out, sizeof out) == 1 && strstr(out, "problem: ") && strstr(out, "sparsity_schedule[1] (layers 2-3) overlaps"), "%s", out);
    write_text(dst, "{\"kv_page_min_context\": 0}");
    CHECK(run_verify(args, out, sizeof out) == 1 && strstr(out, "field \"kv_page_min_context\" is 0; it must be at least 1"), "%s", out);
}

/* A tokenizer with more ids than the model has rows: verify says so, and the engine refuses it. */
static void case_tokenizer_too_big(void) {
    const char *d = make_dir("tok_big");
    char path[700], *text;
    write_subset(d, "model.safetensors", keep_all, NULL);
    if (qf_read_file(qt_path("models/qwen36moe-code-14m/tokenizer.json"), &text, NULL)) exit(2);
    snprintf(path, sizeof path, "%s/tokenizer.json", d);
    write_text(path, text);
    free(text);
    char args[800], out[8192];
    snprintf(args, sizeof args, "--no-hash '%s'", d);
    CHECK(run_verify(args, out, sizeof out) == 1 && strstr(out, "more than the model's vocab_size 2048"), "%s", out);
    qf_engine *e = NULL;
    qf_engine_opts eo = {.n_threads = 1};
    CHECK(qf_engine_open(&e, d, &eo) != QF_OK && strstr(qf_last_error(), "vocab_size 2048"), "engine: %s", e ? "opened" : qf_last_error());
    qf_engine_close(e);
}

/* The official block-FP8 layout (tests/data/qwen35moe-tiny-fp8, made by tools/make_fp8_checkpoint.py
 * from the bf16 fixture): it loads, each FP8 weight is its bf16 original within half an e4m3 step,
 * and each broken variant is refused naming the tensor. */
static void fp8_variant(const char *name, json_t *h, const unsigned char *data, size_t len, const char *want) {
    const char *d = make_dir(name);
    write_st(d, "model.safetensors", h, data, len);
    json_decref(h);
    expect_failure(d, want);
}

/* The FP8 weights of qdir (n of: layer 1's expert 2 gate and down, then the trunk's w_qkv, wo,
 * sh_up) against bdir's bf16 ones. */
static void fp8_close_to_bf16(const char *qdir, const char *bdir, int n) {
    qf_model *q = NULL, *b = NULL;
    CHECK(qf_model_load(&q, qdir, NULL) == QF_OK, "%s loads: %s", qdir, qf_last_error());
    CHECK(qf_model_load(&b, bdir, NULL) == QF_OK, "%s loads", bdir);
    if (!q || !b) return qf_model_free(q), qf_model_free(b);
    qf_expert xq, xb;
    CHECK(q->experts->ops->acquire(q->experts, 1, 2, &xq) == QF_OK && b->experts->ops->acquire(b->experts, 1, 2, &xb) == QF_OK, "expert");
    const qf_mat *mq[] = {&xq.gate, &xq.down, &q->layers[0].w_qkv, &q->layers[3].wo, &q->layers[0].sh_up};
    const qf_mat *mb[] = {&xb.gate, &xb.down, &b->layers[0].w_qkv, &b->layers[3].wo, &b->layers[0].sh_up};
    CHECK(q->layers[0].router.dtype == QF_DT_BF16 && q->layers[0].w_a.dtype == QF_DT_BF16, "router and in_proj_a stay bf16");
    for (int i = 0; i < n; i++) {
        CHECK(mq[i]->dtype == QF_DT_F8_E4M3 && mq[i]->scales, "weight %d is F8_E4M3 with scales", i);
        int bad = 0;
        for (int64_t r = 0; r < mq[i]->rows; r++)
            for (int64_t c = 0; c < mq[i]->cols; c++) {
                float w = qf_mat_weight(mb[i], r, c), v = qf_mat_weight(mq[i], r, c);
                float sc = mq[i]->scales[(r / 128) * ((mq[i]->cols + 127) / 128) + c / 128];
                bad += !(fabsf(v - w) <= fabsf(w) / 16.0f + sc * 0x1p-10f);
            }
        CHECK(bad == 0, "fp8 weight %d: %d entries off their bf16 original by more than half an e4m3 step", i, bad);
    }
    qf_model_free(q), qf_model_free(b);
}

static void case_fp8(void) {
    fp8_close_to_bf16(qt_path("tests/data/qwen35moe-tiny-fp8"), qt_path("tests/data/qwen35moe-tiny"), 5);
    qf_mapfile f;
    int opened = qf_mapfile_open(&f, qt_path("tests/data/qwen35moe-tiny-fp8/model.safetensors")) == QF_OK;
    CHECK(opened, "fp8 fixture opens");
    if (!opened) return;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f.data[i];
    json_t *h0 = json_loadb((const char *)f.data + 8, hlen, 0, NULL);
    const unsigned char *data = f.data + 8 + hlen;
    size_t len = f.size - 8 - hlen;
    cfg_from = "tests/data/qwen35moe-tiny-fp8";
    const char *L = "model.language_model.layers.";
    char sc[200], wt[200];
    snprintf(sc, sizeof sc, "%s0.linear_attn.in_proj_qkv.weight_scale_inv", L);
    snprintf(wt, sizeof wt, "%s1.mlp.experts.3.up_proj.weight", L);
    json_t *h = json_deep_copy(h0);
    json_object_del(h, sc);
    fp8_variant("fp8_missing_scale", h, data, len, "missing tensor 'model.language_model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv'");
    h = json_deep_copy(h0);
    json_object_set_new(json_object_get(h, sc), "shape", json_pack("[ii]", 1, 2));
    fp8_variant("fp8_block_count", h, data, len, "in_proj_qkv.weight_scale_inv' has shape [1, 2], expected [2, 1]: one scale per 128 x 128 block");
    h = json_deep_copy(h0);
    json_object_set_new(json_object_get(h, sc), "dtype", json_string("I16"));
    fp8_variant("fp8_scale_dtype", h, data, len, "in_proj_qkv.weight_scale_inv' has dtype I16; block scales must be BF16, F16 or F32");
    h = json_deep_copy(h0);
    json_object_set_new(json_object_get(h, wt), "dtype", json_string("I8"));
    fp8_variant("fp8_weight_dtype", h, data, len, "experts.3.up_proj.weight' has dtype I8; weights must be BF16, F16, F32, F8_E4M3");
    json_decref(h0);
    qf_mapfile_close(&f);
    cfg_from = "tests/data/qwen35moe-tiny";
}

/* qflash quantize: a directory the loader reads whose int experts are, byte for byte, the
 * reference quantisation of the original's rows (the per-expert tiny fixture and the bundled
 * model's fused experts), whose trunk is int8 when asked (every fused decode product's matrix, the
 * router and in_proj_a too; the shared expert's down rows bf16; embeddings as stored), fp8 experts
 * within half a step, an FP8 input dequantised first, and a SHA256SUMS that verify accepts. */
static int quantize(const char *in, const char *out, const char *args) {
    char cmd[1600], o[8192];
    snprintf(cmd, sizeof cmd, "'%s' quantize -m '%s' -o '%s' %s -t 2 2>&1", qflash_bin, in, out, args);
    int st = qt_run_capture(cmd, o, sizeof o);
    CHECK(st == 0 && strstr(o, "wrote"), "quantize %s %s: status %d\n%s", in, args, st, o);
    return st;
}

static void int_rows_exact(const char *src, const char *qdir, int fmt, int trunk) {
    qf_model *b = NULL, *q = NULL;
    CHECK(qf_model_load(&b, src, NULL) == QF_OK && qf_model_load(&q, qdir, NULL) == QF_OK, "%s loads: %s", qdir, qf_last_error());
    if (!b || !q) return qf_model_free(b), qf_model_free(q);
    int bad = 0, mats = 0, E = b->cfg.n_experts;
    for (int L = 0; L < b->cfg.n_layers; L++)
        for (int e = 0; e < E; e += E / 4 > 0 ? E / 4 : 1) {
            qf_expert xb, xq;
            if (b->experts->ops->acquire(b->experts, L, e, &xb) != QF_OK || q->experts->ops->acquire(q->experts, L, e, &xq) != QF_OK) continue;
            const qf_mat *mb[3] = {&xb.gate, &xb.up, &xb.down}, *mq[3] = {&xq.gate, &xq.up, &xq.down};
            for (int i = 0; i < 3; i++, mats++) {
                size_t rb = qf_q_row_bytes(fmt, mb[i]->cols);
                float *row = malloc((size_t)mb[i]->cols * sizeof *row);
                unsigned char *want = malloc(rb);
                bad += mq[i]->dtype != fmt;
                for (int64_t r = 0; r < mb[i]->rows && mq[i]->dtype == fmt; r++) {
                    for (int64_t c = 0; c < mb[i]->cols; c++) row[c] = qf_mat_weight(mb[i], r, c);
                    qf_q_quantize_row(fmt, row, mb[i]->cols, want);
                    bad += memcmp(want, (const unsigned char *)mq[i]->data + r * rb, rb) != 0;
                }
                free(row), free(want);
            }
        }
    CHECK(bad == 0 && mats > 0, "%s: %d of the rows of %d expert matrices are not the reference %s quantisation", qdir, bad, mats, qf_qfmt_name(fmt));
    const qf_layer_w *w0 = &q->layers[0];
    int want_trunk = trunk ? QF_Q_I8B32 : QF_DT_BF16;
    CHECK(w0->sh_up.dtype == want_trunk && (w0->kind == QF_LAYER_FULL ? w0->wq.dtype : w0->w_qkv.dtype) == want_trunk, "%s: trunk format", qdir);
    CHECK(w0->router.dtype == want_trunk && w0->sh_gate_w.dtype == want_trunk && (w0->kind == QF_LAYER_FULL || w0->w_a.dtype == want_trunk),
          "%s: the router, the shared gate logit and in_proj_a join the trunk's format", qdir);
    CHECK(w0->sh_down.dtype == QF_DT_BF16 && q->embed.dtype == QF_DT_BF16 && q->lm_head.dtype == QF_DT_BF16, "%s: shared down, embeddings, lm_head bf16", qdir);
    qf_model_free(b), qf_model_free(q);
}

static void case_quantize(void) {
    char out[600], cmd[1600], o[8192];
    const char *tiny = qt_path("tests/data/qwen35moe-tiny"), *big = qt_path("models/qwen36moe-code-14m");
    struct { const char *args; int fmt, trunk; } c[] = {{"--experts int8", QF_Q_I8B32, 0}, {"--experts int4 --trunk int8", QF_Q_I4B32, 1}};
    for (int i = 0; i < 2; i++) {
        snprintf(out, sizeof out, "%s/quant_tiny_%d", tmp_root, i);
        if (quantize(tiny, out, c[i].args) == 0) int_rows_exact(tiny, out, c[i].fmt, c[i].trunk);
        snprintf(out, sizeof out, "%s/quant_big_%d", tmp_root, i);
        if (quantize(big, out, c[i].args) == 0) int_rows_exact(big, out, c[i].fmt, c[i].trunk);
    }
    snprintf(out, sizeof out, "%s/quant_big_fp8", tmp_root);
    if (quantize(big, out, "--experts fp8 --shard-gb 0.005") == 0) { /* fused experts split one by one, in shards */
        fp8_close_to_bf16(out, big, 2);
        snprintf(cmd, sizeof cmd, "'%s' verify --manifest '%s/SHA256SUMS' '%s' 2>&1", qflash_bin, out, out);
        int st = qt_run_capture(cmd, o, sizeof o);
        CHECK(st == 0 && strstr(o, "OK:") && strstr(o, "in 4 file(s)"), "verify --manifest on the quantised copy: status %d\n%.2000s", st, o);
    }
    snprintf(out, sizeof out, "%s/quant_from_fp8", tmp_root); /* FP8 in: dequantised, then int4 */
    if (quantize(qt_path("tests/data/qwen35moe-tiny-fp8"), out, "--experts int4 --trunk bf16") == 0) {
        qf_model *q = NULL;
        CHECK(qf_model_load(&q, out, NULL) == QF_OK && q->layers[0].w_qkv.dtype == QF_DT_BF16 && q->layers[0].sh_up.dtype == QF_DT_BF16,
              "FP8 trunk to bf16: %s", qf_last_error());
        qf_model_free(q);
    }
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    qflash_bin = argc > 2 ? argv[2] : "build/qflash";
    snprintf(tmp_root, sizeof tmp_root, "/tmp/qflash-loader-XXXXXX");
    if (!mkdtemp(tmp_root) || qf_mapfile_open(&orig, qt_path("tests/data/qwen35moe-tiny/model.safetensors"))) return 2;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | orig.data[i];
    orig_hdr = json_loadb((const char *)orig.data + 8, hlen, 0, NULL);
    orig_data = orig.data + 8 + hlen;
    orig_data_len = orig.size - 8 - hlen;
    case_truncated();
    case_header_len();
    case_bad_json();
    case_bad_headers();
    case_duplicate();
    case_unsupported_type();
    case_sharded();
    case_manifest();
    case_config_values();
    case_tokenizer_too_big();
    case_bad_template();
    case_bad_config_flash();
    case_fp8();
    case_quantize();
    json_decref(orig_hdr);
    qf_mapfile_close(&orig);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp_root);
    return qt_finish();
}
