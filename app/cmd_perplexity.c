/* qflash perplexity: mean next-token NLL over non-overlapping windows of a text file, each window
 * run from an empty state (as HF's sliding-window-free evaluation does). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/timer.h"
#include "cli.h"

/* NLL of tokens[1..n) given the logits of tokens[0..n-1), in chunks of the workspace size. */
static int window_nll(qf_engine *e, qf_state *st, const int32_t *tok, int n, float *logits, int chunk, double *nll) {
    int V = e->model->cfg.vocab;
    qf_state_reset(st);
    *nll = 0;
    for (int i = 0; i < n - 1; i += chunk) {
        int cnt = n - 1 - i < chunk ? n - 1 - i : chunk;
        qf_seq_step s = {st, tok + i, cnt, QF_LOGITS_ALL, logits, NULL, 0, 0, NULL, NULL, NULL};
        int rc = qf_forward(e->model, &e->be, e->ws, &s, 1);
        if (rc != QF_OK) return rc;
        for (int j = 0; j < cnt; j++) {
            const float *l = logits + (size_t)j * V;
            double mx = l[0], sum = 0;
            for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
            for (int v = 0; v < V; v++) sum += exp((double)l[v] - mx);
            *nll += mx + log(sum) - l[tok[i + j + 1]];
        }
    }
    return QF_OK;
}

int cmd_perplexity(int argc, char **argv, qf_backend_opts *bo) {
    const char *model = NULL, *file = NULL;
    int window = 512, windows = 0, threads = 0;
    qf_engine_opts eo;
    cli_engine_init(&eo, bo);
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, "-m", "--model")) model = cli_value(&a);
        else if (cli_is(&a, "-f", "--file")) file = cli_value(&a);
        else if (cli_is(&a, NULL, "--window")) window = cli_int(&a, 2, 1 << 20);
        else if (cli_is(&a, NULL, "--windows")) windows = cli_int(&a, 1, 1 << 20);
        else if (cli_is(&a, "-t", "--threads")) threads = cli_int(&a, 1, 1024);
        else if (cli_device_flag(&a, &eo, bo)) continue;
        else {
            fprintf(stderr, "error: unknown option '%s' for perplexity\n", argv[a.i]);
            a.bad = 1;
        }
    }
    if (a.bad || !model || !file) {
        fprintf(stderr, "usage: qflash perplexity -m DIR -f FILE [flags]   (qflash perplexity --help lists them)\n");
        return 2;
    }
    int32_t *ids = NULL;
    int n = 0, rc = 1;
    qf_engine *e = NULL;
    if (cli_open_on_text(model, file, threads, &eo, &e, &ids, &n) != QF_OK) goto out;
    int avail = n / window;
    if (!windows || windows > avail) windows = avail;
    if (windows < 1) {
        fprintf(stderr, "error: %s has %d tokens, fewer than one window of %d\n", file, n, window);
        goto out;
    }
    int chunk = qf_workspace_rows(e->ws) < 64 ? qf_workspace_rows(e->ws) : 64;
    qf_state *st = qf_state_create(e->model, window);
    float *logits = malloc((size_t)chunk * e->model->cfg.vocab * sizeof(float));
    double total = 0, t0 = qf_now();
    rc = st && logits ? 0 : 1;
    for (int w = 0; w < windows && rc == 0; w++) {
        double nll;
        if (window_nll(e, st, ids + (size_t)w * window, window, logits, chunk, &nll) != QF_OK) {
            fprintf(stderr, "error: %s\n", qf_last_error());
            rc = 1;
            break;
        }
        total += nll;
        fprintf(stderr, "window %d: mean NLL %.5f\n", w, nll / (window - 1));
    }
    if (rc == 0) {
        double mean = total / ((double)windows * (window - 1));
        printf("perplexity: %.4f (mean NLL %.5f over %d windows of %d tokens; %d tokens in the file; %.1f tok/s)\n", exp(mean), mean,
               windows, window, n, windows * window / (qf_now() - t0));
    }
    free(logits);
    qf_state_free(st);
out:
    qf_engine_close(e);
    free(ids);
    return rc;
}
