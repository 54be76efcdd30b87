/* qflash calibrate: the trunk sparsity thresholds of a model, from its dense activations on a text.
 * For every layer and projection group (model.h), the magnitudes of the group's input are counted
 * in a log-spaced histogram, and the magnitude under which 10%, 20% .. 90% of the entries lie is
 * written to config_flash.json's trunk_thresholds (the file's other fields kept). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#define BINS 2048      /* log2 |x| from LO to LO + BINS / PER */
#define PER 32.0       /* bins per octave */
#define LO (-40.0)

typedef struct calib {
    uint64_t (*hist)[QF_ACT_GROUPS][BINS + 1]; /* [layer]; bin BINS: exact zeros and below LO */
} calib;

static void count(void *ud, int layer, int group, const float *x, int rows, int dim) {
    calib *c = ud;
    uint64_t *h = c->hist[layer][group];
    for (size_t i = 0; i < (size_t)rows * dim; i++) {
        double a = fabs((double)x[i]);
        int b = a > 0 ? (int)floor((log2(a) - LO) * PER) : -1;
        h[b < 0 ? BINS : b >= BINS ? BINS - 1 : b]++;
    }
}

/* The magnitude under which `share` of the counted entries lie (the upper edge of its bin). */
static double quantile(const uint64_t *h, double share) {
    uint64_t total = 0, acc = h[BINS];
    for (int b = 0; b <= BINS; b++) total += h[b];
    if (!total || (double)acc >= share * (double)total) return 0;
    for (int b = 0; b < BINS; b++) {
        acc += h[b];
        if ((double)acc >= share * (double)total) return exp2(LO + (b + 1) / PER);
    }
    return exp2(LO + BINS / PER);
}

static int write_thresholds(const char *dir, const calib *c, int layers) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config_flash.json", dir);
    json_error_t err;
    FILE *probe = fopen(path, "r");
    json_t *root = probe ? json_loadf(probe, 0, &err) : json_object();
    if (probe) fclose(probe);
    if (!json_is_object(root)) return json_decref(root), qf_fail(QF_EFORMAT, "%s: not a JSON object", path);
    json_t *all = json_array();
    for (int L = 0; L < layers; L++) {
        json_t *layer = json_array();
        for (int g = 0; g < QF_ACT_GROUPS; g++) {
            json_t *row = json_array();
            for (int i = 1; i <= QF_TRUNK_GRID; i++) json_array_append_new(row, json_real((double)(float)quantile(c->hist[L][g], i / 10.0)));
            json_array_append_new(layer, row);
        }
        json_array_append_new(all, layer);
    }
    json_object_set_new(root, "trunk_thresholds", all);
    int rc = json_dump_file(root, path, JSON_INDENT(1) | JSON_COMPACT) == 0 ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
    json_decref(root);
    return rc;
}

int cmd_calibrate(int argc, char **argv) {
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
    calib c = {NULL};
    if (cli_open_on_text(model, file, threads, &e, &ids, &n) != QF_OK) goto out;
    if (e->on_gpu) {
        fprintf(stderr, "error: calibrate runs on the CPU\n");
        goto out;
    }
    int layers = e->model->cfg.n_layers, window = 512;
    if (n > tokens) n = tokens;
    c.hist = calloc((size_t)layers, sizeof *c.hist);
    qf_state *st = qf_state_create(e->model, window);
    rc = c.hist && st && qf_model_set_sparsity(e->model, NULL) == QF_OK ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    qf_workspace_set_act_hook(e->ws, count, &c);
    for (int i = 0; i < n && rc == QF_OK; i += window) { /* windows from an empty state, as perplexity runs */
        qf_state_reset(st);
        rc = qf_forward_seq(e->model, &e->be, e->ws, st, ids + i, n - i < window ? n - i : window, QF_LOGITS_NONE, NULL);
    }
    qf_workspace_set_act_hook(e->ws, NULL, NULL);
    qf_state_free(st);
    if (rc == QF_OK) rc = write_thresholds(model, &c, layers);
    if (rc == QF_OK) fprintf(stderr, "calibrated %d layers on %d tokens: %s/config_flash.json\n", layers, n, model);
    else fprintf(stderr, "error: %s\n", qf_last_error());
    rc = rc == QF_OK ? 0 : 1;
out:
    free(c.hist);
    qf_engine_close(e);
    free(ids);
    return rc;
}
