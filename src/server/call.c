/* Generation calls: submit to the scheduler, drain output on wake-ups, and write it as OpenAI
 * SSE chunks, a final JSON body, or (native /generate) plain text chunks. */
#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/utf8.h"
#include "server/server_int.h"
#include "server/toolcall.h"

static const char *finish_name(int f) { return f == QF_FINISH_LENGTH ? "length" : f == QF_FINISH_CANCELLED ? "abort" : "stop"; }

/* ---- per-poll deltas ---- */

typedef struct delta {
    call *c;
    char *content, *reasoning;
    size_t len_c, cap_c, len_r, cap_r;
    json_t *lp; /* this poll's logprobs entries (streams) */
} delta;

static void emit(void *ud, int reasoning, const char *p, size_t n) {
    delta *d = ud;
    if (reasoning) acc_add(&d->reasoning, &d->len_r, &d->cap_r, p, n);
    else acc_add(&d->content, &d->len_c, &d->cap_c, p, n);
}

static void split_text(delta *d, const char *text, size_t n, int final) {
    if (d->c->kind != CALL_CHAT) emit(d, 0, text, n);
    else think_feed(&d->c->think, text, n, final, emit, d);
}

static void sink_text(void *ud, const char *p, size_t n) { split_text(ud, p, n, 0); }

static json_t *top_entry_chat(const qf_tokenizer *t, int32_t id, float lp) {
    size_t n = 0;
    const char *p = qf_tok_piece(t, id, &n);
    json_t *bytes = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(bytes, json_integer((unsigned char)p[i]));
    return json_pack("{s:o,s:f,s:o}", "token", jstr_lossy(p ? p : "", n), "logprob", (double)lp, "bytes", bytes);
}

static void sink_token(void *ud, const qf_token_lp *t) {
    delta *d = ud;
    call *c = d->c;
    const qf_tokenizer *tok = c->s->e->tok;
    json_t *target = c->stream ? d->lp : c->lp;
    if (c->kind == CALL_CHAT) {
        json_t *e = top_entry_chat(tok, t->id, t->logprob), *tops = json_array();
        for (int i = 0; i < t->n_top; i++) json_array_append_new(tops, top_entry_chat(tok, t->top_id[i], t->top_lp[i]));
        json_object_set_new(e, "top_logprobs", tops);
        json_array_append_new(target, e);
        return;
    }
    size_t n = 0;
    const char *p = qf_tok_piece(tok, t->id, &n);
    json_t *tops = json_object();
    for (int i = 0; i < t->n_top; i++) {
        size_t m = 0;
        const char *q = qf_tok_piece(tok, t->top_id[i], &m);
        json_t *key = jstr_lossy(q ? q : "", m);
        json_object_set_new(tops, json_string_value(key), json_real(t->top_lp[i]));
        json_decref(key);
    }
    json_array_append_new(json_object_get(target, "tokens"), jstr_lossy(p ? p : "", n));
    json_array_append_new(json_object_get(target, "token_logprobs"), json_real(t->logprob));
    json_array_append_new(json_object_get(target, "top_logprobs"), tops);
    json_array_append_new(json_object_get(target, "text_offset"), json_integer(c->lp_offset));
    for (size_t i = 0; i < n; i++) c->lp_offset += ((unsigned char)p[i] & 0xC0) != 0x80; /* characters, as OpenAI counts them */
}

static json_t *new_lp(const call *c) {
    if (c->kind == CALL_CHAT) return json_array();
    return json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

/* ---- writing ---- */

static void send_sse(call *c, json_t *obj) {
    char *text = json_dumps(obj, JSON_COMPACT);
    json_decref(obj);
    struct evbuffer *b = evbuffer_new();
    if (text && b) {
        evbuffer_add_printf(b, "data: %s\n\n", text);
        evhttp_send_reply_chunk(c->http, b);
    }
    if (b) evbuffer_free(b);
    free(text);
}

static json_t *usage(const qf_req_status *st) {
    return json_pack("{s:i,s:i,s:i,s:{s:i}}", "prompt_tokens", st->prompt_tokens, "completion_tokens", st->gen_tokens, "total_tokens",
                     st->prompt_tokens + st->gen_tokens, "prompt_tokens_details", "cached_tokens", st->cached_tokens);
}

static json_t *chunk_head(const call *c) {
    const char *obj = c->kind == CALL_CHAT ? "chat.completion.chunk" : "text_completion";
    return json_pack("{s:s,s:s,s:I,s:s}", "id", c->id, "object", obj, "created", (json_int_t)c->created, "model", c->s->model_name);
}

static json_t *choice_delta(const call *c, const delta *d, const char *finish) {
    json_t *ch = json_pack("{s:i}", "index", c->index);
    if (c->kind == CALL_CHAT) {
        json_t *dl = json_object();
        if (d && d->len_r) {
            json_object_set_new(dl, "reasoning_content", jstr_lossy(d->reasoning, d->len_r));
            json_object_set_new(dl, "reasoning", jstr_lossy(d->reasoning, d->len_r));
        }
        if (d && d->len_c) json_object_set_new(dl, "content", jstr_lossy(d->content, d->len_c));
        json_object_set_new(ch, "delta", dl);
        json_object_set_new(ch, "logprobs", d && d->lp && json_array_size(d->lp) ? json_pack("{s:O}", "content", d->lp) : json_null());
    } else {
        json_object_set_new(ch, "text", d && d->content ? jstr_lossy(d->content, d->len_c) : json_string(""));
        json_object_set_new(ch, "logprobs", d && d->lp && json_array_size(json_object_get(d->lp, "tokens")) ? json_incref(d->lp) : json_null());
    }
    json_object_set_new(ch, "finish_reason", finish ? json_string(finish) : json_null());
    return ch;
}

static void stream_delta(call *c, delta *d, const char *finish) {
    if (c->kind == CALL_GENERATE) {
        if (d->len_c) {
            struct evbuffer *b = evbuffer_new();
            if (b) {
                evbuffer_add(b, d->content, d->len_c);
                evhttp_send_reply_chunk(c->http, b);
                evbuffer_free(b);
            }
        }
        return;
    }
    if (c->api != API_CHAT) {
        dl_stream_text(c, 1, d->reasoning, d->len_r);
        dl_stream_text(c, 0, d->content, d->len_c);
        return;
    }
    json_t *ch = chunk_head(c);
    json_object_set_new(ch, "choices", json_pack("[o]", choice_delta(c, d, finish)));
    send_sse(c, ch);
}

/* A stream whose reply may call tools: content goes out up to where a call could start; at the
 * end the held text is parsed, and goes out as tool_calls deltas (one per call, whole) or as
 * content. */
static void stream_held(call *c, delta *d, int final) {
    acc_add(&c->acc_c, &c->len_c, &c->cap_c, d->content ? d->content : "", d->len_c);
    /* only the unsent tail is scanned (what was sent holds no call start): each poll costs its new text */
    size_t upto = final ? c->len_c : c->sent_c + tc_safe_len(c->acc_c ? c->acc_c + c->sent_c : "", c->len_c - c->sent_c), keep_len = d->len_c;
    json_t *calls = NULL;
    if (final) tc_parse(c->acc_c ? c->acc_c : "", c->len_c, c->tools, c->id, &calls, &upto);
    char *keep = d->content;
    d->content = c->acc_c + c->sent_c, d->len_c = upto > c->sent_c ? upto - c->sent_c : 0;
    if (d->len_c || d->len_r || (d->lp && json_array_size(d->lp))) stream_delta(c, d, NULL);
    c->sent_c = upto > c->sent_c ? upto : c->sent_c;
    d->content = keep, d->len_c = keep_len;
    if (calls && c->api != API_CHAT) dl_stream_calls(c, calls);
    for (size_t i = 0; calls && c->api == API_CHAT && i < json_array_size(calls); i++) {
        json_t *tc = json_deep_copy(json_array_get(calls, i)), *ch = chunk_head(c);
        json_object_set_new(tc, "index", json_integer((json_int_t)i));
        json_object_set_new(ch, "choices", json_pack("[{s:i,s:{s:[o]},s:n,s:n}]", "index", c->index, "delta", "tool_calls", tc, "logprobs", "finish_reason"));
        send_sse(c, ch);
    }
    if (calls) c->tool_called = 1;
    json_decref(calls);
}

/* A choice's last chunk (finish_reason), or the error. */
static void stream_finish_choice(call *c, const qf_req_status *st) {
    if (st->finish == QF_FINISH_ERROR) send_sse(c, json_pack("{s:{s:s,s:s,s:i}}", "error", "message", st->error, "type", "server_error", "code", 500));
    else stream_delta(c, &(delta){c, NULL, NULL, 0, 0, 0, 0, NULL}, c->tool_called ? "tool_calls" : finish_name(st->finish));
}

/* The usage chunk (all choices' tokens), [DONE], and the end of the reply. */
static void stream_close(call *c, const qf_req_status *st) {
    if (c->include_usage && st->finish != QF_FINISH_ERROR) {
        json_t *u = chunk_head(c);
        json_object_set_new(u, "choices", json_array());
        json_object_set_new(u, "usage", usage(st));
        send_sse(c, u);
    }
    struct evbuffer *b = evbuffer_new();
    if (b) {
        evbuffer_add(b, "data: [DONE]\n\n", 14);
        evhttp_send_reply_chunk(c->http, b);
        evbuffer_free(b);
    }
    evhttp_send_reply_end(c->http);
}

static void stream_end(call *c, const qf_req_status *st) {
    if (c->api != API_CHAT) {
        dl_stream_end(c, st);
        return;
    }
    if (c->kind == CALL_GENERATE) {
        evhttp_send_reply_end(c->http);
        return;
    }
    stream_finish_choice(c, st);
    stream_close(c, st);
}

/* A whole choice (index c->index); NULL when the reply is the dialect's own (sent here). */
static json_t *choice_whole(call *c, const qf_req_status *st) {
    const char *finish = finish_name(st->finish);
    json_t *ch = json_pack("{s:i}", "index", c->index);
    if (c->kind == CALL_CHAT) {
        json_t *msg = json_pack("{s:s}", "role", "assistant"), *calls = NULL;
        size_t clen = c->len_c;
        if (c->tools) tc_parse(c->acc_c ? c->acc_c : "", c->len_c, c->tools, c->id, &calls, &clen);
        if (c->api != API_CHAT) {
            json_decref(ch), json_decref(msg);
            dl_reply_whole(c, st, c->acc_c, clen, calls);
            return NULL;
        }
        json_object_set_new(msg, "content", calls && !clen ? json_null() : jstr_lossy(c->acc_c ? c->acc_c : "", clen));
        if (calls) json_object_set_new(msg, "tool_calls", calls), finish = "tool_calls";
        json_object_set_new(msg, "reasoning_content", c->len_r ? jstr_lossy(c->acc_r, c->len_r) : json_null());
        json_object_set_new(msg, "reasoning", c->len_r ? jstr_lossy(c->acc_r, c->len_r) : json_null());
        json_object_set_new(ch, "message", msg);
        json_object_set_new(ch, "logprobs", c->lp ? json_pack("{s:O}", "content", c->lp) : json_null());
    } else {
        json_object_set_new(ch, "text", jstr_lossy(c->acc_c ? c->acc_c : "", c->len_c));
        json_object_set_new(ch, "logprobs", c->lp ? json_incref(c->lp) : json_null());
    }
    json_object_set_new(ch, "finish_reason", json_string(finish));
    return ch;
}

/* The whole reply: choices (stolen) and the usage of st. */
static void send_whole(call *c, json_t *choices, const qf_req_status *st) {
    json_t *body = chunk_head(c);
    if (c->kind == CALL_CHAT) json_object_set_new(body, "object", json_string("chat.completion"));
    json_object_set_new(body, "choices", choices);
    json_object_set_new(body, "usage", usage(st));
    srv_count(c->s, 200);
    srv_send_json(c->http, 200, body);
}

static void reply_whole(call *c, const qf_req_status *st) {
    if (st->finish == QF_FINISH_ERROR) {
        srv_count(c->s, 500);
        srv_send_error(c->http, 500, "server_error", "%s", st->error);
        return;
    }
    json_t *ch = choice_whole(c, st);
    if (ch) send_whole(c, json_pack("[o]", ch), st);
}

/* ---- lifetime ---- */

/* n > 1: the choices of one request, each its own call and sequence, share the HTTP reply. The
 * calls stay until the last one ends; then the reply is closed (stream) or sent whole. */
typedef struct group {
    call *child[QF_MAX_CHOICES];
    int n, left, failed, cancelled, ended;
    json_t *choices;          /* non-streamed: each choice where it ends, by index */
    qf_req_status sum;        /* the usage of all choices (the prompt once) */
    char err[256];
} group;

/* A call's own memory (one not in the server's list, or taken out of it). */
static void call_destroy(call *c) {
    qf_req_release(c->r);
    json_decref(c->lp);
    json_decref(c->tools);
    dl_free(c);
    free(c->acc_c);
    free(c->acc_r);
    free(c);
}

static void call_free(call *c) {
    srv *s = c->s;
    if (c->prev) c->prev->next = c->next;
    else s->calls = c->next;
    if (c->next) c->next->prev = c->prev;
    s->n_calls--;
    call_destroy(c);
}

static void group_free(group *g) {
    for (int i = 0; i < g->n; i++)
        if (g->child[i]) call_free(g->child[i]);
    json_decref(g->choices);
    free(g);
}

static void on_close_group(struct evhttp_connection *evcon, void *arg) {
    (void)evcon;
    group *g = arg;
    struct evhttp_request *http = g->child[0]->http;
    if (http && !evhttp_request_get_connection(http)) evhttp_request_free(http);
    for (int i = 0; i < g->n; i++) g->child[i]->http = NULL, qf_req_cancel(g->child[i]->r);
    if (g->child[0]->sched) qf_sched_kick(g->child[0]->sched);
    group_free(g);
}

static void on_close(struct evhttp_connection *evcon, void *arg) {
    (void)evcon;
    call *c = arg;
    /* the client left before the reply ended: libevent detached the request, we free it */
    if (c->http && !evhttp_request_get_connection(c->http)) evhttp_request_free(c->http);
    c->http = NULL;
    qf_req_cancel(c->r);
    if (c->sched) qf_sched_kick(c->sched);
    call_free(c);
}

static void detach(call *c) {
    struct evhttp_connection *evcon = evhttp_request_get_connection(c->http);
    if (evcon) evhttp_connection_set_closecb(evcon, NULL, NULL);
}

void call_notify(void *ud) {
    srv *s = ud;
    event_active(s->wake, EV_READ, 0);
}

/* A choice of a group ended; the last one ends the reply. */
static void group_end(call *c, const qf_req_status *st) {
    group *g = c->grp;
    c->done = 1;
    if (st->finish == QF_FINISH_ERROR && !g->failed) g->failed = 1, snprintf(g->err, sizeof g->err, "%s", st->error);
    g->cancelled |= st->finish == QF_FINISH_CANCELLED;
    g->sum.prompt_tokens = st->prompt_tokens;
    g->sum.gen_tokens += st->gen_tokens;
    if (c->index == 0) g->sum.cached_tokens = st->cached_tokens;
    if (c->stream) stream_finish_choice(c, st);
    else if (st->finish != QF_FINISH_ERROR) json_array_set_new(g->choices, (size_t)c->index, choice_whole(c, st));
    if (--g->left) return;
    call *first = g->child[0];
    detach(first);
    g->sum.finish = g->failed ? QF_FINISH_ERROR : QF_FINISH_STOP;
    if (first->stream) stream_close(first, &g->sum);
    else if (g->failed) srv_count(first->s, 500), srv_send_error(first->http, 500, "server_error", "%s", g->err);
    else if (g->cancelled) srv_count(first->s, 503), srv_send_error(first->http, 503, "unavailable_error", "the request was cancelled (server shutting down)");
    else send_whole(first, json_incref(g->choices), &g->sum);
    g->ended = 1; /* freed after this pump: other choices of it may be next in the list */
}

static void call_pump(call *c) {
    if (c->done) return;
    delta d = {c, NULL, NULL, 0, 0, 0, 0, c->stream && c->logprobs ? new_lp(c) : NULL};
    qf_req_sink sink = {sink_text, c->logprobs ? sink_token : NULL, &d};
    qf_req_status st;
    qf_req_poll(c->r, &sink, &st);
    if (st.finish != QF_FINISH_NONE) split_text(&d, "", 0, 1);
    if (!c->stream) {
        acc_add(&c->acc_c, &c->len_c, &c->cap_c, d.content ? d.content : "", d.len_c);
        acc_add(&c->acc_r, &c->len_r, &c->cap_r, d.reasoning ? d.reasoning : "", d.len_r);
    } else if (c->tools) {
        stream_held(c, &d, st.finish != QF_FINISH_NONE && st.finish != QF_FINISH_ERROR);
    } else if (d.len_c || d.len_r || (d.lp && json_array_size(c->kind == CALL_CHAT ? d.lp : json_object_get(d.lp, "tokens")))) {
        stream_delta(c, &d, NULL);
    }
    free(d.content);
    free(d.reasoning);
    json_decref(d.lp);
    if (st.finish == QF_FINISH_NONE) return;
    if (c->grp) {
        group_end(c, &st);
        return;
    }
    detach(c);
    if (st.finish == QF_FINISH_CANCELLED) { /* server shutdown: a stream ends with finish_reason "abort" and [DONE] */
        if (c->stream) stream_end(c, &st);
        else srv_send_error(c->http, 503, "unavailable_error", "the request was cancelled (server shutting down)");
    } else if (c->stream) {
        stream_end(c, &st);
    } else {
        reply_whole(c, &st);
    }
    call_free(c);
}

void calls_pump(srv *s) {
    for (call *c = s->calls, *next; c; c = next) {
        next = c->next;
        call_pump(c);
    }
    for (;;) { /* groups whose reply ended go now, every choice at once */
        group *g = NULL;
        for (call *c = s->calls; c && !g; c = c->next)
            if (c->grp && c->grp->ended) g = c->grp;
        if (!g) break;
        group_free(g);
    }
}

/* Calls exist only once the scheduler does; it finishes each cancelled request and the wake-up
 * pump ends its reply. */
void calls_cancel_all(srv *s) {
    for (call *c = s->calls; c; c = c->next) qf_req_cancel(c->r);
    for (int i = 0; i < s->n_dp; i++) qf_sched_kick(s->sx[i]);
}

static void stream_begin(call *c, int n_choices) {
    struct evkeyvalq *h = evhttp_request_get_output_headers(c->http);
    evhttp_add_header(h, "Content-Type", c->kind == CALL_GENERATE ? "text/plain; charset=utf-8" : "text/event-stream");
    evhttp_add_header(h, "Cache-Control", "no-cache");
    evhttp_add_header(h, "X-Accel-Buffering", "no");
    evhttp_send_reply_start(c->http, 200, "OK");
    srv_count(c->s, 200);
    if (c->api != API_CHAT) dl_stream_begin(c);
    else if (c->kind == CALL_CHAT)
        for (int i = 0; i < n_choices; i++) {
            json_t *ch = chunk_head(c);
            json_object_set_new(ch, "choices", json_pack("[{s:i,s:{s:s,s:s},s:n,s:n}]", "index", i, "delta", "role", "assistant", "content", "",
                                                         "logprobs", "finish_reason"));
            send_sse(c, ch);
        }
}

/* A call for the request (not yet submitted). */
static call *call_new(srv *s, struct evhttp_request *req, gen_req *g, int kind) {
    call *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    static unsigned long long counter;
    c->s = s, c->http = req, c->kind = kind, c->stream = g->stream, c->include_usage = g->include_usage && g->stream;
    c->logprobs = g->logprobs_on;
    c->think.in_think = g->think_prompt;
    c->tools = json_incref(g->tools);
    c->api = g->api;
    c->orig = json_incref(g->orig);
    c->created = (long long)time(NULL);
    c->n_prompt = g->p.n_prompt;
    static const char *const prefix[] = {"chatcmpl-", "resp_", "msg_"};
    snprintf(c->id, sizeof c->id, "%s%llx%06llx", kind == CALL_CHAT ? prefix[c->api] : "cmpl-", c->created, ++counter);
    if (c->logprobs && !c->stream) c->lp = new_lp(c);
    return c;
}

static void call_link(srv *s, call *c) {
    c->next = s->calls;
    if (s->calls) s->calls->prev = c;
    s->calls = c;
    s->n_calls++;
}

static void submit_failed(srv *s, struct evhttp_request *req, int rc) {
    int code = rc == QF_EBUSY ? 503 : rc == QF_EINVAL ? 400 : 500;
    srv_count(s, code);
    if (code == 503) evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", "1");
    srv_send_error(req, code, code == 400 ? "invalid_request_error" : code == 503 ? "unavailable_error" : "server_error", "%s", qf_last_error());
}

/* n > 1: a call per choice; the first prefills the prompt, the others start from its copy. */
static void group_start(srv *s, struct evhttp_request *req, gen_req *g, int kind) {
    group *grp = calloc(1, sizeof *grp);
    qf_req *r[QF_MAX_CHOICES];
    int rc = grp ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    if (grp) grp->choices = json_array(), grp->n = grp->left = g->n;
    for (int i = 0; rc == QF_OK && i < g->n; i++) {
        json_array_append_new(grp->choices, json_null());
        call *c = call_new(s, req, g, kind);
        if (!c) rc = qf_fail(QF_ENOMEM, "out of memory");
        else c->grp = grp, c->index = i, grp->child[i] = c;
        if (c && i) memcpy(c->id, grp->child[0]->id, sizeof c->id), c->created = grp->child[0]->created;
    }
    g->p.notify = call_notify;
    g->p.notify_ud = s;
    qf_sched *to = srv_pick(s);
    if (rc == QF_OK) rc = qf_sched_submit_n(to, &g->p, g->n, r);
    else qf_grammar_free(g->p.grammar);
    g->p.grammar = NULL; /* the scheduler's now */
    for (int i = 0; grp && i < g->n; i++)
        if (grp->child[i]) grp->child[i]->r = rc == QF_OK ? r[i] : NULL, grp->child[i]->sched = to, call_link(s, grp->child[i]);
    if (rc != QF_OK) {
        if (grp) group_free(grp);
        submit_failed(s, req, rc);
        return;
    }
    evhttp_connection_set_closecb(evhttp_request_get_connection(req), on_close_group, grp);
    if (g->stream) stream_begin(grp->child[0], g->n);
}

void call_start(srv *s, struct evhttp_request *req, gen_req *g, int kind) {
    if (g->n > 1) {
        group_start(s, req, g, kind);
        return;
    }
    call *c = call_new(s, req, g, kind);
    if (!c) {
        srv_count(s, 500);
        srv_send_error(req, 500, "server_error", "out of memory");
        return;
    }
    g->p.notify = call_notify;
    g->p.notify_ud = s;
    c->sched = srv_pick(s);
    int rc = qf_sched_submit(c->sched, &g->p, &c->r);
    g->p.grammar = NULL; /* the scheduler's now */
    if (rc != QF_OK) {
        submit_failed(s, req, rc);
        call_destroy(c);
        return;
    }
    call_link(s, c);
    evhttp_connection_set_closecb(evhttp_request_get_connection(req), on_close, c);
    if (c->stream) stream_begin(c, 1);
}
