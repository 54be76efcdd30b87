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
#include "format/st_write.h"

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

/* Every tensor of the set, in its order, after a header naming their places. */
static int write_tensors(const char *dir, const qf_st_set *st) {
    qf_st_entry *e = calloc((size_t)st->n_tensors + 1, sizeof *e);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = e ? fopen(path, "wb") : NULL;
    for (int i = 0; e && i < st->n_tensors; i++) {
        const qf_st_tensor *t = &st->tensors[i];
        e[i] = (qf_st_entry){t->name, qf_dtype_name(t->dtype), t->ndim, {0}, t->nbytes};
        for (int d = 0; d < t->ndim && d < 8; d++) e[i].shape[d] = t->shape[d];
    }
    int ok = f && qf_st_write_header(f, path, e, st->n_tensors) == QF_OK;
    for (int i = 0; ok && i < st->n_tensors; i++) ok = fwrite(st->tensors[i].data, 1, st->tensors[i].nbytes, f) == st->tensors[i].nbytes;
    if (f && fclose(f) != 0) ok = 0;
    free(e);
    return ok ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
}

int cmd_synth_export(int argc, char **argv, qf_backend_opts *bo) {
    (void)bo; /* runs no model */
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
    qf_synth_opts so = {preset, NULL, layers, 0, 0, 0, 0};
    qf_model *m = NULL;
    int rc = qf_model_synthetic(&m, &so, &(qf_load_opts){0});
    if (rc == QF_OK && mkdir(dir, 0755) != 0 && access(dir, W_OK) != 0) rc = qf_fail(QF_EIO, "cannot make %s", dir);
    if (rc == QF_OK) rc = write_config(dir, preset, layers);
    if (rc == QF_OK) rc = write_tensors(dir, &m->st);
    qf_model_free(m);
    if (rc != QF_OK) fprintf(stderr, "error: %s\n", qf_last_error());
    return rc == QF_OK ? 0 : 1;
}
