/* qflash chat: multi-turn chat through the model's own chat template, each turn one request
 * through the scheduler (the loop serve runs). Reasoning (<think>...</think>) is printed apart from
 * the answer and kept out of the history, as the template expects; the scheduler's prefix
 * snapshots (where a turn begins and where a reply ends) keep any turn from prefilling the
 * conversation again. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/timer.h"
#include "cli.h"
#include "runtime/sched.h"
#include "server/think.h"
#include "tokenizer/chat.h"

enum { CHAT_CHUNK = 512, CHAT_PAGE = 16 }; /* prompt tokens a step; KV page */

typedef struct turn_buf {
    char *answer, *reasoning;
    size_t n_answer, n_reasoning;
} turn_buf;

typedef struct chat_ctx {
    qf_engine *e;
    qf_sched *s;
    int tty, showing; /* showing: inside the printed [thinking] block */
    think_split split;
    turn_buf cur;
} chat_ctx;

static void append(char **buf, size_t *n, const char *s, size_t len) {
    char *nb = realloc(*buf, *n + len + 1);
    if (!nb) return;
    memcpy(nb + *n, s, len);
    *n += len;
    nb[*n] = 0;
    *buf = nb;
}

/* Ctrl-C stops the reply being written, not the session (a signal handler can only set a flag). */
static volatile sig_atomic_t interrupted;
static void on_sigint(int sig) {
    (void)sig;
    interrupted = 1;
}

static void show_thinking(chat_ctx *c, int on) {
    if (on == c->showing) return;
    c->showing = on;
    fputs(on ? (c->tty ? "\033[2m[thinking]\n" : "[thinking]\n") : (c->tty ? "\n[/thinking]\033[0m\n" : "\n[/thinking]\n"), stdout);
}

static void on_part(void *ud, int reasoning, const char *p, size_t n) {
    chat_ctx *c = ud;
    show_thinking(c, reasoning);
    if (reasoning) append(&c->cur.reasoning, &c->cur.n_reasoning, p, n);
    else append(&c->cur.answer, &c->cur.n_answer, p, n);
    fwrite(p, 1, n, stdout);
    fflush(stdout);
}

static void on_text(void *ud, const char *p, size_t n) {
    chat_ctx *c = ud;
    think_feed(&c->split, p, n, 0, on_part, c);
}

typedef struct chat_opts {
    const char *model, *system;
    int think, threads, ctx, n_predict, seed_set;
    qf_engine_opts eo;
} chat_opts;

static int parse_chat(int argc, char **argv, chat_opts *o, qf_sampling *user, qf_backend_opts *bo) {
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, "-m", "--model")) o->model = cli_value(&a);
        else if (cli_is(&a, NULL, "--no-think")) o->think = 0;
        else if (cli_is(&a, NULL, "--system")) o->system = cli_value(&a);
        else if (cli_is(&a, "-t", "--threads")) o->threads = cli_int(&a, 1, 1024);
        else if (cli_device_flag(&a, &o->eo, bo)) continue;
        else if (cli_is(&a, "-c", "--ctx")) o->ctx = cli_int(&a, 64, 1 << 24);
        else if (cli_is(&a, "-n", "--n-predict")) o->n_predict = cli_int(&a, 1, 1 << 24);
        else if (!cli_sampling_flag(&a, user, &o->seed_set)) {
            fprintf(stderr, "error: unknown option '%s' for chat\n", argv[a.i]);
            a.bad = 1;
        }
    }
    if (!a.bad && !o->model) {
        fprintf(stderr, "usage: qflash chat -m DIR [flags]   (qflash chat --help lists them)\n");
        a.bad = 1;
    }
    return a.bad ? 2 : 0;
}

typedef struct history {
    qf_chat_msg *m;
    int n;
} history;

static void history_add(history *h, const char *role, char *content, char *reasoning) {
    qf_chat_msg *nm = realloc(h->m, (size_t)(h->n + 1) * sizeof *nm);
    if (!nm) return;
    h->m = nm;
    h->m[h->n++] = (qf_chat_msg){role, content, reasoning};
}

static void history_free(history *h) {
    for (int i = 0; i < h->n; i++) {
        free((char *)h->m[i].content);
        free((char *)h->m[i].reasoning);
    }
    free(h->m);
}

/* One user turn: render, tokenize, run it through the scheduler, keep the answer in the history. */
static int chat_turn(chat_ctx *c, const chat_opts *o, const qf_chat_tmpl *ct, history *h, const qf_sampling *smp) {
    char *text = NULL;
    int32_t *ids = NULL;
    int n = 0;
    int rc = qf_chat_render(ct, h->m, h->n, 1, o->think, &text);
    if (rc == QF_OK) rc = qf_tok_encode(c->e->tok, text, strlen(text), &ids, &n);
    memset(&c->cur, 0, sizeof c->cur);
    memset(&c->split, 0, sizeof c->split);
    c->split.in_think = ct->think_prompt && o->think; /* the template opened the reasoning block */
    c->showing = 0;
    if (rc == QF_OK) show_thinking(c, c->split.in_think), fflush(stdout);
    int32_t im_end = qf_tok_lookup(c->e->tok, "<|im_end|>");
    /* a snapshot where the last turn begins: the next prompt renders this turn again differently
     * (without its reasoning block) and shares only what lies before it */
    qf_req_params p = {.prompt = ids, .n_prompt = n, .max_tokens = o->n_predict, .sampling = *smp, .logprobs = -1, .grammar_after = -1,
                       .stop_ids = &im_end, .n_stop_ids = im_end >= 0, .snap_at = rc == QF_OK ? qf_tok_turn_start(c->e->tok, ids, n) : 0};
    qf_req_sink sink = {on_text, NULL, c};
    qf_req_status st;
    double t0 = qf_now();
    if (rc == QF_OK) rc = qf_sched_run(c->s, &p, &sink, &interrupted, &st);
    if (rc == QF_OK) think_feed(&c->split, "", 0, 1, on_part, c);
    show_thinking(c, 0);
    printf("\n");
    if (interrupted) fputs("[stopped: Ctrl-C]\n", stderr), interrupted = 0;
    if (rc == QF_OK) {
        history_add(h, "assistant", c->cur.answer ? c->cur.answer : strdup(""), c->cur.reasoning);
        double gen = qf_now() - t0 - st.ttft;
        int fresh = n - st.cached_tokens;
        fprintf(stderr, "[%d prompt tokens (%d new) at %.1f tok/s, %d generated at %.1f tok/s]\n", n, fresh, fresh / (st.ttft > 0 ? st.ttft : 1e-9),
                st.gen_tokens, st.gen_tokens / (gen > 0 ? gen : 1e-9));
    } else {
        free(c->cur.answer);
        free(c->cur.reasoning);
        free((char *)h->m[--h->n].content); /* drop the user turn that failed */
        fprintf(stderr, "error: %s\n", qf_last_error());
    }
    free(text);
    free(ids);
    return rc;
}

static void chat_loop(chat_ctx *c, const chat_opts *o, const qf_chat_tmpl *ct, const qf_sampling *smp) {
    history h = {0};
    if (o->system) history_add(&h, "system", strdup(o->system), NULL);
    char *line = NULL;
    size_t cap = 0;
    struct sigaction sa = {0}, old;
    sa.sa_handler = on_sigint; /* no SA_RESTART: Ctrl-C at the prompt interrupts the read */
    sigaction(SIGINT, &sa, &old);
    for (;;) {
        if (c->tty) fputs("> ", stderr);
        ssize_t len = getline(&line, &cap, stdin);
        if (len < 0 && errno == EINTR && interrupted) {
            interrupted = 0;
            clearerr(stdin);
            fputs("\n(Ctrl-C stops a reply; /exit or Ctrl-D leaves)\n", stderr);
            continue;
        }
        if (len < 0) break;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) break;
        if (!strcmp(line, "/reset")) {
            history_free(&h);
            memset(&h, 0, sizeof h);
            if (o->system) history_add(&h, "system", strdup(o->system), NULL);
            fputs("(conversation reset)\n", stderr);
            continue;
        }
        if (!len) continue;
        history_add(&h, "user", strdup(line), NULL);
        chat_turn(c, o, ct, &h, smp);
    }
    sigaction(SIGINT, &old, NULL);
    free(line);
    history_free(&h);
}

int cmd_chat(int argc, char **argv, qf_backend_opts *bo) {
    chat_opts o = {0};
    o.think = 1;
    o.n_predict = 1024;
    cli_engine_init(&o.eo, bo);
    o.eo.max_batch = 1 + CHAT_CHUNK; /* a step's rows: the decode row and a prompt chunk */
    o.eo.reserve_seqs = 1;
    qf_sampling user = CLI_SAMPLING_UNSET, s;
    if (parse_chat(argc, argv, &o, &user, bo)) return 2;
    qf_engine *e;
    if (cli_open_engine(&e, o.model, o.threads, &o.eo) != QF_OK) return 1;
    qf_chat_tmpl ct = {0};
    int rc = 1;
    int parsed = e->tok && qf_chat_tmpl_parse(&ct, qf_tok_chat_template(e->tok)) == QF_OK;
    if (parsed) qf_chat_tmpl_tokens(&ct, qf_tok_bos_text(e->tok), qf_tok_eos_text(e->tok));
    if (!e->tok) fprintf(stderr, "error: %s has no tokenizer.json\n", o.model);
    else if (!parsed) fprintf(stderr, "error: %s\n", qf_last_error());
    else if (cli_prepare_sampling(e, &user, o.seed_set, &s) == 0) {
        int ctx = o.ctx ? o.ctx : (e->model->cfg.max_pos < 8192 ? e->model->cfg.max_pos : 8192);
        /* the context's pages and half as many again for the snapshots, which give pages back when the conversation needs them */
        qf_sched_opts so = {.max_batch = 1, .ctx = ctx, .kv_pages = (ctx + CHAT_PAGE - 1) / CHAT_PAGE * 3 / 2 + 1, .page_tokens = CHAT_PAGE,
                            .prefill_chunk = CHAT_CHUNK, .max_queue = 1, .prefix_cache_bytes = (size_t)512 << 20, .log = stderr};
        chat_ctx c = {.e = e, .tty = isatty(1)};
        if (qf_sched_create(&c.s, e, &so) == QF_OK) {
            chat_loop(&c, &o, &ct, &s);
            rc = 0;
        } else fprintf(stderr, "error: %s\n", qf_last_error());
        qf_sched_destroy(c.s);
    }
    qf_chat_tmpl_free(&ct);
    qf_engine_close(e);
    return rc;
}
