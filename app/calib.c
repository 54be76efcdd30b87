/* Trunk sparsity's calibration (calib.h). */
#include "calib.h"

#include <math.h>
#include <stdlib.h>

#define BINS 2048      /* log2 |x| from LO to LO + BINS / PER */
#define PER 32.0       /* bins per octave */
#define LO (-40.0)

struct cli_calib {
    uint64_t (*hist)[QF_ACT_GROUPS][BINS + 1]; /* [layer]; bin BINS: exact zeros and below LO */
    int layers;
};

void cli_calib_count(void *ud, int layer, int group, const float *x, int rows, int dim) {
    cli_calib *c = ud;
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

cli_calib *cli_calib_new(int layers) {
    cli_calib *c = calloc(1, sizeof *c);
    if (c && !(c->hist = calloc((size_t)layers, sizeof *c->hist))) free(c), c = NULL;
    if (c) c->layers = layers;
    return c;
}

void cli_calib_free(cli_calib *c) {
    if (c) free(c->hist);
    free(c);
}

void cli_calib_grid(const cli_calib *c, float *thr) {
    for (int L = 0; L < c->layers; L++)
        for (int g = 0; g < QF_ACT_GROUPS; g++)
            for (int i = 0; i < QF_TRUNK_GRID; i++) thr[((size_t)L * QF_ACT_GROUPS + g) * QF_TRUNK_GRID + i] = (float)quantile(c->hist[L][g], (i + 1) / 10.0);
}

int cli_calibrate(qf_engine *e, const int32_t *ids, int n, float *thr) {
    int window = 512, layers = e->model->cfg.n_layers;
    cli_calib *c = cli_calib_new(layers);
    qf_state *st = qf_state_create(e->model, window);
    int rc = c && st ? qf_workspace_set_act_hook(e->ws, cli_calib_count, c) : qf_fail(QF_ENOMEM, "out of memory");
    for (int i = 0; i < n && rc == QF_OK; i += window) { /* windows from an empty state, as perplexity runs */
        qf_state_reset(st);
        rc = qf_forward_seq(e->model, &e->be, e->ws, st, ids + i, n - i < window ? n - i : window, QF_LOGITS_NONE, NULL);
    }
    qf_workspace_set_act_hook(e->ws, NULL, NULL);
    qf_state_free(st);
    if (rc == QF_OK) cli_calib_grid(c, thr);
    cli_calib_free(c);
    return rc;
}
