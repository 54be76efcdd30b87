#include "cli.h"

#include "base/mapfile.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

const char *cli_value(cli_args *a) {
    if (a->i + 1 >= a->argc) {
        fprintf(stderr, "error: %s needs a value\n", a->argv[a->i]);
        a->bad = 1;
        return NULL;
    }
    return a->argv[++a->i];
}

int cli_is(const cli_args *a, const char *shortf, const char *longf) {
    const char *s = a->argv[a->i];
    return (shortf && strcmp(s, shortf) == 0) || (longf && strcmp(s, longf) == 0);
}

int cli_int(cli_args *a, int lo, int hi) {
    const char *flag = a->argv[a->i], *v = cli_value(a);
    if (!v) return lo;
    char *end;
    long x = strtol(v, &end, 10);
    if (*v == 0 || *end || x < lo || x > hi) {
        fprintf(stderr, "error: %s expects an integer in [%d, %d], got '%s'\n", flag, lo, hi, v);
        a->bad = 1;
        return lo;
    }
    return (int)x;
}

double cli_num(cli_args *a, double lo, double hi) {
    const char *flag = a->argv[a->i], *v = cli_value(a);
    if (!v) return lo;
    char *end;
    double x = strtod(v, &end);
    if (*v == 0 || *end || !(x >= lo && x <= hi)) {
        fprintf(stderr, "error: %s expects a number in [%g, %g], got '%s'\n", flag, lo, hi, v);
        a->bad = 1;
        return lo;
    }
    return x;
}

int cli_sampling_flag(cli_args *a, qf_sampling *s, int *seed_set) {
    if (cli_is(a, NULL, "--temp")) s->temperature = (float)cli_num(a, 0, 100);
    else if (cli_is(a, NULL, "--top-k")) s->top_k = cli_int(a, 0, 1 << 24);
    else if (cli_is(a, NULL, "--top-p")) s->top_p = (float)cli_num(a, 1e-6, 1);
    else if (cli_is(a, NULL, "--min-p")) s->min_p = (float)cli_num(a, 0, 1);
    else if (cli_is(a, NULL, "--repeat-penalty")) s->repetition_penalty = (float)cli_num(a, 1e-3, 10);
    else if (cli_is(a, NULL, "--presence-penalty")) s->presence_penalty = (float)cli_num(a, -2, 2);
    else if (cli_is(a, NULL, "--frequency-penalty")) s->frequency_penalty = (float)cli_num(a, -2, 2);
    else if (cli_is(a, NULL, "--seed")) {
        const char *v = cli_value(a);
        char *end;
        if (v) s->seed = strtoull(v, &end, 10);
        if (v && (*v == 0 || *end || *v == '-')) {
            fprintf(stderr, "error: --seed expects a non-negative integer, got '%s'\n", v);
            a->bad = 1;
        }
        *seed_set = 1;
    } else return 0;
    return 1;
}

void cli_sampling_defaults(const qf_config *c, qf_sampling *s) {
    *s = qf_sampling_default();
    s->temperature = c->gen_temperature;
    s->top_p = c->gen_top_p > 0 && c->gen_top_p <= 1 ? c->gen_top_p : 1.0f;
    s->top_k = c->gen_top_k;
    s->seed = (uint64_t)time(NULL);
}

void cli_progress(void *ud, int done, int total) {
    (void)ud;
    int w = 30, fill = total ? done * w / total : w;
    fprintf(stderr, "\rloading [");
    for (int i = 0; i < w; i++) fputc(i < fill ? '#' : '.', stderr);
    fprintf(stderr, "] %d/%d layers", done, total);
    if (done == total) fputc('\n', stderr);
}

/* "22G", "512M", "64K", or a plain number of GiB ("0.5"); 0 when it is none of these. */
static size_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    double unit = *end == 0 ? 1073741824.0 : 0;
    if (end[0] && !end[1]) unit = end[0] == 'G' || end[0] == 'g' ? 1073741824.0 : end[0] == 'M' || end[0] == 'm' ? 1048576.0 : end[0] == 'K' || end[0] == 'k' ? 1024.0 : 0;
    return end != s && v > 0 && unit > 0 && v * unit < 1e18 ? (size_t)(v * unit) : 0;
}

void cli_engine_init(qf_engine_opts *eo, const qf_backend_opts *bo) {
    memset(eo, 0, sizeof *eo);
    eo->device = "cpu";
    eo->backend = bo;
    eo->expert_threads = -1; /* the engine's default */
}

static void size_flag(cli_args *a, size_t *out, const char *examples) {
    const char *flag = a->argv[a->i], *v = cli_value(a);
    if (v && !(*out = parse_size(v))) fprintf(stderr, "error: %s takes a size like %s or 0.5 (GiB), not '%s'\n", flag, examples, v), a->bad = 1;
}


int cli_device_flag(cli_args *a, qf_engine_opts *eo, qf_backend_opts *bo) {
    if (cli_is(a, NULL, "--device")) {
        eo->device = cli_value(a);
    } else if (cli_is(a, NULL, "--precision")) {
        const char *v = cli_value(a);
        if (v && qf_backend_opts_precision(bo, v) != QF_OK) fprintf(stderr, "error: %s\n", qf_last_error()), a->bad = 1;
    } else if (cli_is(a, NULL, "--expert-cache")) {
        size_flag(a, &eo->expert_cache, "512M, 22G");
    } else if (cli_is(a, NULL, "--gpu-mem")) {
        size_flag(a, &eo->gpu_mem, "22G, 12G");
    } else if (cli_is(a, NULL, "--sparsity-level")) {
        eo->sparsity_level = (float)cli_num(a, 0, 1);
        eo->sparsity_given = 1;
    } else if (cli_is(a, NULL, "--expert-heat")) {
        eo->expert_heat = cli_value(a);
    } else if (cli_is(a, NULL, "--expert-prefetch")) {
        eo->expert_prefetch = (int)cli_num(a, 0, 64);
    } else if (cli_is(a, NULL, "--expert-threads")) {
        eo->expert_threads = (int)cli_num(a, 0, 1024);
    } else if (cli_is(a, NULL, "--expert-policy")) {
        eo->expert_policy = cli_value(a); /* parsed by the engine */
    } else if (cli_is(a, NULL, "--cuda-opt")) {
        const char *v = cli_value(a);
        if (v && qf_backend_opts_set(bo, v) != QF_OK) fprintf(stderr, "error: %s\n", qf_last_error()), a->bad = 1;
    } else {
        return 0;
    }
    return 1;
}

void cli_print_expert_cache(const qf_engine *e) {
    const qf_expert_store *s = e->model->experts;
    const qf_config *c = &e->model->cfg;
    if (e->notice[0]) fprintf(stderr, "note: %s\n", e->notice);
    if (e->model->sparse) {
        float lo = 1, hi = 0;
        for (int L = 0; L < c->n_layers; L++) lo = e->model->sparsity[L] < lo ? e->model->sparsity[L] : lo, hi = e->model->sparsity[L] > hi ? e->model->sparsity[L] : hi;
        fprintf(stderr, "sparsity: levels %.2f..%.2f by layer (experts under level / top-%d of the weight dropped, at least %d kept)\n", lo, hi, c->n_experts_used,
                qf_sparsity_min_k(c->n_experts_used));
    }
    if (e->plan.active) qf_plan_print(stderr, &e->plan);
    else if (s && s->stats.slots)
        fprintf(stderr, "expert cache: %d of %d experts a layer (%.1f%% resident) and a scratch slot, %.1f MiB of RAM; the rest read from the checkpoint as needed\n",
                s->stats.slots, c->n_experts, 100.0 * s->stats.slots / c->n_experts, (double)s->stats.pool_bytes / 1048576.0);
}

void cli_print_expert_stats(const qf_engine *e) {
    const qf_expert_stats *x = qf_engine_expert_stats(e);
    if (!x || !x->slots || e->on_gpu) return;
    fprintf(stderr, "expert cache: %llu hits, %llu misses (%.1f%% hits), %.1f MB read", (unsigned long long)x->hits, (unsigned long long)x->misses,
            100.0 * (double)x->hits / (double)(x->acquires ? x->acquires : 1), (double)x->bytes_loaded / 1e6);
    if (x->prefetches)
        fprintf(stderr, "; %llu read ahead, %llu of them used (%.1f%%), %llu waits for one", (unsigned long long)x->prefetches, (unsigned long long)x->prefetch_hits,
                100.0 * (double)x->prefetch_hits / (double)x->prefetches, (unsigned long long)x->prefetch_waits);
    fprintf(stderr, "\n");
}

int cli_open_on_text(const char *dir, const char *file, int threads, const qf_engine_opts *eo, qf_engine **e, int32_t **ids, int *n) {
    char *text = NULL;
    *e = NULL, *ids = NULL, *n = 0;
    int rc = qf_read_file(file, &text, NULL);
    if (rc != QF_OK) fprintf(stderr, "error: %s\n", qf_last_error());
    if (rc == QF_OK) rc = cli_open_engine(e, dir, threads, eo);
    if (rc == QF_OK && !(*e)->tok) rc = qf_fail(QF_EINVAL, "%s has no tokenizer", dir), fprintf(stderr, "error: %s\n", qf_last_error());
    else if (rc == QF_OK && (rc = qf_tok_encode((*e)->tok, text, strlen(text), ids, n)) != QF_OK) fprintf(stderr, "error: %s\n", qf_last_error());
    free(text);
    return rc;
}

/* A hint for a model path that is not a directory: a file, or what looks like a hub id. */
static void path_hint(const char *dir) {
    struct stat st;
    if (stat(dir, &st) == 0 && !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "hint: %s is a file; give the model's directory (the one holding config.json)\n", dir);
    } else if (stat(dir, &st) != 0 && strchr(dir, '/') == strrchr(dir, '/') && strchr(dir, '/') && dir[0] != '/' && dir[0] != '.') {
        fprintf(stderr, "hint: '%s' looks like a Hugging Face hub id; qflash reads local directories: download it first "
                        "(huggingface-cli download %s --local-dir DIR) and give DIR\n", dir, dir);
    }
}

int cli_open_engine(qf_engine **e, const char *dir, int threads, const qf_engine_opts *eo) {
    qf_engine_opts o = *eo;
    o.n_threads = threads, o.progress = cli_progress;
    int rc = qf_engine_open(e, dir, &o);
    if (rc != QF_OK) {
        fprintf(stderr, "\nerror: %s\n", qf_last_error());
        path_hint(dir);
        return rc;
    }
    fprintf(stderr, "loaded %s in %.2f s: %s, %d layers, vocab %d, ops %s, %d threads\n", dir, (*e)->load_seconds,
            (*e)->model->cfg.model_type, (*e)->model->cfg.n_layers, (*e)->model->cfg.vocab, (*e)->be.ops->name,
            qf_pool_size((*e)->pool));
    if ((*e)->on_gpu && o.backend) qf_backend_opts_print(stderr, o.backend);
    cli_print_expert_cache(*e);
    return QF_OK;
}

int cli_sparse_only(cli_args *a) {
    const char *v = cli_value(a);
    int bit = !v ? 0 : !strcmp(v, "experts") ? QF_SPARSE_EXPERTS : !strcmp(v, "trunk") ? QF_SPARSE_TRUNK : !strcmp(v, "kv") ? QF_SPARSE_KV : -1;
    if (v && bit < 0) fprintf(stderr, "error: --only takes experts, trunk or kv, not '%s'\n", v), a->bad = 1;
    return bit > 0 ? bit : 0;
}

int cli_parse_levels(const char *s, float *out, int cap) {
    int n = 0;
    while (s && *s && n < cap) {
        char *end;
        float v = strtof(s, &end);
        if (end == s || !(v >= 0.0f && v <= 1.0f) || (*end && *end != ',')) return -1;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}
