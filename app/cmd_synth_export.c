/* qflash synth-export: a synthetic model (generated weights, a real checkpoint's shapes) written as a
 * model directory (config.json + model.safetensors), so what reads checkpoints from disk (the CPU
 * expert cache, mmap'd loading) can be measured at full size without the real weights. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/dtype.h"
#include "cli.h"

static int write_config(const char *dir, const char *preset, int layers) {
    const char *json = qf_synth_preset_json(preset);
    if (!json) return qf_fail(QF_EINVAL, "unknown synthetic model '%s' (known: %s)", preset, qf_synth_presets());
    json_error_t err;
    json_t *root = json_loads(json, 0, &err), *text = root ? json_object_get(root, "text_config") : NULL;
    if (!text) return json_decref(root), qf_fail(QF_EFORMAT, "preset %s: %s", preset, err.text);
    if (layers > 0) json_object_set_new(text, "num_hidden_layers", json_integer(layers));
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    int rc = json_dump_file(root, path, JSON_INDENT(2)) == 0 ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
    json_decref(root);
    return rc;
}

/* Every tensor of the set, in its order, after a JSON header naming their places. */
static int write_tensors(const char *dir, const qf_st_set *st) {
    json_t *h = json_object();
    size_t at = 0;
    for (int i = 0; i < st->n_tensors; i++) {
        const qf_st_tensor *t = &st->tensors[i];
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++) json_array_append_new(shape, json_integer(t->shape[d]));
        json_object_set_new(h, t->name, json_pack("{s:s,s:o,s:[I,I]}", "dtype", qf_dtype_name(t->dtype), "shape", shape, "data_offsets", (json_int_t)at,
                                                  (json_int_t)(at + t->nbytes)));
        at += t->nbytes;
    }
    char *text = json_dumps(h, JSON_COMPACT);
    json_decref(h);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = text ? fopen(path, "wb") : NULL;
    size_t n = text ? strlen(text) : 0, pad = (8 - n % 8) % 8;
    uint64_t len = n + pad;
    int ok = f && fwrite(&len, 8, 1, f) == 1 && fwrite(text, 1, n, f) == n && fwrite("        ", 1, pad, f) == pad;
    for (int i = 0; ok && i < st->n_tensors; i++) ok = fwrite(st->tensors[i].data, 1, st->tensors[i].nbytes, f) == st->tensors[i].nbytes;
    if (f && fclose(f) != 0) ok = 0;
    free(text);
    return ok ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
}

int cmd_synth_export(int argc, char **argv) {
    const char *preset = NULL, *dir = NULL;
    int layers = 0;
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, NULL, "--synthetic")) preset = cli_value(&a);
        else if (cli_is(&a, NULL, "--layers")) layers = cli_int(&a, 1, 1 << 16);
        else if (cli_is(&a, "-o", "--out")) dir = cli_value(&a);
        else a.bad = 1;
    }
    if (a.bad || !preset || !dir) {
        fprintf(stderr, "usage: qflash synth-export --synthetic qwen3.6-35b-a3b [--layers N] -o DIR\n");
        return 2;
    }
    qf_synth_opts so = {preset, NULL, layers, 0};
    qf_model *m = NULL;
    int rc = qf_model_synthetic(&m, &so, &(qf_load_opts){0});
    if (rc == QF_OK && mkdir(dir, 0755) != 0 && access(dir, W_OK) != 0) rc = qf_fail(QF_EIO, "cannot make %s", dir);
    if (rc == QF_OK) rc = write_config(dir, preset, layers);
    if (rc == QF_OK) rc = write_tensors(dir, &m->st);
    qf_model_free(m);
    if (rc != QF_OK) fprintf(stderr, "error: %s\n", qf_last_error());
    return rc == QF_OK ? 0 : 1;
}
