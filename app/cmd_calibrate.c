/* qflash calibrate: the trunk sparsity thresholds of a model, from its dense activations on a text.
 * For every layer and projection group (model.h), the magnitudes of the group's input are counted
 * in a log-spaced histogram, and the magnitude under which 10%, 20% .. 90% of the entries lie is
 * written to config_flash.json's trunk_thresholds (the file's other fields kept). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib.h"
#include "format/config.h"

static int write_thresholds(const char *dir, const float *thr, int layers) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config_flash.json", dir);
    json_error_t err;
    FILE *probe = fopen(path, "r");
    json_t *root = probe ? json_loadf(probe, 0, &err) : json_object();
    if (probe) fclose(probe);
    if (!root) return qf_fail_json(path, &err);
    if (!json_is_object(root)) return json_decref(root), qf_fail(QF_EFORMAT, "%s: not a JSON object", path);
    json_t *all = json_array();
    for (int L = 0; L < layers; L++) {
        json_t *layer = json_array();
        for (int g = 0; g < QF_ACT_GROUPS; g++) {
            json_t *row = json_array();
            for (int i = 0; i < QF_TRUNK_GRID; i++) json_array_append_new(row, json_real((double)thr[((size_t)L * QF_ACT_GROUPS + g) * QF_TRUNK_GRID + i]));
            json_array_append_new(layer, row);
        }
        json_array_append_new(all, layer);
    }
    json_object_set_new(root, "trunk_thresholds", all);
    int rc = json_dump_file(root, path, JSON_INDENT(1) | JSON_COMPACT) == 0 ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
    json_decref(root);
    return rc;
}

int cmd_calibrate(int argc, char **argv, qf_backend_opts *bo) {
    const char *model = NULL, *file = NULL;
    int tokens = 16384, threads = 0;
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, "-m", "--model")) model = cli_value(&a);
        else if (cli_is(&a, "-f", "--file")) file = cli_value(&a);
        else if (cli_is(&a, "-n", "--tokens")) tokens = cli_int(&a, 16, 1 << 24);
        else if (cli_is(&a, "-t", "--threads")) threads = cli_int(&a, 1, 1024);
        else fprintf(stderr, "error: unknown option '%s' for calibrate\n", argv[a.i]), a.bad = 1;
    }
    if (a.bad || !model || !file) {
        fprintf(stderr, "usage: qflash calibrate -m DIR -f TEXT [-n TOKENS]   (writes DIR/config_flash.json's trunk_thresholds)\n");
        return 2;
    }
    int32_t *ids = NULL;
    int n = 0, rc = 1;
    qf_engine *e = NULL;
    float *thr = NULL;
    qf_engine_opts eo;
    cli_engine_init(&eo, bo);
    if (cli_open_on_text(model, file, threads, &eo, &e, &ids, &n) != QF_OK) goto out;
    int layers = e->model->cfg.n_layers;
    if (n > tokens) n = tokens;
    thr = malloc((size_t)layers * QF_ACT_GROUPS * QF_TRUNK_GRID * sizeof(float));
    rc = thr ? cli_calibrate(e, ids, n, thr) : qf_fail(QF_ENOMEM, "out of memory");
    if (rc == QF_OK) rc = write_thresholds(model, thr, layers);
    if (rc == QF_OK) fprintf(stderr, "calibrated %d layers on %d tokens: %s/config_flash.json\n", layers, n, model);
    else fprintf(stderr, "error: %s\n", qf_last_error());
    rc = rc == QF_OK ? 0 : 1;
out:
    free(thr);
    qf_engine_close(e);
    free(ids);
    return rc;
}
