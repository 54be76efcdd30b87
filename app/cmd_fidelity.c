/* qflash fidelity: what an approximation (a sparsity level, or another copy of the model such as
 * a quantised one: --compare) costs against the exact model, on a text: for every window, dense
 * and approximate states run side by side, and per setting the
 * perplexity and its ratio to dense, the KL divergence of each next-token distribution from the
 * dense one (mean and 99.9th percentile), the share of positions with the same top token, greedy
 * tokens until a stop (end of sequence or a blank line) against dense, and decode speed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/numeric.h"
#include "base/timer.h"
#include "cli.h"
#include "runtime/sched.h"

#define MAX_LEVELS 16

typedef struct fid_opts {
    const char *model, *file;
    float levels[MAX_LEVELS];
    int n_levels, window, windows, prompts, prompt_len, max_gen, threads;
    int only; /* --only experts|trunk|kv: that level alone acts (QF_SPARSE_* bit; 0: all) */
    const char *compare[MAX_LEVELS]; /* --compare: model directories against -m's, at level 0 */
    int n_compare;
    qf_engine_opts eo;
} fid_opts;

typedef struct fid_row {
    double nll, kl_sum, same, n;
    double *kl; /* every position's KL, for the percentile */
    double stop_tokens, tok_s;
} fid_row;

static int set_level(qf_engine *e, float level) {
    float lv[QF_MAX_LAYERS];
    for (int L = 0; L < e->model->cfg.n_layers; L++) lv[L] = level;
    return qf_model_set_sparsity(e->model, lv);
}

/* log-softmax of one row into out (doubles). */
static void log_softmax(const float *l, int V, double *out) {
    double mx = l[0], sum = 0;
    for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
    for (int v = 0; v < V; v++) sum += exp((double)l[v] - mx);
    double lse = mx + log(sum);
    for (int v = 0; v < V; v++) out[v] = (double)l[v] - lse;
}

/* cnt positions: dense logits d against approximate a, next tokens nxt. */
static void score_chunk(const float *d, const float *a, const int32_t *nxt, int cnt, int V, double *ld, double *la, fid_row *r) {
    for (int j = 0; j < cnt; j++) {
        const float *dj = d + (size_t)j * V, *aj = a + (size_t)j * V;
        log_softmax(dj, V, ld);
        log_softmax(aj, V, la);
        double kl = 0;
        for (int v = 0; v < V; v++) kl += exp(ld[v]) * (ld[v] - la[v]);
        r->kl[(size_t)r->n] = kl > 0 ? kl : 0;
        r->kl_sum += r->kl[(size_t)r->n];
        r->nll -= la[nxt[j]];
        r->same += qf_argmax_f32(dj, V) == qf_argmax_f32(aj, V);
        r->n += 1;
    }
}

/* Every window through a dense state and an approximate one at level, a token a step (sparsity
 * acts on one-token steps, as in a generation; prompts run dense), so that level 0 is the dense
 * run bit for bit. */
static int run_windows(qf_engine *e, qf_engine *ea, const fid_opts *o, const int32_t *ids, float level, fid_row *r, float *bufs, double *lsm) {
    int V = e->model->cfg.vocab, rc = QF_OK;
    qf_state *sd = qf_state_create(e->model, o->window), *sa = qf_state_create(ea->model, o->window);
    float *d = bufs, *a = bufs + V;
    if (!sd || !sa) rc = qf_fail(QF_ENOMEM, "out of memory for two states");
    for (int w = 0; w < o->windows && rc == QF_OK; w++) {
        const int32_t *tok = ids + (size_t)w * o->window;
        qf_state_reset(sd), qf_state_reset(sa);
        for (int i = 0; i < o->window - 1 && rc == QF_OK; i++) {
            qf_seq_step s = {sd, tok + i, 1, QF_LOGITS_LAST, d, NULL, 0, 0, NULL, NULL, NULL};
            if ((rc = set_level(e, 0)) == QF_OK) rc = qf_forward(e->model, &e->be, e->ws, &s, 1);
            s.st = sa, s.logits = a;
            if (rc == QF_OK && (rc = set_level(ea, level)) == QF_OK) rc = qf_forward(ea->model, &ea->be, ea->ws, &s, 1);
            if (rc == QF_OK) score_chunk(d, a, tok + i + 1, 1, V, lsm, lsm + V, r);
        }
    }
    qf_state_free(sd), qf_state_free(sa);
    return rc;
}

/* A stop: a blank line (two newlines with at most a few spaces or a tab between) in the generated text. */
static const char *const BLANK_LINES[] = {"\n\n", "\n \n", "\n  \n", "\n   \n", "\n    \n", "\n     \n", "\n      \n", "\n       \n",
                                         "\n        \n", "\n         \n", "\n          \n", "\n           \n", "\n            \n", "\n\t\n", "\n\r\n"};

/* Greedy generations from the first prompt_len tokens of the first windows, each a request through
 * a scheduler of one sequence: tokens until a stop (summed), and decode tok/s over them. */
static int run_generations(qf_engine *e, const fid_opts *o, const int32_t *ids, float level, fid_row *r) {
    qf_sched_opts so = {.max_batch = 1, .ctx = o->prompt_len + o->max_gen + 2, .prefill_chunk = qf_workspace_rows(e->ws) - 1, .max_queue = 1, .log = stderr};
    qf_sched *s = NULL;
    int rc = set_level(e, level);
    if (rc == QF_OK) rc = qf_sched_create(&s, e, &so);
    qf_req_params p = {.n_prompt = o->prompt_len, .max_tokens = o->max_gen, .sampling = qf_sampling_default(), .logprobs = -1, .grammar_after = -1};
    p.n_stop = (int)(sizeof BLANK_LINES / sizeof BLANK_LINES[0]);
    for (int i = 0; i < p.n_stop; i++) p.stop[i] = BLANK_LINES[i];
    double gen_s = 0, gen_n = 0;
    for (int k = 0; k < o->prompts && rc == QF_OK; k++) {
        p.prompt = ids + (size_t)k * o->window;
        qf_req_status st;
        double t0 = qf_now();
        rc = qf_sched_run(s, &p, NULL, NULL, &st);
        r->stop_tokens += st.gen_tokens;
        gen_s += qf_now() - t0 - st.ttft, gen_n += st.gen_tokens;
    }
    r->tok_s = gen_s > 0 ? gen_n / gen_s : 0;
    qf_sched_destroy(s);
    return rc;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void print_table(const fid_opts *o, fid_row *rows) {
    int n = o->n_compare ? o->n_compare + 1 : o->n_levels, w = 6;
    for (int i = 0; i < o->n_compare; i++) w = (int)strlen(o->compare[i]) > w ? (int)strlen(o->compare[i]) : w;
    if (o->n_compare && (int)strlen(o->model) > w) w = (int)strlen(o->model);
    printf("%*s %10s %9s %10s %10s %8s %14s %10s %8s\n", w, o->n_compare ? "model" : "level", "ppl", "ppl ratio", "mean KL", "p99.9 KL", "top-1", "tokens-to-stop", "decode t/s",
           "speed-up");
    double ppl0 = exp(rows[0].nll / rows[0].n);
    for (int i = 0; i < n; i++) {
        fid_row *r = &rows[i];
        qsort(r->kl, (size_t)r->n, sizeof *r->kl, cmp_double);
        double ppl = exp(r->nll / r->n), p999 = r->kl[(size_t)((r->n - 1) * 0.999)];
        char label[600];
        if (o->n_compare) snprintf(label, sizeof label, "%s", i ? o->compare[i - 1] : o->model);
        else snprintf(label, sizeof label, "%.2f", o->levels[i]);
        printf("%*s %10.4f %9.4f %10.2e %10.2e %7.2f%% %14.3f %10.1f %7.2fx\n", w, label, ppl, ppl / ppl0, r->kl_sum / r->n, p999, 100.0 * r->same / r->n,
               rows[0].stop_tokens > 0 ? r->stop_tokens / rows[0].stop_tokens : 0, r->tok_s, rows[0].tok_s > 0 ? r->tok_s / rows[0].tok_s : 0);
    }
    printf("(%d windows of %d tokens; greedy tokens to a stop, end of sequence or a blank line, from %d prompts of %d tokens, at most %d each,\n"
           " summed against level %.2f's; decode tok/s over those generations)\n",
           o->windows, o->window, o->prompts, o->prompt_len, o->max_gen, o->levels[0]);
}

static int parse_fidelity(int argc, char **argv, fid_opts *o, qf_backend_opts *bo) {
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, "-m", "--model")) o->model = cli_value(&a);
        else if (cli_is(&a, "-f", "--file")) o->file = cli_value(&a);
        else if (cli_is(&a, NULL, "--sparsity-level")) {
            const char *v = cli_value(&a);
            if (v && (o->n_levels = cli_parse_levels(v, o->levels, MAX_LEVELS)) < 1) fprintf(stderr, "error: --sparsity-level takes levels 0..1 separated by commas, not '%s'\n", v), a.bad = 1;
        } else if (cli_is(&a, NULL, "--compare")) {
            const char *v = cli_value(&a);
            if (v && o->n_compare < MAX_LEVELS - 1) o->compare[o->n_compare++] = v;
        } else if (cli_is(&a, NULL, "--only")) {
            o->only = cli_sparse_only(&a);
        } else if (cli_is(&a, NULL, "--window")) o->window = cli_int(&a, 2, 1 << 20);
        else if (cli_is(&a, NULL, "--windows")) o->windows = cli_int(&a, 1, 1 << 20);
        else if (cli_is(&a, NULL, "--prompts")) o->prompts = cli_int(&a, 0, 1 << 16);
        else if (cli_is(&a, NULL, "--prompt-len")) o->prompt_len = cli_int(&a, 1, 1 << 16);
        else if (cli_is(&a, NULL, "--max-gen")) o->max_gen = cli_int(&a, 1, 1 << 20);
        else if (cli_is(&a, "-t", "--threads")) o->threads = cli_int(&a, 1, 1024);
        else if (cli_device_flag(&a, &o->eo, bo)) continue;
        else fprintf(stderr, "error: unknown option '%s' for fidelity\n", argv[a.i]), a.bad = 1;
    }
    if (a.bad || !o->model || !o->file) {
        fprintf(stderr, "usage: qflash fidelity -m DIR -f TEXT [flags]   (qflash fidelity --help lists them)\n");
        return 2;
    }
    return 0;
}

int cmd_fidelity(int argc, char **argv, qf_backend_opts *bo) {
    fid_opts o = {.levels = {0, 0.3f, 0.45f, 0.6f, 0.7f}, .n_levels = 5, .window = 512, .prompts = 16, .prompt_len = 32, .max_gen = 256};
    cli_engine_init(&o.eo, bo);
    int prc = parse_fidelity(argc, argv, &o, bo);
    if (prc) return prc;
    int32_t *ids = NULL;
    int n = 0, rc = 1;
    qf_engine *e = NULL;
    fid_row rows[MAX_LEVELS];
    memset(rows, 0, sizeof rows);
    if (cli_open_on_text(o.model, o.file, o.threads, &o.eo, &e, &ids, &n) != QF_OK) goto out;
    if (o.only) qf_model_sparse_off(e->model, (QF_SPARSE_EXPERTS | QF_SPARSE_TRUNK | QF_SPARSE_KV) & ~o.only);
    if (!o.windows || o.windows > n / o.window) o.windows = n / o.window;
    if (o.prompts > o.windows) o.prompts = o.windows;
    if (o.windows < 1 || o.prompt_len >= o.window) {
        fprintf(stderr, "error: %s has %d tokens: fewer than one window of %d (or a prompt as long)\n", o.file, n, o.window);
        goto out;
    }
    int V = e->model->cfg.vocab;
    float *bufs = malloc(2 * (size_t)V * sizeof(float));
    double *lsm = malloc(2 * (size_t)V * sizeof(double));
    rc = bufs && lsm ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    int n_rows = o.n_compare ? o.n_compare + 1 : o.n_levels;
    for (int i = 0; i < n_rows && rc == QF_OK; i++) {
        double t0 = qf_now();
        float level = o.n_compare ? 0.0f : o.levels[i];
        qf_engine *ea = e;
        if (i && o.n_compare && cli_open_engine(&ea, o.compare[i - 1], o.threads, &o.eo) != QF_OK) {
            rc = QF_EIO;
            break;
        }
        if (ea->model->cfg.vocab != V) rc = qf_fail(QF_EINVAL, "%s has a vocabulary of %d, not %d", o.compare[i - 1], ea->model->cfg.vocab, V);
        rows[i].kl = malloc((size_t)o.windows * o.window * sizeof(double));
        if (rc == QF_OK) rc = rows[i].kl ? run_windows(e, ea, &o, ids, level, &rows[i], bufs, lsm) : qf_fail(QF_ENOMEM, "out of memory");
        if (rc == QF_OK) rc = run_generations(ea, &o, ids, level, &rows[i]);
        if (ea != e) qf_engine_close(ea);
        fprintf(stderr, "%s %s: %.1f s\n", o.n_compare ? "model" : "level", i && o.n_compare ? o.compare[i - 1] : "", qf_now() - t0);
    }
    if (rc == QF_OK) print_table(&o, rows);
    else fprintf(stderr, "error: %s\n", qf_last_error());
    free(bufs), free(lsm);
    rc = rc == QF_OK ? 0 : 1;
out:
    for (int i = 0; i < MAX_LEVELS; i++) free(rows[i].kl);
    qf_engine_close(e);
    free(ids);
    return rc;
}
