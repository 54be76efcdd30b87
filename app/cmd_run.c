/* qflash run: raw completion. stdout gets exactly the generated text as it is produced;
 * everything else goes to stderr. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mapfile.h"
#include "base/timer.h"
#include "cli.h"
#include "runtime/sched.h"

enum { RUN_CHUNK = 512 }; /* prompt tokens a step: the engine's default workspace */

typedef struct run_opts {
    const char *model, *prompt, *prompt_file;
    int n_predict, threads, ctx, seed_set;
    qf_sampling s;
    qf_engine_opts eo;
} run_opts;

static void write_text(void *ud, const char *text, size_t len) {
    (void)ud;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
}

static int parse_run(int argc, char **argv, run_opts *o, qf_sampling *user, int *set_mask, qf_backend_opts *bo) {
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, "-m", "--model")) o->model = cli_value(&a);
        else if (cli_is(&a, "-p", "--prompt")) o->prompt = cli_value(&a);
        else if (cli_is(&a, "-f", "--file")) o->prompt_file = cli_value(&a);
        else if (cli_is(&a, "-n", "--n-predict")) o->n_predict = cli_int(&a, 0, 1 << 24);
        else if (cli_is(&a, "-t", "--threads")) o->threads = cli_int(&a, 1, 1024);
        else if (cli_device_flag(&a, &o->eo, bo)) continue;
        else if (cli_is(&a, "-c", "--ctx")) o->ctx = cli_int(&a, 16, 1 << 24);
        else if (cli_is(&a, NULL, "--draft")) o->eo.draft = cli_int(&a, 0, 8);
        else if (cli_sampling_flag(&a, user, &o->seed_set)) *set_mask = 1;
        else {
            fprintf(stderr, "error: unknown option '%s' for run\n", argv[a.i]);
            a.bad = 1;
        }
    }
    if (!a.bad && (!o->model || (!o->prompt && !o->prompt_file))) {
        fprintf(stderr, "usage: qflash run -m DIR (-p TEXT | -f FILE) [flags]   (qflash run --help lists them)\n");
        a.bad = 1;
    }
    return a.bad ? 2 : 0;
}

/* The user's flags override the generation_config defaults, flag by flag. */
static void merge_sampling(qf_sampling *dst, const qf_sampling *user, const qf_sampling *unset, int seed_set) {
    if (user->temperature != unset->temperature) dst->temperature = user->temperature;
    if (user->top_k != unset->top_k) dst->top_k = user->top_k;
    if (user->top_p != unset->top_p) dst->top_p = user->top_p;
    if (user->min_p != unset->min_p) dst->min_p = user->min_p;
    if (user->repetition_penalty != unset->repetition_penalty) dst->repetition_penalty = user->repetition_penalty;
    if (user->presence_penalty != unset->presence_penalty) dst->presence_penalty = user->presence_penalty;
    if (user->frequency_penalty != unset->frequency_penalty) dst->frequency_penalty = user->frequency_penalty;
    if (seed_set) dst->seed = user->seed;
}

int cli_prepare_sampling(const qf_engine *e, const qf_sampling *user, int seed_set, qf_sampling *out) {
    qf_sampling unset = CLI_SAMPLING_UNSET;
    cli_sampling_defaults(&e->model->cfg, out);
    merge_sampling(out, user, &unset, seed_set);
    if (qf_sampling_check(out) != QF_OK) {
        fprintf(stderr, "error: %s\n", qf_last_error());
        return 2;
    }
    fprintf(stderr, "sampling: temp %.2f, top-k %d, top-p %.2f, min-p %.2f, repeat %.2f, presence %.2f, frequency %.2f, seed %llu\n",
            out->temperature, out->top_k, out->top_p, out->min_p, out->repetition_penalty, out->presence_penalty,
            out->frequency_penalty, (unsigned long long)out->seed);
    return 0;
}

static void print_stats(const qf_req_status *st, double seconds, const qf_sched_stats *ss) {
    double gen = seconds - st->ttft;
    fprintf(stderr, "\nprompt: %d tokens in %.1f ms (%.1f tok/s) | generation: %d tokens in %.1f ms (%.1f tok/s)\n", st->prompt_tokens, st->ttft * 1e3,
            st->prompt_tokens / (st->ttft > 0 ? st->ttft : 1e-9), st->gen_tokens, gen * 1e3, st->gen_tokens / (gen > 0 ? gen : 1e-9));
    if (ss->spec_steps)
        fprintf(stderr, "speculative: %llu steps, %llu of %llu MTP drafts accepted (%.1f%%)\n", (unsigned long long)ss->spec_steps,
                (unsigned long long)ss->spec_accepted, (unsigned long long)ss->spec_drafted,
                100.0 * (double)ss->spec_accepted / (double)(ss->spec_drafted ? ss->spec_drafted : 1));
}

/* The prompt through the scheduler as one request (the loop serve runs): a sequence of the prompt
 * and the tokens wanted, prompt chunks of the workspace's rows. */
static int run_generation(qf_engine *e, const run_opts *o, const char *text) {
    int32_t *ids = NULL;
    int n = 0, rc = qf_tok_encode(e->tok, text, strlen(text), &ids, &n);
    if (rc == QF_OK && n == 0) rc = qf_fail(QF_EINVAL, "the prompt is empty");
    qf_sched_opts so = {.max_batch = 1, .ctx = o->ctx ? o->ctx : n + o->n_predict + 1, .prefill_chunk = RUN_CHUNK, .max_queue = 1, .log = stderr};
    qf_sched *s = NULL;
    if (rc == QF_OK) rc = qf_sched_create(&s, e, &so);
    qf_req_params p = {.prompt = ids, .n_prompt = n, .max_tokens = o->n_predict, .sampling = o->s, .logprobs = -1, .grammar_after = -1};
    qf_req_sink sink = {write_text, NULL, NULL};
    qf_req_status st;
    double t0 = qf_now();
    if (rc == QF_OK) rc = qf_sched_run(s, &p, &sink, NULL, &st);
    if (rc == QF_OK) {
        qf_sched_stats ss;
        qf_sched_get_stats(s, &ss);
        print_stats(&st, qf_now() - t0, &ss);
        cli_print_expert_stats(e);
    } else fprintf(stderr, "\nerror: %s\n", qf_last_error());
    qf_sched_destroy(s);
    free(ids);
    return rc == QF_OK ? 0 : 1;
}

int cmd_run(int argc, char **argv, qf_backend_opts *bo) {
    run_opts o = {0};
    o.n_predict = 128;
    cli_engine_init(&o.eo, bo);
    o.eo.max_batch = 1 + RUN_CHUNK; /* a step's rows: the decode row and a prompt chunk */
    o.eo.reserve_seqs = 1;
    qf_sampling user = CLI_SAMPLING_UNSET;
    int any = 0;
    if (parse_run(argc, argv, &o, &user, &any, bo)) return 2;
    char *file_text = NULL;
    if (o.prompt_file && qf_read_file(o.prompt_file, &file_text, NULL) != QF_OK) {
        fprintf(stderr, "error: %s\n", qf_last_error());
        return 1;
    }
    qf_engine *e;
    int rc = 1;
    if (cli_open_engine(&e, o.model, o.threads, &o.eo) == QF_OK) {
        if (!e->tok) fprintf(stderr, "error: %s has no tokenizer.json\n", o.model);
        else if (cli_prepare_sampling(e, &user, o.seed_set, &o.s) == 0) rc = run_generation(e, &o, file_text ? file_text : o.prompt);
        qf_engine_close(e);
    }
    free(file_text);
    return rc;
}
