/* Request bodies to scheduler parameters, with one 400 message per problem that names the field.
 * Unknown fields are ignored, as OpenAI-compatible servers do. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/srv_int.h"

static int bad(struct evhttp_request *req, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(struct evhttp_request *req, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    srv_send_error(req, 400, "invalid_request_error", "%s", msg);
    return -1;
}

/* Absent or null leaves *out alone. */
static int opt_num(struct evhttp_request *req, json_t *b, const char *key, double lo, double hi, float *out) {
    json_t *v = json_object_get(b, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) return bad(req, "'%s' must be a number", key);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return bad(req, "'%s' must be between %g and %g (got %g)", key, lo, hi, x);
    *out = (float)x;
    return 0;
}

static int opt_int(struct evhttp_request *req, json_t *b, const char *key, long long lo, long long hi, long long *out) {
    json_t *v = json_object_get(b, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v)) return bad(req, "'%s' must be an integer", key);
    long long x = json_integer_value(v);
    if (x < lo || x > hi) return bad(req, "'%s' must be between %lld and %lld (got %lld)", key, lo, hi, x);
    *out = x;
    return 0;
}

static int opt_bool(struct evhttp_request *req, json_t *b, const char *key, int *out) {
    json_t *v = json_object_get(b, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return bad(req, "'%s' must be true or false", key);
    *out = json_is_true(v);
    return 0;
}

static int parse_stop(struct evhttp_request *req, json_t *b, qf_req_params *p) {
    json_t *v = json_object_get(b, "stop");
    if (!v || json_is_null(v)) return 0;
    if (json_is_string(v)) v = json_pack("[O]", v);
    else if (json_is_array(v)) json_incref(v);
    else return bad(req, "'stop' must be a string or a list of strings");
    int rc = 0;
    if (json_array_size(v) > QF_MAX_STOP) rc = bad(req, "'stop' has %zu strings; at most %d", json_array_size(v), QF_MAX_STOP);
    for (size_t i = 0; rc == 0 && i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        size_t n = json_is_string(e) ? json_string_length(e) : 0;
        if (!json_is_string(e)) rc = bad(req, "'stop[%zu]' must be a string", i);
        else if (n == 0 || n > QF_MAX_STOP_LEN || memchr(json_string_value(e), 0, n))
            rc = bad(req, "'stop[%zu]' must be 1 to %d bytes", i, QF_MAX_STOP_LEN);
        else p->stop[p->n_stop++] = json_string_value(e); /* lives as long as the body */
    }
    json_decref(v); /* the strings stay owned by the body */
    return rc;
}

/* Sampling and limits shared by every generating endpoint; defaults from generation_config.json. */
static int parse_common(srv *s, struct evhttp_request *req, json_t *b, gen_req *g) {
    const qf_config *c = &s->e->model->cfg;
    qf_sampling *sp = &g->p.sampling;
    *sp = qf_sampling_default();
    sp->temperature = c->gen_temperature;
    sp->top_p = c->gen_top_p > 0 && c->gen_top_p <= 1 ? c->gen_top_p : 1.0f;
    sp->top_k = c->gen_top_k;
    static unsigned long long counter;
    sp->seed = (unsigned long long)time(NULL) * 1000003ull + ++counter;
    long long max_tokens = -1, top_k = sp->top_k, seed = 0, n = 1;
    int has_seed = json_object_get(b, "seed") && !json_is_null(json_object_get(b, "seed"));
    if (opt_num(req, b, "temperature", 0, 2, &sp->temperature) || opt_num(req, b, "top_p", 1e-9, 1, &sp->top_p) ||
        opt_num(req, b, "min_p", 0, 1, &sp->min_p) || opt_num(req, b, "presence_penalty", -2, 2, &sp->presence_penalty) ||
        opt_num(req, b, "frequency_penalty", -2, 2, &sp->frequency_penalty) ||
        opt_num(req, b, "repetition_penalty", 0.01, 10, &sp->repetition_penalty) ||
        opt_int(req, b, "top_k", -1, 1 << 30, &top_k) || opt_int(req, b, "seed", INT64_MIN, INT64_MAX, &seed) ||
        opt_int(req, b, "max_tokens", 1, 1 << 30, &max_tokens) || opt_int(req, b, "max_completion_tokens", 1, 1 << 30, &max_tokens) ||
        opt_int(req, b, "n", 1, 1, &n) || opt_bool(req, b, "stream", &g->stream) || opt_bool(req, b, "ignore_eos", &g->p.ignore_eos) ||
        parse_stop(req, b, &g->p))
        return -1;
    sp->top_k = top_k < 0 ? 0 : (int)top_k; /* -1 means off, as in vLLM */
    if (has_seed) sp->seed = (uint64_t)seed;
    g->p.max_tokens = (int)max_tokens;
    json_t *so = json_object_get(b, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) return bad(req, "'stream_options' must be an object");
        if (opt_bool(req, so, "include_usage", &g->include_usage)) return -1;
    }
    return 0;
}

/* "content" as a string or a list of text parts, joined as the chat template joins them. */
static int message_text(struct evhttp_request *req, json_t *m, size_t i, const char *key, char **out) {
    json_t *c = json_object_get(m, key);
    *out = NULL;
    if (!c || json_is_null(c)) return 0;
    if (json_is_string(c)) {
        *out = strndup(json_string_value(c), json_string_length(c));
        return 0;
    }
    if (!json_is_array(c)) return bad(req, "'messages[%zu].%s' must be a string or a list of text parts", i, key);
    size_t total = 1;
    for (size_t k = 0; k < json_array_size(c); k++) {
        json_t *part = json_array_get(c, k), *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type) || strcmp(json_string_value(type), "text") != 0 || !json_is_string(text))
            return bad(req, "'messages[%zu].%s[%zu]' must be {\"type\": \"text\", \"text\": \"...\"} (only text is supported)", i, key, k);
        total += json_string_length(text);
    }
    char *s = malloc(total);
    if (!s) return bad(req, "out of memory");
    size_t at = 0;
    for (size_t k = 0; k < json_array_size(c); k++) {
        json_t *text = json_object_get(json_array_get(c, k), "text");
        memcpy(s + at, json_string_value(text), json_string_length(text));
        at += json_string_length(text);
    }
    s[at] = 0;
    *out = s;
    return 0;
}

static int parse_messages(struct evhttp_request *req, json_t *b, qf_chat_msg **msgs, char ***texts, size_t *n) {
    json_t *ms = json_object_get(b, "messages");
    if (!json_is_array(ms) || json_array_size(ms) == 0) return bad(req, "'messages' must be a non-empty list");
    if (json_array_size(ms) > 100000) return bad(req, "'messages' has too many entries");
    *n = json_array_size(ms);
    *msgs = calloc(*n, sizeof **msgs);
    *texts = calloc(*n * 2, sizeof **texts);
    if (!*msgs || !*texts) return bad(req, "out of memory");
    for (size_t i = 0; i < *n; i++) {
        json_t *m = json_array_get(ms, i), *role = json_object_get(m, "role");
        if (!json_is_object(m)) return bad(req, "'messages[%zu]' must be an object", i);
        if (!json_is_string(role)) return bad(req, "'messages[%zu].role' must be a string", i);
        const char *r = json_string_value(role);
        if (strcmp(r, "developer") == 0) r = "system";
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant"))
            return bad(req, "'messages[%zu].role' is '%.40s'; supported roles are system, developer, user and assistant", i, r);
        if (json_object_get(m, "tool_calls") && !json_is_null(json_object_get(m, "tool_calls")))
            return bad(req, "'messages[%zu].tool_calls': tools are not supported", i);
        if (message_text(req, m, i, "content", &(*texts)[2 * i])) return -1;
        if (!(*texts)[2 * i] && strcmp(r, "assistant") != 0) return bad(req, "'messages[%zu].content' is missing", i);
        const char *rk = json_object_get(m, "reasoning_content") ? "reasoning_content" : "reasoning";
        if (strcmp(r, "assistant") == 0 && message_text(req, m, i, rk, &(*texts)[2 * i + 1])) return -1;
        (*msgs)[i] = (qf_chat_msg){r, (*texts)[2 * i] ? (*texts)[2 * i] : "", (*texts)[2 * i + 1]};
    }
    return 0;
}

static int encode(srv *s, struct evhttp_request *req, const char *text, gen_req *g) {
    int n = 0;
    if (qf_tok_encode(s->e->tok, text, strlen(text), &g->prompt, &n) != QF_OK) return bad(req, "cannot tokenize the prompt: %s", qf_last_error());
    g->p.prompt = g->prompt;
    g->p.n_prompt = n;
    return 0;
}

static int parse_logprobs_chat(struct evhttp_request *req, json_t *b, gen_req *g) {
    long long top = 0;
    if (opt_bool(req, b, "logprobs", &g->logprobs_on) || opt_int(req, b, "top_logprobs", 0, QF_MAX_TOP_LOGPROBS, &top)) return -1;
    json_t *t = json_object_get(b, "top_logprobs");
    if (t && !json_is_null(t) && !g->logprobs_on) return bad(req, "'top_logprobs' needs 'logprobs': true");
    g->top_logprobs = (int)top;
    g->p.logprobs = g->logprobs_on ? (int)top : -1;
    return 0;
}

int api_parse_chat(srv *s, struct evhttp_request *req, json_t *b, gen_req *g) {
    g->p.logprobs = -1;
    if (parse_common(s, req, b, g) || parse_logprobs_chat(req, b, g)) return -1;
    json_t *tools = json_object_get(b, "tools");
    if (tools && !json_is_null(tools) && !(json_is_array(tools) && json_array_size(tools) == 0))
        return bad(req, "'tools' are not supported by this server");
    json_t *rf = json_object_get(b, "response_format"), *rft = json_object_get(rf, "type");
    if (rf && !json_is_null(rf) && !(json_is_string(rft) && strcmp(json_string_value(rft), "text") == 0))
        return bad(req, "'response_format' other than text is not supported");
    int thinking = 1;
    json_t *kw = json_object_get(b, "chat_template_kwargs");
    if (kw && !json_is_null(kw)) {
        if (!json_is_object(kw)) return bad(req, "'chat_template_kwargs' must be an object");
        if (opt_bool(req, kw, "enable_thinking", &thinking)) return -1;
    }
    if (!s->has_tmpl) return bad(req, "this model has no chat template; use /v1/completions");
    qf_chat_msg *msgs = NULL;
    char **texts = NULL, *text = NULL;
    size_t n = 0;
    int rc = parse_messages(req, b, &msgs, &texts, &n);
    if (rc == 0 && qf_chat_render(&s->tmpl, msgs, (int)n, 1, thinking, &text) != QF_OK)
        rc = bad(req, "cannot render the chat: %s", qf_last_error());
    if (rc == 0) {
        size_t tl = strlen(text);
        g->think_prompt = tl >= 8 && memcmp(text + tl - 8, "<think>\n", 8) == 0;
        rc = encode(s, req, text, g);
    }
    for (size_t i = 0; texts && i < 2 * n; i++) free(texts[i]);
    free(texts);
    free(msgs);
    free(text);
    return rc;
}

/* prompt: a string, a list of token ids, or a one-element list of either. */
static int parse_prompt(srv *s, struct evhttp_request *req, json_t *b, gen_req *g) {
    json_t *p = json_object_get(b, "prompt");
    if (json_is_array(p) && json_array_size(p) == 1 && (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        p = json_array_get(p, 0);
    if (json_is_string(p)) {
        if (json_string_length(p) == 0) return bad(req, "'prompt' is empty");
        if (memchr(json_string_value(p), 0, json_string_length(p))) return bad(req, "'prompt' contains a NUL character");
        return encode(s, req, json_string_value(p), g);
    }
    if (!json_is_array(p) || json_array_size(p) == 0) return bad(req, "'prompt' must be a non-empty string or list of token ids (one prompt per request)");
    size_t n = json_array_size(p);
    if (n > (size_t)s->o->sched.ctx) return bad(req, "the prompt has %zu tokens; the context is %d tokens", n, s->o->sched.ctx);
    g->prompt = malloc(n * sizeof *g->prompt);
    if (!g->prompt) return bad(req, "out of memory");
    int V = s->e->model->cfg.vocab;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(p, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= V)
            return bad(req, "'prompt[%zu]' must be a token id between 0 and %d", i, V - 1);
        g->prompt[i] = (int32_t)json_integer_value(t);
    }
    g->p.prompt = g->prompt;
    g->p.n_prompt = (int)n;
    return 0;
}

int api_parse_completion(srv *s, struct evhttp_request *req, json_t *b, gen_req *g, int native) {
    g->p.logprobs = -1;
    if (parse_common(s, req, b, g)) return -1;
    long long lp = -1;
    int echo = 0;
    if (opt_int(req, b, "logprobs", 0, QF_MAX_TOP_LOGPROBS, &lp) || opt_bool(req, b, "echo", &echo)) return -1;
    if (echo) return bad(req, "'echo' is not supported");
    json_t *suffix = json_object_get(b, "suffix"), *best_of = json_object_get(b, "best_of");
    if (suffix && !json_is_null(suffix)) return bad(req, "'suffix' is not supported");
    if (best_of && !json_is_null(best_of) && !(json_is_integer(best_of) && json_integer_value(best_of) == 1))
        return bad(req, "'best_of' must be 1");
    g->logprobs_on = lp >= 0;
    g->top_logprobs = (int)(lp < 0 ? 0 : lp);
    g->p.logprobs = (int)lp;
    if (native) g->stream = 1;
    return parse_prompt(s, req, b, g);
}

void gen_req_clear(gen_req *g) {
    free(g->prompt);
    g->prompt = NULL;
}

/* ---- /tokenize, /detokenize (vLLM's and llama-server's field names both work) ---- */

void api_tokenize(srv *s, struct evhttp_request *req, json_t *b) {
    gen_req g;
    memset(&g, 0, sizeof g);
    json_t *text = json_object_get(b, "prompt");
    if (!text) text = json_object_get(b, "content");
    int rc;
    if (json_object_get(b, "messages")) {
        rc = api_parse_chat(s, req, b, &g);
    } else if (!json_is_string(text)) {
        rc = bad(req, "'prompt' (or 'content') must be a string, or give 'messages'");
    } else {
        rc = encode(s, req, json_string_value(text), &g);
    }
    if (rc == 0) {
        json_t *ids = json_array();
        for (int i = 0; i < g.p.n_prompt; i++) json_array_append_new(ids, json_integer(g.prompt[i]));
        srv_count(s, 200);
        srv_send_json(req, 200, json_pack("{s:o,s:i,s:i}", "tokens", ids, "count", g.p.n_prompt, "max_model_len", s->o->sched.ctx));
    } else {
        srv_count(s, 400);
    }
    gen_req_clear(&g);
}

void api_detokenize(srv *s, struct evhttp_request *req, json_t *b) {
    json_t *t = json_object_get(b, "tokens");
    int V = qf_tok_vocab_size(s->e->tok); /* the model's rows past the tokenizer's ids have no text */
    if (!json_is_array(t) || json_array_size(t) > (size_t)1 << 24) {
        srv_count(s, 400);
        bad(req, "'tokens' must be a list of token ids");
        return;
    }
    size_t n = json_array_size(t);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    for (size_t i = 0; ids && i < n; i++) {
        json_t *v = json_array_get(t, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= V) {
            free(ids);
            srv_count(s, 400);
            bad(req, "'tokens[%zu]' must be a token id between 0 and %d", i, V - 1);
            return;
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    char *text = NULL;
    size_t len = 0;
    int rc = ids ? qf_tok_decode(s->e->tok, ids, (int)n, 0, &text, &len) : QF_ENOMEM;
    if (rc != QF_OK) {
        free(ids);
        int code = rc == QF_EINVAL ? 400 : 500;
        srv_count(s, code);
        if (code == 400) bad(req, "'tokens': %s", qf_last_error());
        else srv_send_error(req, 500, "server_error", "cannot decode: out of memory");
        return;
    }
    srv_count(s, 200); /* text may hold NUL bytes (the byte token 0): sized strings */
    srv_send_json(req, 200, json_pack("{s:s%,s:s%}", "prompt", text, len, "content", text, len));
    free(ids);
    free(text);
}
