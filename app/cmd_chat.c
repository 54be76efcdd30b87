/* qflash chat: multi-turn chat through the model's own chat template. Reasoning (<think>...</think>)
 * is printed apart from the answer and kept out of the history, as the template expects. The
 * model state is reused between turns when the new prompt extends what it already holds, and
 * otherwise (the template drops the reasoning from the history) from the prefix snapshot kept at
 * the end of the last prompt, so no turn prefills the conversation again. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "runtime/prefix.h"
#include "tokenizer/chat.h"

typedef struct turn_buf {
    char *answer, *reasoning;
    size_t n_answer, n_reasoning;
} turn_buf;

typedef struct chat_ctx {
    qf_engine *e;
    int think_id, end_think_id, im_end_id, in_think, tty;
    turn_buf cur;
    int32_t *hist; /* tokens the state holds */
    int n_hist, cap_hist;
    qf_prefix *prefix; /* snapshots at the end of each prompt */
} chat_ctx;

static void append(char **buf, size_t *n, const char *s, size_t len) {
    char *nb = realloc(*buf, *n + len + 1);
    if (!nb) return;
    memcpy(nb + *n, s, len);
    *n += len;
    nb[*n] = 0;
    *buf = nb;
}

static void hist_push(chat_ctx *c, int32_t tok) {
    if (c->n_hist == c->cap_hist) {
        int cap = c->cap_hist ? c->cap_hist * 2 : 1024;
        int32_t *nh = realloc(c->hist, (size_t)cap * sizeof *nh);
        if (!nh) return;
        c->hist = nh;
        c->cap_hist = cap;
    }
    c->hist[c->n_hist++] = tok;
}

/* Ctrl-C stops the reply being written, not the session (a signal handler can only set a flag). */
static volatile sig_atomic_t interrupted;
static void on_sigint(int sig) {
    (void)sig;
    interrupted = 1;
}

static int on_token(void *ud, int32_t tok, const char *text, size_t len) {
    chat_ctx *c = ud;
    if (interrupted) return 1;
    if (tok >= 0) hist_push(c, tok);
    if (tok == c->im_end_id) return 1;
    if (tok == c->think_id || tok == c->end_think_id) {
        c->in_think = tok == c->think_id;
        fputs(c->in_think ? (c->tty ? "\033[2m[thinking]\n" : "[thinking]\n") : (c->tty ? "\n[/thinking]\033[0m\n" : "\n[/thinking]\n"), stdout);
        fflush(stdout);
        return 0;
    }
    if (c->in_think) append(&c->cur.reasoning, &c->cur.n_reasoning, text, len);
    else append(&c->cur.answer, &c->cur.n_answer, text, len);
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return 0;
}

/* Feeds only the part of the new prompt the state does not hold yet; otherwise starts from the
 * longest prefix snapshot of it, or from nothing. */
static void prepare_prompt(chat_ctx *c, qf_state *st, const int32_t *ids, int n, int *skip) {
    int common = 0;
    while (common < n && common < c->n_hist && ids[common] == c->hist[common]) common++;
    if (common < c->n_hist || common == n) {
        qf_state_reset(st);
        qf_prefix_evict(c->prefix, 1); /* a snapshot's partial page is copied */
        common = qf_prefix_restore(c->prefix, st, ids, n);
        c->n_hist = 0;
        for (int i = 0; i < common; i++) hist_push(c, ids[i]);
    }
    *skip = common;
    for (int i = common; i < n; i++) hist_push(c, ids[i]);
}

/* The prompt but its last token, then a snapshot there (the next turn's prompt begins with it). */
static int prefill_and_keep(chat_ctx *c, qf_state *st, const int32_t *ids, int n, int skip, int room) {
    qf_prefix_evict(c->prefix, qf_state_pages_needed(st, n - st->pos + room));
    /* a snapshot where the last turn begins too: the next prompt renders this turn again
     * differently (without its reasoning block) and shares only what lies before it */
    int marks[2] = {qf_tok_turn_start(c->e->tok, ids, n), n - 1};
    for (int i = 0; i < 2; i++) {
        if (marks[i] <= skip) continue;
        int rc = qf_forward_seq(c->e->model, &c->e->be, c->e->ws, st, ids + skip, marks[i] - skip, QF_LOGITS_NONE, NULL);
        if (rc != QF_OK) return rc;
        qf_prefix_save(c->prefix, st, ids);
        skip = marks[i];
    }
    return QF_OK;
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

/* One user turn: render, tokenize, generate, keep the answer in the history. */
static int chat_turn(chat_ctx *c, const chat_opts *o, const qf_chat_tmpl *ct, history *h, qf_state *st, qf_sampler *smp) {
    char *text = NULL;
    int32_t *ids = NULL;
    int n = 0, skip = 0;
    int rc = qf_chat_render(ct, h->m, h->n, 1, o->think, &text);
    if (rc == QF_OK) rc = qf_tok_encode(c->e->tok, text, strlen(text), &ids, &n);
    if (rc == QF_OK && n + 1 >= st->max_ctx) rc = qf_fail(QF_EINVAL, "the conversation (%d tokens) no longer fits the context (%d)", n, st->max_ctx);
    if (rc == QF_OK) prepare_prompt(c, st, ids, n, &skip);
    c->in_think = ct->think_prompt && o->think;
    if (rc == QF_OK && c->in_think) fputs(c->tty ? "\033[2m[thinking]\n" : "[thinking]\n", stdout);
    memset(&c->cur, 0, sizeof c->cur);
    qf_sampler_reset(smp);
    qf_gen_stats stats;
    int room = st->max_ctx - n - 1;
    room = o->n_predict < room ? o->n_predict : room;
    if (rc == QF_OK) rc = prefill_and_keep(c, st, ids, n, skip, room);
    if (rc == QF_OK) {
        int from = skip < n - 1 ? n - 1 : skip;
        qf_gen_request req = {ids + from, n - from, room, smp, on_token, c};
        for (int i = 0; i < from; i++) qf_sampler_accept(smp, ids[i], 0);
        rc = qf_engine_generate(c->e, st, &req, &stats);
    }
    if (c->in_think) fputs(c->tty ? "\033[0m" : "", stdout);
    printf("\n");
    if (interrupted) fputs("[stopped: Ctrl-C]\n", stderr), interrupted = 0;
    if (rc == QF_OK) {
        history_add(h, "assistant", c->cur.answer ? c->cur.answer : strdup(""), c->cur.reasoning);
        fprintf(stderr, "[%d prompt tokens (%d new) at %.1f tok/s, %d generated at %.1f tok/s]\n", n, n - skip,
                stats.prompt_tokens / (stats.prompt_seconds > 0 ? stats.prompt_seconds : 1e-9), stats.gen_tokens,
                stats.gen_tokens / (stats.gen_seconds > 0 ? stats.gen_seconds : 1e-9));
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

static void chat_loop(chat_ctx *c, const chat_opts *o, const qf_chat_tmpl *ct, qf_state *st, qf_sampler *smp) {
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
        chat_turn(c, o, ct, &h, st, smp);
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
        chat_ctx c = {e, qf_tok_lookup(e->tok, "<think>"), qf_tok_lookup(e->tok, "</think>"), qf_tok_lookup(e->tok, "<|im_end|>"), 0,
                      isatty(1), {0}, NULL, 0, 0, NULL};
        int ctx = o.ctx ? o.ctx : (e->model->cfg.max_pos < 8192 ? e->model->cfg.max_pos : 8192);
        /* the context's pages and half as many again for the snapshots, which give pages back when the conversation needs them */
        enum { PAGE = 16 };
        qf_kv_pool *pool = qf_kv_pool_create(e->model, PAGE, (ctx + PAGE - 1) / PAGE * 3 / 2 + 1);
        qf_state *st = pool ? qf_state_create_paged(e->model, pool, ctx) : NULL;
        qf_sampler *smp = qf_sampler_create(e->model->cfg.vocab, &s);
        if (st && qf_prefix_create(&c.prefix, pool, qf_state_bytes(e->model), qf_kv_pool_page_bytes(e->model, PAGE), (size_t)512 << 20) != QF_OK) c.prefix = NULL;
        if (st && smp && c.prefix) {
            chat_loop(&c, &o, &ct, st, smp);
            rc = 0;
        } else fprintf(stderr, "error: out of memory (context %d)\n", ctx);
        free(c.hist);
        qf_sampler_free(smp);
        qf_state_free(st);
        qf_prefix_free(c.prefix);
        qf_kv_pool_free(pool);
    }
    qf_chat_tmpl_free(&ct);
    qf_engine_close(e);
    return rc;
}
