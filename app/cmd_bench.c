/* qflash bench: load time, prefill, time to first token, inter-token latency, decode throughput
 * at several concurrencies, memory over time, and the bandwidth roofline, on a checkpoint or on a
 * synthetic model of real shapes. The forward path is the one `run` and `serve` use. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/hashmap.h"
#include "base/numeric.h"
#include "base/timer.h"
#include "bench.h"
#include "calib.h"
#include "base/quant.h"
#include "cli.h"
#include "runtime/sched.h"

typedef struct bench_opts {
    const char *model, *synthetic, *config, *json, *plot;
    int layers, prompt_len, gen_len, runs, threads;
    int experts; /* --experts: a synthetic model's expert format (0: bf16) */
    int trunk;   /* --trunk: its trunk's (0: bf16; QF_Q_I8B32) */
    int draft;   /* --draft: speculative decoding with the MTP head measured beside plain decoding (a synthetic model gets a head) */
    int prefill_chunk; /* a prompt's tokens per forward call (the workspace's rows, at least the widest batch) */
    int conc[16], n_conc;
    float levels[16]; /* --levels: sparsity levels run one after another on the loaded model */
    int n_levels;
    int only; /* --only experts|trunk|kv: that level alone acts (QF_SPARSE_* bit; 0: all) */
    int warmup; /* --warmup N: runs dropped before the measured ones (default 1) */
    double bw;
    qf_engine_opts eo; /* the device flags */
} bench_opts;

/* ---- memory trace: a thread samples RSS every 100 ms, and each phase starts with a sample (a
 * phase shorter than the period would have none) ---- */

typedef struct tracer {
    pthread_t th;
    pthread_mutex_t mu;
    atomic_int stop;
    _Atomic(const char *) phase;
    double t0;
    bench_mem *mem;
    int n, cap;
} tracer;

static double rss_bytes(void) {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
        fclose(f);
    }
    return (double)resident * (double)sysconf(_SC_PAGESIZE);
}

static double peak_rss(void) {
    char line[256];
    double kb = 0;
    FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) kb = atof(line + 6);
    if (f) fclose(f);
    return kb * 1024.0;
}

static void trace_sample(tracer *t) {
    pthread_mutex_lock(&t->mu);
    if (t->n < t->cap) /* the trace stops growing rather than allocate while measuring */
        t->mem[t->n++] = (bench_mem){qf_now() - t->t0, rss_bytes(), atomic_load(&t->phase)};
    pthread_mutex_unlock(&t->mu);
}

static void trace_phase(tracer *t, const char *phase) {
    atomic_store(&t->phase, phase);
    trace_sample(t);
}

static void *trace_main(void *arg) {
    tracer *t = arg;
    while (!atomic_load(&t->stop)) {
        trace_sample(t);
        usleep(100000);
    }
    return NULL;
}

/* ---- copy bandwidth over the engine's threads ---- */

typedef struct copy_job {
    char *dst;
    const char *src;
    size_t chunk, n;
} copy_job;

static void copy_task(void *ctx, int i) {
    copy_job *j = ctx;
    size_t off = (size_t)i * j->chunk, len = off + j->chunk <= j->n ? j->chunk : j->n - off;
    memcpy(j->dst + off, j->src + off, len);
}

typedef struct read_job {
    const float *src;
    size_t chunk, n; /* floats */
    float sums[1024];
} read_job;

static void read_task(void *ctx, int i) {
    read_job *j = ctx;
    const float *p = j->src + (size_t)i * j->chunk;
    float a = 0, b = 0, c = 0, d = 0;
    for (size_t k = 0; k + 16 <= j->chunk; k += 16) a += p[k], b += p[k + 4], c += p[k + 8], d += p[k + 12];
    j->sums[i % 1024] = a + b + c + d; /* one float per cache line read: the loads cannot be elided */
}

/* GB/s of a plain read (the ceiling for decode, which reads weights and writes little) and of a
 * copy (read + write counted), best of 5 over 256 MiB. */
static double probe_bw(qf_pool *pool, double *copy_gbs) {
    size_t n = (size_t)256 << 20;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) {
        free(a), free(b);
        return 0;
    }
    memset(a, 1, n), memset(b, 2, n);
    copy_job j = {b, a, (size_t)4 << 20, n};
    read_job rj = {(const float *)a, ((size_t)4 << 20) / sizeof(float), n / sizeof(float), {0}};
    double best = 1e9, best_r = 1e9;
    for (int r = 0; r < 5; r++) {
        double t0 = qf_now();
        qf_pool_run(pool, copy_task, &j, (int)(n / j.chunk));
        double t1 = qf_now();
        qf_pool_run(pool, read_task, &rj, (int)(rj.n / rj.chunk));
        double t2 = qf_now();
        best = t1 - t0 < best ? t1 - t0 : best;
        best_r = t2 - t1 < best_r ? t2 - t1 : best_r;
    }
    free(a), free(b);
    *copy_gbs = 2.0 * (double)n / best / 1e9;
    return (double)n / best_r / 1e9;
}

/* ---- prompts ---- */

static void make_prompt(const qf_engine *e, int stream, int P, int32_t *out) {
    static const char *text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
                              "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
                              "        self.items.append(x)\n";
    int32_t *ids = NULL;
    int n = 0;
    if (e->tok && qf_tok_encode(e->tok, text, strlen(text), &ids, &n) == QF_OK && n > 0) {
        for (int i = 0; i < P; i++) out[i] = ids[(i + 7 * stream) % n];
    } else {
        uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(stream + 1);
        for (int i = 0; i < P; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            out[i] = (int32_t)(x % (uint64_t)e->model->cfg.vocab);
        }
    }
    free(ids);
}

/* ---- bytes per decode step ---- */

typedef struct model_bytes {
    double total, experts, embed, per_expert;
    int tied; /* lm_head is the embedding: the table is read whole every step */
} model_bytes;

static model_bytes count_bytes(const qf_model *m) {
    model_bytes b = {0};
    for (int i = 0; i < m->st.n_tensors; i++) {
        const qf_st_tensor *t = &m->st.tensors[i];
        b.total += (double)t->nbytes;
        if (strstr(t->name, "mlp.experts.")) b.experts += (double)t->nbytes;
        else if (strstr(t->name, "embed_tokens")) b.embed += (double)t->nbytes;
    }
    const qf_config *c = &m->cfg;
    b.tied = m->lm_head.data == m->embed.data;
    if (c->n_experts > 0) b.per_expert = b.experts / ((double)c->n_layers * c->n_experts);
    return b;
}

/* Weights read once per step (all but the embedding table and routed experts), the experts the
 * step used, and every sequence's recurrent state (read + write) and KV cache (read). */
static double step_bytes(const qf_model *m, const model_bytes *b, double experts, int C, int pos) {
    const qf_config *c = &m->cfg;
    double dense = b->total - b->experts - (b->tied ? 0 : b->embed);
    double state = 0;
    for (int L = 0; L < c->n_layers; L++) {
        if (c->layer_kind[L] == QF_LAYER_FULL) state += 2.0 * pos * c->n_kv_heads * c->head_dim * 4.0;
        else state += 2.0 * ((double)c->lin_v_heads * c->lin_k_dim * c->lin_v_dim + (c->conv_kernel - 1.0) * qf_cfg_conv_dim(c)) * 4.0;
    }
    return dense + experts * b->per_expert + C * state;
}

/* ---- one concurrency setting ---- */

typedef struct run_ctx {
    qf_engine *e;
    int C, P, G;
    qf_state **st;
    int32_t *prompts, *next;
    float *logits;
    qf_seq_step *steps;
} run_ctx;

typedef struct run_out {
    double prefill_s, ttft_s, decode_s, experts, hits, misses, loaded, host;
    qf_sparsity_counts sp; /* what sparsity skipped in the decode steps */
    uint64_t ids; /* FNV-1a of the decoded ids */
} run_out;

/* What sparsity skipped so far: the host path's counts, and a device's fused ops'. */
static qf_sparsity_counts sparsity_now(qf_engine *e) {
    qf_sparsity_counts s = qf_workspace_sparsity(e->ws);
    const qf_dec_ops *d = e->be.ops->dec;
    if (d && d->sparse_counts) {
        uint64_t v[4];
        d->sparse_counts(&e->be, v);
        s.trunk += v[0], s.trunk_zeroed += v[1], s.experts += v[2], s.experts_dropped += v[3];
    }
    return s;
}

/* Prompts one after another, then G-1 batched decode steps of one token per stream (the first
 * token comes from the prefill's logits). itl gets every step's seconds. */
static int one_run(run_ctx *x, double *itl, run_out *o) {
    qf_engine *e = x->e;
    int V = e->model->cfg.vocab;
    for (int s = 0; s < x->C; s++) qf_state_reset(x->st[s]);
    double t0 = qf_now();
    for (int s = 0; s < x->C; s++) {
        int rc = qf_forward_seq(e->model, &e->be, e->ws, x->st[s], x->prompts + (size_t)s * x->P, x->P, QF_LOGITS_LAST,
                                x->logits + (size_t)s * V);
        if (rc != QF_OK) return rc;
    }
    o->prefill_s = qf_now() - t0;
    for (int s = 0; s < x->C; s++) x->next[s] = qf_argmax_f32(x->logits + (size_t)s * V, V);
    o->ttft_s = qf_now() - t0;
    o->ids = qf_fnv1a(QF_FNV_BASIS, x->next, (size_t)x->C * sizeof *x->next);
    qf_expert_stats es0 = e->model->experts ? qf_es_stats(e->model->experts) : (qf_expert_stats){0};
    qf_sparsity_counts sp0 = sparsity_now(e);
    double d0 = qf_now();
    for (int i = 0; i < x->G - 1; i++) {
        double s0 = qf_now();
        /* greedy: the pick happens where the logits are (on a GPU, only the ids come back) */
        for (int s = 0; s < x->C; s++) x->steps[s] = (qf_seq_step){x->st[s], &x->next[s], 1, QF_LOGITS_TOP1, NULL, &x->next[s], 0, 0, NULL, NULL, NULL};
        int rc = qf_forward(e->model, &e->be, e->ws, x->steps, x->C);
        if (rc != QF_OK) return rc;
        itl[i] = qf_now() - s0;
        o->ids = qf_fnv1a(o->ids, x->next, (size_t)x->C * sizeof *x->next);
    }
    o->decode_s = qf_now() - d0;
    qf_expert_stats es1 = e->model->experts ? qf_es_stats(e->model->experts) : (qf_expert_stats){0};
    o->experts = x->G > 1 ? (double)(es1.acquires - es0.acquires) / (x->G - 1) : 0;
    o->hits = (double)(es1.hits - es0.hits), o->misses = (double)(es1.misses - es0.misses), o->loaded = (double)(es1.bytes_loaded - es0.bytes_loaded);
    o->host = (double)(es1.host_computed - es0.host_computed);
    qf_sparsity_counts sp1 = sparsity_now(e);
    o->sp = (qf_sparsity_counts){sp1.experts - sp0.experts, sp1.experts_dropped - sp0.experts_dropped, sp1.trunk - sp0.trunk, sp1.trunk_zeroed - sp0.trunk_zeroed,
                                 sp1.kv_pages - sp0.kv_pages, sp1.kv_skipped - sp0.kv_skipped};
    return QF_OK;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static bench_stat stat_of(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return (bench_stat){v[n / 2], v[0], v[n - 1]};
}

static double pct(const double *sorted, int n, double p) {
    int i = (int)(p / 100.0 * (n - 1) + 0.5);
    return n ? sorted[i < n ? i : n - 1] : 0;
}

static void summarize(bench_cfg *c, run_out *ro, int R) {
    double v[5][64];
    for (int r = 0; r < R; r++) {
        v[0][r] = ro[r].prefill_s * 1e3;
        v[1][r] = (double)c->concurrency * c->prompt_len / ro[r].prefill_s;
        v[2][r] = ro[r].ttft_s * 1e3;
        v[3][r] = ro[r].decode_s;
        v[4][r] = ro[r].decode_s > 0 ? (double)c->concurrency * c->decode_steps / ro[r].decode_s : 0;
    }
    c->prefill_ms = stat_of(v[0], R), c->prefill_tok_s = stat_of(v[1], R), c->ttft_ms = stat_of(v[2], R);
    c->decode_s = stat_of(v[3], R), c->decode_tok_s_total = stat_of(v[4], R);
    c->decode_tok_s_stream = (bench_stat){c->decode_tok_s_total.median / c->concurrency, c->decode_tok_s_total.min / c->concurrency,
                                          c->decode_tok_s_total.max / c->concurrency};
    double sum = 0, ex = 0, hits = 0, uses = 0, loaded = 0;
    for (int i = 0; i < c->n_itl; i++) sum += c->itl_ms[i];
    for (int r = 0; r < R; r++) ex += ro[r].experts / R, hits += ro[r].hits, uses += ro[r].hits + ro[r].misses, loaded += ro[r].loaded;
    c->expert_hit_rate = uses > 0 ? hits / uses : 0;
    double spx = 0, spxd = 0, spt = 0, sptz = 0, spk = 0, spks = 0;
    for (int r = 0; r < R; r++) spx += (double)ro[r].sp.experts, spxd += (double)ro[r].sp.experts_dropped, spt += (double)ro[r].sp.trunk, sptz += (double)ro[r].sp.trunk_zeroed;
    for (int r = 0; r < R; r++) spk += (double)ro[r].sp.kv_pages, spks += (double)ro[r].sp.kv_skipped;
    c->inactive_experts = spx > 0 ? spxd / spx : 0, c->inactive_trunk = spt > 0 ? sptz / spt : 0, c->inactive_kv = spk > 0 ? spks / spk : 0;
    c->streaming_loads = uses - hits;
    c->host_computed = 0;
    for (int r = 0; r < R; r++) c->host_computed += ro[r].host;
    c->streamed_per_token = c->decode_steps > 0 ? loaded / ((double)R * c->concurrency * c->decode_steps) : 0;
    double *sorted = malloc((size_t)(c->n_itl ? c->n_itl : 1) * sizeof *sorted);
    if (sorted && c->n_itl) {
        memcpy(sorted, c->itl_ms, (size_t)c->n_itl * sizeof *sorted);
        qsort(sorted, (size_t)c->n_itl, sizeof *sorted, cmp_double);
        c->itl_mean_ms = sum / c->n_itl, c->itl_p50_ms = pct(sorted, c->n_itl, 50), c->itl_p99_ms = pct(sorted, c->n_itl, 99);
    }
    free(sorted);
    c->experts_per_step = ex;
}

static int bench_cfg_run(qf_engine *e, const bench_opts *o, int C, bench_cfg *c, tracer *tr) {
    int V = e->model->cfg.vocab, P = o->prompt_len, G = o->gen_len, R = o->runs;
    run_ctx x = {e, C, P, G, calloc((size_t)C, sizeof(qf_state *)), malloc((size_t)C * P * sizeof(int32_t)),
                 malloc((size_t)C * sizeof(int32_t)), malloc((size_t)C * V * sizeof(float)), malloc((size_t)C * sizeof(qf_seq_step))};
    run_out ro[64];
    double *itl = malloc((size_t)(G > 1 ? G : 2) * sizeof *itl);
    memset(c, 0, sizeof *c);
    c->concurrency = C, c->prompt_len = P, c->gen_len = G, c->runs = R, c->decode_steps = G - 1;
    c->itl_ms = malloc((size_t)(R * (G > 1 ? G - 1 : 1)) * sizeof *c->itl_ms);
    int rc = x.st && x.prompts && x.next && x.logits && x.steps && itl && c->itl_ms ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    for (int s = 0; rc == QF_OK && s < C; s++) {
        make_prompt(e, s, P, x.prompts + (size_t)s * P);
        if (!(x.st[s] = qf_state_create(e->model, P + G + 1))) rc = qf_fail(QF_ENOMEM, "out of memory for %d states", C);
    }
    for (int r = -o->warmup; rc == QF_OK && r < R; r++) { /* runs before 0 warm caches and pages up, and are dropped */
        if (r <= 0) trace_phase(tr, r < 0 ? "warm-up" : "measure");
        run_out out;
        rc = one_run(&x, itl, &out);
        if (rc != QF_OK || r < 0) continue;
        ro[r] = out;
        c->ids_digest = out.ids;
        c->run_prefill_ms[r] = out.prefill_s * 1e3, c->run_ttft_ms[r] = out.ttft_s * 1e3, c->run_decode_s[r] = out.decode_s;
        for (int i = 0; i < G - 1; i++) c->itl_ms[c->n_itl++] = itl[i] * 1e3, c->run_itl_sum_ms[r] += itl[i] * 1e3;
    }
    if (rc == QF_OK) summarize(c, ro, R);
    for (int s = 0; x.st && s < C; s++) qf_state_free(x.st[s]);
    free(x.st), free(x.prompts), free(x.next), free(x.logits), free(x.steps), free(itl);
    return rc;
}

/* ---- the command ---- */

static int parse_list(const char *s, int *out, int cap) {
    int n = 0;
    while (s && *s && n < cap) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 4096) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

static int parse_bench(int argc, char **argv, bench_opts *o, qf_backend_opts *bo) {
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, "-m", "--model")) o->model = cli_value(&a);
        else if (cli_is(&a, NULL, "--synthetic")) o->synthetic = cli_value(&a);
        else if (cli_is(&a, NULL, "--config")) o->config = cli_value(&a);
        else if (cli_is(&a, NULL, "--layers")) o->layers = cli_int(&a, 1, 4096);
        else if (cli_is(&a, NULL, "--draft")) o->draft = cli_int(&a, 1, 8);
        else if (cli_is(&a, NULL, "--experts")) {
            const char *v = cli_value(&a);
            if (v && strcmp(v, "bf16") && (o->experts = qf_qfmt_parse(v)) != QF_Q_I8B32 && o->experts != QF_Q_I4B32)
                fprintf(stderr, "error: --experts takes bf16, int8 or int4 (a synthetic model's experts)\n"), a.bad = 1;
        } else if (cli_is(&a, NULL, "--trunk")) {
            const char *v = cli_value(&a);
            if (v && strcmp(v, "bf16") && (o->trunk = qf_qfmt_parse(v)) != QF_Q_I8B32)
                fprintf(stderr, "error: --trunk takes bf16 or int8 (a synthetic model's trunk, as qflash quantize --trunk makes it)\n"), a.bad = 1;
        }
        else if (cli_is(&a, "-p", "--prompt-len")) o->prompt_len = cli_int(&a, 1, 1 << 20);
        else if (cli_is(&a, "-n", "--gen-len")) o->gen_len = cli_int(&a, 1, 1 << 20);
        else if (cli_is(&a, NULL, "--prefill-chunk")) o->prefill_chunk = cli_int(&a, 1, 1 << 16);
        else if (cli_is(&a, NULL, "--runs")) o->runs = cli_int(&a, 1, 64);
        else if (cli_is(&a, "-t", "--threads")) o->threads = cli_int(&a, 1, 1024);
        else if (cli_device_flag(&a, &o->eo, bo)) continue;
        else if (cli_is(&a, NULL, "--bw")) o->bw = cli_num(&a, 0.001, 1e6);
        else if (cli_is(&a, NULL, "--json")) o->json = cli_value(&a);
        else if (cli_is(&a, NULL, "--plot")) o->plot = cli_value(&a);
        else if (cli_is(&a, NULL, "--warmup")) o->warmup = cli_int(&a, 0, 8);
        else if (cli_is(&a, NULL, "--only")) o->only = cli_sparse_only(&a);
        else if (cli_is(&a, NULL, "--levels")) {
            const char *v = cli_value(&a);
            if (v && (o->n_levels = cli_parse_levels(v, o->levels, 16)) < 1) {
                fprintf(stderr, "error: --levels wants sparsity levels like 0,0.3,0.6 (each 0..1)\n");
                a.bad = 1;
            }
        } else if (cli_is(&a, NULL, "--concurrency")) {
            const char *v = cli_value(&a);
            if (v && (o->n_conc = parse_list(v, o->conc, 16)) < 1) {
                fprintf(stderr, "error: --concurrency wants a list like 1,16 (each 1..4096)\n");
                a.bad = 1;
            }
        } else {
            fprintf(stderr, "error: unknown option '%s' for bench\n", argv[a.i]);
            a.bad = 1;
        }
    }
    if (!a.bad && !o->model == !(o->synthetic || o->config)) {
        fprintf(stderr, "usage: qflash bench (-m DIR | --synthetic PRESET | --config FILE) [flags]   (qflash bench --help lists them)\n");
        a.bad = 1;
    }
    return a.bad ? 2 : 0;
}

void cmd_bench_help(FILE *f) {
    fprintf(f, "usage: qflash bench (-m DIR | --synthetic %s [--layers N] [--experts bf16|int8|int4] [--trunk bf16|int8] | --config FILE [--layers N])\n"
               "       [--prompt-len 128] [--gen-len 64] [--concurrency 1,16] [--runs 3] [--prefill-chunk 512] [--bw GB/s]\n"
               "       [--levels 0,0.3,0.6 (sparsity levels, one after another on the loaded model)] [--only experts|trunk|kv] [--warmup 1]\n"
               "       [-t THREADS] [--json FILE] [--plot FILE.svg] [--draft N (MTP speculative decoding beside plain)] [device flags]\n",
            qf_synth_presets());
}

static void cpu_name(char *out, size_t cap) {
    char line[256];
    snprintf(out, cap, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (!strncmp(line, "model name", 10) && colon) {
            snprintf(out, cap, "%s", colon + 2);
            out[strcspn(out, "\n")] = 0;
            break;
        }
    }
    if (f) fclose(f);
}

static int open_model(const bench_opts *o, qf_engine **e, double *load_s) {
    int max_c = 1;
    for (int i = 0; i < o->n_conc; i++) max_c = o->conc[i] > max_c ? o->conc[i] : max_c;
    qf_synth_opts so = {o->synthetic, o->config, o->layers, 0, o->experts, o->draft > 0, o->trunk};
    qf_engine_opts eo = o->eo;
    eo.n_threads = o->threads, eo.max_batch = max_c > o->prefill_chunk ? max_c : o->prefill_chunk, eo.synth = o->model ? NULL : &so;
    eo.reserve_seqs = max_c, eo.reserve_tokens = max_c * (o->prompt_len + o->gen_len + 1), eo.max_prompt = o->prompt_len, eo.draft = o->draft;
    for (int i = 0; i < o->n_levels && !o->eo.sparsity_given; i++) /* loaded at a level above 0: the budget plan holds its transposed weights */
        if (o->levels[i] > 0.0f) eo.sparsity_given = 1, eo.sparsity_level = o->levels[i];
    double t0 = qf_now();
    int rc = qf_engine_open(e, o->model, &eo);
    *load_s = qf_now() - t0;
    if (rc != QF_OK) fprintf(stderr, "error: %s\n", qf_last_error());
    else cli_print_expert_cache(*e);
    return rc;
}

static void fill_roofline(const qf_model *m, bench_result *r) {
    model_bytes mb = count_bytes(m);
    const qf_config *cf = &m->cfg;
    r->weight_bytes = mb.total;
    for (int i = 0; i < r->n_cfgs; i++) {
        bench_cfg *c = &r->cfgs[i];
        c->expert_cache = m->experts && m->experts->stats.slots > 0;
        if (!c->expert_cache) c->expert_hit_rate = 0, c->streaming_loads = 0, c->streamed_per_token = 0; /* all resident: nothing streams */
        if (c->experts_per_step == 0 && cf->n_experts > 0) {
            /* a device routes without the store's counters: expected distinct experts under
             * uniform routing (exact for one stream: top-k in every layer) */
            double miss = 1.0, p = (double)cf->n_experts_used / cf->n_experts;
            for (int k = 0; k < c->concurrency; k++) miss *= 1.0 - p;
            c->experts_per_step = cf->n_layers * cf->n_experts * (1.0 - miss);
            c->experts_estimated = 1;
        }
        int mid_pos = c->prompt_len + c->gen_len / 2; /* the average context over the decode */
        c->bytes_per_step = step_bytes(m, &mb, c->experts_per_step, c->concurrency, mid_pos);
        c->bytes_per_token = c->bytes_per_step / c->concurrency;
        c->roofline_tok_s = r->bw_gbs * 1e9 / c->bytes_per_token;
        c->roofline_pct = 100.0 * c->decode_tok_s_total.median / c->roofline_tok_s;
    }
}

/* Every layer at level (--levels). */
static int set_levels(qf_engine *e, float level) {
    float lv[QF_MAX_LAYERS];
    for (int L = 0; L < e->model->cfg.n_layers; L++) lv[L] = level;
    fprintf(stderr, "bench: sparsity level %.2f\n", level);
    return qf_model_set_sparsity(e->model, lv);
}

/* Speculative decoding at concurrency 1 (greedy, the engine's generation loop): each run decodes
 * the bench prompt's continuation plainly and with 1..draft drafts a step, alternating; tok/s,
 * the drafts accepted, tokens a step, and whether the ids are the plain ones (they must be). */
typedef struct ids_digest {
    uint64_t h;
} ids_digest;

static void digest_id(void *ud, const qf_token_lp *t) {
    ids_digest *d = ud;
    d->h = qf_fnv1a(d->h, &t->id, sizeof t->id);
}

/* The share of drafted tokens accepted on the real Qwen3.6-35B-A3B with 3 drafts, as llama.cpp
 * publishes it: a synthetic model's head is random (its drafts are refused), so its step costs are
 * measured and the speed at this acceptance implied. */
#define REAL_ACCEPT 0.866

typedef struct draft_run {
    double tok_s, step;  /* the best run's decode rate and a step's cost */
    uint64_t ids;        /* the digest of its ids */
    qf_sched_stats ss;   /* the scheduler's counters over the runs */
    int gen;             /* tokens a run */
} draft_run;

/* runs greedy generations of the prompt at d drafts a step through a scheduler of one sequence;
 * a draft step's cost is the run's time less its reruns at a plain step's, over its steps */
static int draft_runs(qf_engine *e, const bench_opts *o, const int32_t *prompt, int d, double plain_step, draft_run *out) {
    int P = o->prompt_len, G = o->gen_len;
    qf_engine_set_draft(e, d);
    qf_sched_opts so = {.max_batch = 1, .ctx = P + G + 8, .prefill_chunk = qf_workspace_rows(e->ws) - 1, .max_queue = 1, .log = stderr};
    qf_sched *s;
    int rc = qf_sched_create(&s, e, &so);
    memset(out, 0, sizeof *out);
    for (int r = 0; rc == QF_OK && r < o->runs; r++) {
        qf_sched_stats before, after;
        qf_sched_get_stats(s, &before);
        ids_digest dg = {QF_FNV_BASIS};
        qf_req_params p = {.prompt = prompt, .n_prompt = P, .max_tokens = G, .sampling = qf_sampling_default(), .logprobs = -1, .want_ids = 1, .grammar_after = -1};
        qf_req_sink sink = {NULL, digest_id, &dg};
        qf_req_status st;
        double t0 = qf_now();
        rc = qf_sched_run(s, &p, &sink, NULL, &st);
        double gen_s = qf_now() - t0 - st.ttft, ts = gen_s > 0 ? st.gen_tokens / gen_s : 0;
        qf_sched_get_stats(s, &after);
        uint64_t steps = after.steps - before.steps, reruns = after.spec_reruns - before.spec_reruns;
        if (rc == QF_OK && ts > out->tok_s)
            out->tok_s = ts, out->ids = dg.h, out->gen = st.gen_tokens,
            out->step = d && steps ? (gen_s - (double)reruns * plain_step) / (double)steps : gen_s / (st.gen_tokens ? st.gen_tokens : 1);
        out->ss = after;
    }
    qf_sched_destroy(s);
    return rc;
}

static int bench_draft(qf_engine *e, const bench_opts *o) {
    int P = o->prompt_len, rc = QF_OK;
    int32_t *prompt = malloc((size_t)P * sizeof *prompt);
    if (!prompt) rc = qf_fail(QF_ENOMEM, "out of memory");
    if (rc == QF_OK) make_prompt(e, 0, P, prompt);
    printf("\nspeculative decoding, concurrency 1, greedy (prompt %d, %d tokens, %d runs):\n", P, o->gen_len, o->runs);
    draft_run plain = {0};
    for (int d = 0; rc == QF_OK && d <= o->draft; d++) {
        draft_run x;
        rc = draft_runs(e, o, prompt, d, plain.step, &x);
        if (rc != QF_OK) break;
        if (d == 0) plain = x;
        printf("  --draft %d: %8.1f tok/s (best of %d), %.3f ms a step", d, x.tok_s, o->runs, 1e3 * x.step);
        if (d) {
            uint64_t drafted = x.ss.spec_drafted, accepted = x.ss.spec_accepted;
            printf(", %llu of %llu drafts accepted (%.1f%%), ids %s; at %.1f%% of drafts accepted (llama.cpp's on the real model): %.0f tok/s",
                   (unsigned long long)accepted, (unsigned long long)drafted, 100.0 * (double)accepted / (double)(drafted ? drafted : 1),
                   x.ids == plain.ids ? "as plain" : "DIFFER from plain", 100.0 * REAL_ACCEPT, x.step > 0 ? (1.0 + d * REAL_ACCEPT) / x.step : 0.0);
        }
        printf("\n");
    }
    qf_engine_set_draft(e, o->draft);
    free(prompt);
    return rc;
}

static int calibrate_on_prompts(qf_engine *e) {
    int n = 1024, layers = e->model->cfg.n_layers;
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    float *thr = malloc((size_t)layers * QF_ACT_GROUPS * QF_TRUNK_GRID * sizeof(float));
    int rc = ids && thr ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    for (int i = 0; rc == QF_OK && i < n; i += 512) make_prompt(e, 1000 + i, 512, ids + i);
    if (rc == QF_OK) rc = cli_calibrate(e, ids, n, thr);
    if (rc == QF_OK) rc = qf_model_set_trunk_thresholds(e->model, thr);
    if (rc == QF_OK) fprintf(stderr, "bench: trunk sparsity thresholds calibrated on %d tokens of bench prompts (no config_flash.json)\n", n);
    else fprintf(stderr, "error: %s\n", qf_last_error());
    free(ids), free(thr);
    return rc;
}

int cmd_bench(int argc, char **argv, qf_backend_opts *bo) {
    bench_opts o = {.prompt_len = 128, .gen_len = 64, .runs = 3, .prefill_chunk = 512, .conc = {1, 16}, .n_conc = 2, .warmup = 1};
    cli_engine_init(&o.eo, bo);
    if (parse_bench(argc, argv, &o, bo)) return 2;
    enum { TRACE_CAP = 1 << 16 };
    tracer tr = {.t0 = qf_now(), .mem = malloc(TRACE_CAP * sizeof(bench_mem)), .cap = TRACE_CAP};
    pthread_mutex_init(&tr.mu, NULL);
    atomic_store(&tr.phase, "load");
    if (!tr.mem || pthread_create(&tr.th, NULL, trace_main, &tr) != 0) return 1;
    bench_result r = {0};
    qf_engine *e = NULL;
    int rc = open_model(&o, &e, &r.load_s);
    if (rc == QF_OK && o.only) qf_model_sparse_off(e->model, (QF_SPARSE_EXPERTS | QF_SPARSE_TRUNK | QF_SPARSE_KV) & ~o.only);
    /* a synthetic model has no config_flash.json: its thresholds from bench prompts; a model
     * directory's come from qflash calibrate (without them its trunk level does not act, as in run) */
    if (rc == QF_OK && !o.model && e->model->sparse && !e->model->trunk_thr && (!o.only || o.only == QF_SPARSE_TRUNK)) rc = calibrate_on_prompts(e);
    if (rc == QF_OK) {
        trace_phase(&tr, "bandwidth probe");
        r.bw_measured = o.bw <= 0;
        if (e->on_gpu && o.bw <= 0) fprintf(stderr, "bench: the bandwidth probe measures host memory; give --bw for the GPU's roofline\n");
        if (e->on_gpu) qf_backend_opts_print(stderr, bo);
        r.bw_gbs = o.bw > 0 ? o.bw : probe_bw(e->pool, &r.copy_gbs);
        r.cfgs = calloc((size_t)o.n_conc * (size_t)(o.n_levels ? o.n_levels : 1), sizeof *r.cfgs);
        if (!r.cfgs) rc = QF_ENOMEM;
    }
    for (int l = 0; rc == QF_OK && l < (o.n_levels ? o.n_levels : 1); l++) {
        if (o.n_levels) rc = set_levels(e, o.levels[l]);
        for (int i = 0; rc == QF_OK && i < o.n_conc; i++, r.n_cfgs++) {
            fprintf(stderr, "bench: concurrency %d: prompt %d, %d tokens, %d warm-up + %d runs\n", o.conc[i], o.prompt_len, o.gen_len, o.warmup, o.runs);
            rc = bench_cfg_run(e, &o, o.conc[i], &r.cfgs[r.n_cfgs], &tr);
            r.cfgs[r.n_cfgs].sparse = e->model->sparse, r.cfgs[r.n_cfgs].level = o.n_levels ? o.levels[l] : e->model->sparsity[0];
        }
    }
    if (rc == QF_OK && o.draft) rc = bench_draft(e, &o);
    if (rc != QF_OK) fprintf(stderr, "error: %s\n", qf_last_error());
    trace_phase(&tr, "done");
    atomic_store(&tr.stop, 1);
    pthread_join(tr.th, NULL);
    trace_sample(&tr);
    if (rc == QF_OK) {
        const qf_config *c = &e->model->cfg;
        cpu_name(r.cpu, sizeof r.cpu);
        r.cores = qf_cpu_count(), r.threads = qf_pool_size(e->pool), r.layers = c->n_layers;
        r.prefill_chunk = qf_workspace_rows(e->ws);
        r.experts = c->n_experts, r.experts_used = c->n_experts_used;
        snprintf(r.source, sizeof r.source, "%s%s", o.model ? o.model : "synthetic:", o.model ? "" : o.config ? o.config : o.synthetic);
        snprintf(r.model_type, sizeof r.model_type, "%s", c->model_type);
        snprintf(r.ops, sizeof r.ops, "%s", e->be.ops->name);
        snprintf(r.device, sizeof r.device, "%s", qf_backend_device_name(&e->be));
        if (e->on_gpu) qf_be_sync(&e->be), r.peak_device_bytes = (double)qf_backend_peak_bytes(&e->be);
        r.scratch_grown = e->on_gpu && e->be.ops->scratch_grown ? e->be.ops->scratch_grown(&e->be) : 0;
        r.mem = tr.mem, r.n_mem = tr.n, r.peak_rss_bytes = peak_rss();
        fill_roofline(e->model, &r);
        bench_print(&r);
        if (o.json && bench_write_json(&r, o.json) != QF_OK) rc = QF_EIO;
        if (o.plot && bench_write_svg(&r, o.plot) != QF_OK) rc = QF_EIO;
        if (rc != QF_OK) fprintf(stderr, "error: %s\n", qf_last_error());
    }
    for (int i = 0; i < r.n_cfgs; i++) free(r.cfgs[i].itl_ms);
    free(r.cfgs);
    free(tr.mem);
    pthread_mutex_destroy(&tr.mu);
    qf_engine_close(e);
    return rc == QF_OK ? 0 : 1;
}
