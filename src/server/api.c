/* Request bodies to scheduler parameters, with one 400 message per problem that names the field.
 * Unknown fields are ignored, as OpenAI-compatible servers do. These run on the preparation
 * workers (prep.c), never on the event loop: they only read the server's tokenizer, template and
 * options, and leave their answer in an api_out. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/server_int.h"

int api_bad(api_out *ao, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ao->msg, sizeof ao->msg, fmt, ap);
    va_end(ap);
    ao->code = 400;
    return -1;
}

/* Absent or null leaves *out alone. */
static int opt_num(api_out *ao, json_t *b, const char *key, double lo, double hi, float *out) {
    json_t *v = json_object_get(b, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) return api_bad(ao, "'%s' must be a number", key);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return api_bad(ao, "'%s' must be between %g and %g (got %g)", key, lo, hi, x);
    *out = (float)x;
    return 0;
}

static int opt_int(api_out *ao, json_t *b, const char *key, long long lo, long long hi, long long *out) {
    json_t *v = json_object_get(b, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v)) return api_bad(ao, "'%s' must be an integer", key);
    long long x = json_integer_value(v);
    if (x < lo || x > hi) return api_bad(ao, "'%s' must be between %lld and %lld (got %lld)", key, lo, hi, x);
    *out = x;
    return 0;
}

static int opt_bool(api_out *ao, json_t *b, const char *key, int *out) {
    json_t *v = json_object_get(b, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return api_bad(ao, "'%s' must be true or false", key);
    *out = json_is_true(v);
    return 0;
}

static int parse_stop(api_out *ao, json_t *b, qf_req_params *p) {
    json_t *v = json_object_get(b, "stop");
    if (!v || json_is_null(v)) return 0;
    if (json_is_string(v)) v = json_pack("[O]", v);
    else if (json_is_array(v)) json_incref(v);
    else return api_bad(ao, "'stop' must be a string or a list of strings");
    int rc = 0;
    if (json_array_size(v) > QF_MAX_STOP) rc = api_bad(ao, "'stop' has %zu strings; at most %d", json_array_size(v), QF_MAX_STOP);
    for (size_t i = 0; rc == 0 && i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        size_t n = json_is_string(e) ? json_string_length(e) : 0;
        if (!json_is_string(e)) rc = api_bad(ao, "'stop[%zu]' must be a string", i);
        else if (n == 0 || n > QF_MAX_STOP_LEN || memchr(json_string_value(e), 0, n))
            rc = api_bad(ao, "'stop[%zu]' must be 1 to %d bytes", i, QF_MAX_STOP_LEN);
        else p->stop[p->n_stop++] = json_string_value(e); /* lives as long as the body */
    }
    json_decref(v); /* the strings stay owned by the body */
    return rc;
}

/* stop_token_ids: more ids that end the reply (vLLM's extension). */
static int parse_stop_ids(srv *s, api_out *ao, json_t *b, gen_req *g) {
    json_t *v = json_object_get(b, "stop_token_ids");
    if (!v || json_is_null(v)) return 0;
    int V = qf_engine_config(s->e)->vocab;
    if (!json_is_array(v) || json_array_size(v) > 256) return api_bad(ao, "'stop_token_ids' must be a list of at most 256 token ids");
    g->stop_ids = malloc((json_array_size(v) + 1) * sizeof *g->stop_ids);
    if (!g->stop_ids) return api_bad(ao, "out of memory");
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *t = json_array_get(v, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= V)
            return api_bad(ao, "'stop_token_ids[%zu]' must be a token id between 0 and %d", i, V - 1);
        g->stop_ids[i] = (int32_t)json_integer_value(t);
    }
    g->p.stop_ids = g->stop_ids, g->p.n_stop_ids = (int)json_array_size(v);
    return 0;
}

/* logit_bias: {"token id": bias}; biases beyond +-100 are clamped to it, as vLLM does. */
static int parse_logit_bias(srv *s, api_out *ao, json_t *b, gen_req *g) {
    json_t *v = json_object_get(b, "logit_bias");
    if (!v || json_is_null(v)) return 0;
    int V = qf_engine_config(s->e)->vocab;
    if (!json_is_object(v)) return api_bad(ao, "'logit_bias' must be an object mapping token ids to biases");
    size_t n = json_object_size(v), i = 0;
    g->bias_ids = malloc((n + 1) * sizeof *g->bias_ids), g->bias = malloc((n + 1) * sizeof *g->bias);
    if (!g->bias_ids || !g->bias) return api_bad(ao, "out of memory");
    const char *key;
    json_t *x;
    json_object_foreach(v, key, x) {
        char *end = NULL;
        long id = strtol(key, &end, 10);
        if (!*key || *end || id < 0 || id >= V) return api_bad(ao, "'logit_bias' key '%.40s' must be a token id between 0 and %d", key, V - 1);
        if (!json_is_number(x)) return api_bad(ao, "'logit_bias[\"%s\"]' must be a number", key);
        double bias = json_number_value(x);
        g->bias_ids[i] = (int32_t)id, g->bias[i++] = (float)(bias > 100 ? 100 : bias < -100 ? -100 : bias);
    }
    g->p.bias_ids = g->bias_ids, g->p.bias = g->bias, g->p.n_bias = (int)n;
    return 0;
}

/* Fields of OpenAI's or vLLM's schema this server cannot honour: a 400 naming the field, never a
 * silent reply that ignores it. Fields that only describe the request (user, metadata, store,
 * service_tier, prompt_cache_key, safety_identifier) are accepted; unknown fields are ignored. */
static int refuse_unserved(api_out *ao, json_t *b) {
    static const char *const refused[][2] = {
        {"functions", "use 'tools'"}, {"function_call", "use 'tool_choice'"}, {"audio", "this model has no audio output"},
        {"prediction", "predicted outputs are not served"}, {"web_search_options", "no web search is served"},
        {"guided_json", "use 'response_format' json_schema"}, {"guided_regex", "use 'response_format' json_schema with a pattern"},
        {"guided_choice", "use 'response_format' json_schema with an enum"}, {"guided_grammar", "grammars are given as 'response_format' json_schema"},
        {"structured_outputs", "use 'response_format' json_schema"}, {"prompt_logprobs", "prompt logprobs are not computed"},
        {"use_beam_search", "beam search is not served"}, {"length_penalty", "beam search is not served"},
        {"truncate_prompt_tokens", "prompts are not truncated: send one that fits the context"}};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        json_t *v = json_object_get(b, refused[i][0]);
        if (v && !json_is_null(v) && !json_is_false(v)) return api_bad(ao, "'%s' is not supported: %s", refused[i][0], refused[i][1]);
    }
    json_t *mod = json_object_get(b, "modalities");
    for (size_t i = 0; json_is_array(mod) && i < json_array_size(mod); i++) {
        const char *m = json_string_value(json_array_get(mod, i));
        if (!m || strcmp(m, "text")) return api_bad(ao, "'modalities[%zu]' must be \"text\" (the only output this model has)", i);
    }
    if (mod && !json_is_null(mod) && !json_is_array(mod)) return api_bad(ao, "'modalities' must be a list");
    return 0;
}

/* Sampling and limits shared by every generating endpoint; defaults from generation_config.json. */
static int parse_common(srv *s, api_out *ao, json_t *b, gen_req *g) {
    const qf_config *c = qf_engine_config(s->e);
    json_t *model = json_object_get(b, "model"); /* absent: the one model */
    if (model && !json_is_null(model) && !json_is_string(model)) return api_bad(ao, "'model' must be a string");
    if (json_is_string(model) && !srv_model_known(s, json_string_value(model))) {
        api_bad(ao, "The model '%.200s' does not exist (this server serves '%s'; --served-model-name adds names)", json_string_value(model), s->model_name);
        ao->code = 404, ao->err_code = "model_not_found";
        return -1;
    }
    qf_sampling *sp = &g->p.sampling;
    *sp = qf_sampling_default();
    sp->temperature = c->gen_temperature;
    sp->top_p = c->gen_top_p > 0 && c->gen_top_p <= 1 ? c->gen_top_p : 1.0f;
    sp->top_k = c->gen_top_k;
    static atomic_ullong counter; /* the preparation workers parse at once */
    sp->seed = (unsigned long long)time(NULL) * 1000003ull + atomic_fetch_add(&counter, 1) + 1;
    long long max_tokens = -1, top_k = sp->top_k, seed = 0, n = 1, min_tokens = 0;
    g->think_budget = -1;
    int has_seed = json_object_get(b, "seed") && !json_is_null(json_object_get(b, "seed"));
    if (opt_num(ao, b, "temperature", 0, 2, &sp->temperature) || opt_num(ao, b, "top_p", 1e-9, 1, &sp->top_p) ||
        opt_num(ao, b, "min_p", 0, 1, &sp->min_p) || opt_num(ao, b, "presence_penalty", -2, 2, &sp->presence_penalty) ||
        opt_num(ao, b, "frequency_penalty", -2, 2, &sp->frequency_penalty) ||
        opt_num(ao, b, "repetition_penalty", 0.01, 10, &sp->repetition_penalty) ||
        opt_int(ao, b, "top_k", -1, 1 << 30, &top_k) || opt_int(ao, b, "seed", INT64_MIN, INT64_MAX, &seed) ||
        opt_int(ao, b, "max_tokens", 1, 1 << 30, &max_tokens) || opt_int(ao, b, "max_completion_tokens", 1, 1 << 30, &max_tokens) ||
        opt_int(ao, b, "n", 1, QF_MAX_CHOICES, &n) || opt_bool(ao, b, "stream", &g->stream) || opt_bool(ao, b, "ignore_eos", &g->p.ignore_eos) ||
        opt_int(ao, b, "min_tokens", 0, 1 << 30, &min_tokens) || opt_int(ao, b, "thinking_budget", 0, 1 << 30, &g->think_budget) ||
        opt_int(ao, b, "max_thinking_tokens", 0, 1 << 30, &g->think_budget) || parse_stop(ao, b, &g->p) || parse_stop_ids(s, ao, b, g) ||
        parse_logit_bias(s, ao, b, g) || refuse_unserved(ao, b))
        return -1;
    if (max_tokens > 0 && min_tokens > max_tokens) return api_bad(ao, "'min_tokens' (%lld) must not exceed 'max_tokens' (%lld)", min_tokens, max_tokens);
    g->p.min_tokens = (int)min_tokens;
    json_t *sl = json_object_get(b, "sparsity_level"); /* qflash's extension: this request's level, every layer */
    if (sl && !json_is_null(sl)) {
        if (opt_num(ao, b, "sparsity_level", 0, 1, &g->p.sparsity)) return -1;
        if (g->p.sparsity > 0 && !qf_engine_sparsity_ready(s->e))
            return api_bad(ao, "'sparsity_level' above 0 on this GPU needs the server started with a level above 0 (--sparsity-level or config_flash.json)");
        g->p.sparsity_set = 1;
    }
    sp->top_k = top_k < 0 ? 0 : (int)top_k; /* -1 means off, as in vLLM */
    if (has_seed) sp->seed = (uint64_t)seed;
    g->p.max_tokens = (int)max_tokens;
    g->n = (int)n;
    json_t *so = json_object_get(b, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) return api_bad(ao, "'stream_options' must be an object");
        if (opt_bool(ao, so, "include_usage", &g->include_usage)) return -1;
    }
    return 0;
}

/* A message's content as the template reads it: a string (a list of text parts joined into one,
 * as templates that take lists join them, so templates that take only strings work too). */
static int check_content(api_out *ao, json_t *m, size_t i, const char *key) {
    json_t *c = json_object_get(m, key);
    if (!c || json_is_string(c)) return 0;
    if (!json_is_array(c)) return api_bad(ao, "'messages[%zu].%s' must be a string or a list of text parts", i, key);
    size_t total = 0;
    for (size_t k = 0; k < json_array_size(c); k++) {
        json_t *part = json_array_get(c, k), *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type) || strcmp(json_string_value(type), "text") != 0 || !json_is_string(text))
            return api_bad(ao, "'messages[%zu].%s[%zu]' must be {\"type\": \"text\", \"text\": \"...\"} (only text is supported)", i, key, k);
        total += json_string_length(text);
    }
    char *s = malloc(total + 1);
    if (!s) return api_bad(ao, "out of memory");
    size_t at = 0;
    for (size_t k = 0; k < json_array_size(c); k++) {
        json_t *text = json_object_get(json_array_get(c, k), "text");
        memcpy(s + at, json_string_value(text), json_string_length(text)), at += json_string_length(text);
    }
    json_object_set_new(m, key, json_stringn(s, at));
    free(s);
    return 0;
}

/* The tool calls of message i as the templates read them: each function's arguments an object
 * (OpenAI clients send a JSON string; one that does not parse stays a string). */
static int normalise_tool_calls(api_out *ao, json_t *m, size_t i) {
    json_t *tc = json_object_get(m, "tool_calls");
    if (!tc || json_is_null(tc)) return 0;
    if (!json_is_array(tc)) return api_bad(ao, "'messages[%zu].tool_calls' must be a list", i);
    for (size_t k = 0; k < json_array_size(tc); k++) {
        json_t *tcall = json_array_get(tc, k), *fn = json_object_get(tcall, "function"), *args = json_object_get(fn, "arguments");
        if (!json_is_object(tcall) || (fn && !json_is_object(fn))) return api_bad(ao, "'messages[%zu].tool_calls[%zu]' must be an object with a 'function' object", i, k);
        if (!json_is_string(args)) continue;
        json_t *parsed = json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, NULL);
        if (json_is_object(parsed)) json_object_set(fn, "arguments", parsed);
        json_decref(parsed);
    }
    return 0;
}

/* The request's messages as the template's `messages` (a copy): roles as given (the template
 * decides which it takes), content checked, keys whose value is null dropped and `reasoning`
 * given as `reasoning_content` (as transformers and vLLM pass them), tool calls normalised. */
static int template_messages(api_out *ao, json_t *b, json_t **out) {
    json_t *ms = json_object_get(b, "messages");
    if (!json_is_array(ms) || json_array_size(ms) == 0) return api_bad(ao, "'messages' must be a non-empty list");
    if (json_array_size(ms) > 100000) return api_bad(ao, "'messages' has too many entries");
    json_t *copy = json_deep_copy(ms);
    *out = copy;
    if (!copy) return api_bad(ao, "out of memory");
    for (size_t i = 0; i < json_array_size(copy); i++) {
        json_t *m = json_array_get(copy, i), *role = json_object_get(m, "role");
        if (!json_is_object(m)) return api_bad(ao, "'messages[%zu]' must be an object", i);
        if (!json_is_string(role) || json_string_length(role) == 0) return api_bad(ao, "'messages[%zu].role' must be a non-empty string", i);
        const char *key;
        json_t *v;
        void *tmp;
        json_object_foreach_safe(m, tmp, key, v) if (json_is_null(v)) json_object_del(m, key);
        json_t *r = json_object_get(m, "reasoning");
        if (r && !json_object_get(m, "reasoning_content")) json_object_set(m, "reasoning_content", r);
        json_t *rc = json_object_get(m, "reasoning_content"); /* also as thinking, as transformers 5 passes it (gpt-oss reads that) */
        if (json_is_string(rc) && !json_object_get(m, "thinking")) json_object_set(m, "thinking", rc);
        if (check_content(ao, m, i, "content") || check_content(ao, m, i, "reasoning_content") ||
            normalise_tool_calls(ao, m, i))
            return -1;
        if (!json_object_get(m, "content") && !json_object_get(m, "tool_calls")) return api_bad(ao, "'messages[%zu].content' is missing", i);
    }
    return 0;
}

/* The template's variables: messages, tools, add_generation_prompt, and the caller's template
 * kwargs as given over the server's defaults (a variable neither sent stays undefined, as
 * transformers and vLLM leave it). reasoning_effort is passed on, and turns enable_thinking off at none or minimal
 * unless the kwargs set it. *cont: the final message is left open (continue_final_message). */
static int template_vars(const srv *s, api_out *ao, json_t *b, json_t **vars, int *cont) {
    json_t *msgs = NULL, *tools = json_object_get(b, "tools"), *kw = json_object_get(b, "chat_template_kwargs");
    *vars = NULL;
    if (tools && !json_is_null(tools) && !json_is_array(tools)) return api_bad(ao, "'tools' must be a list");
    for (size_t i = 0; json_is_array(tools) && i < json_array_size(tools); i++)
        if (!json_is_object(json_array_get(tools, i))) return api_bad(ao, "'tools[%zu]' must be an object", i);
    if (kw && !json_is_null(kw) && !json_is_object(kw)) return api_bad(ao, "'chat_template_kwargs' must be an object");
    int gen_prompt = 1, thinking = 1;
    *cont = 0;
    if (json_is_object(kw) && opt_bool(ao, kw, "enable_thinking", &thinking)) return -1;
    if (opt_bool(ao, b, "add_generation_prompt", &gen_prompt) || opt_bool(ao, b, "continue_final_message", cont)) return -1;
    if (*cont && gen_prompt && json_is_true(json_object_get(b, "add_generation_prompt")))
        return api_bad(ao, "'continue_final_message' and 'add_generation_prompt' cannot both be true");
    json_t *effort = json_object_get(b, "reasoning_effort");
    if (effort && !json_is_null(effort) && !json_is_string(effort)) return api_bad(ao, "'reasoning_effort' must be a string");
    if (template_messages(ao, b, &msgs)) return json_decref(msgs), -1;
    json_t *v = s->template_kwargs ? json_deep_copy(s->template_kwargs) : json_object();
    if (json_is_object(kw)) json_object_update(v, kw);
    json_object_set_new(v, "messages", msgs);
    json_object_set(v, "tools", json_is_array(tools) && json_array_size(tools) ? tools : json_null());
    json_object_set_new(v, "add_generation_prompt", json_boolean(gen_prompt && !*cont));
    if (json_is_string(effort)) {
        const char *e = json_string_value(effort);
        json_object_set(v, "reasoning_effort", effort);
        if (!json_object_get(v, "enable_thinking") && (!strcmp(e, "none") || !strcmp(e, "minimal"))) json_object_set_new(v, "enable_thinking", json_false());
    }
    *vars = v;
    return 0;
}

/* continue_final_message: the render cut where the last message's content ends (as vLLM does),
 * so the reply continues it. */
static int cut_at_final(api_out *ao, json_t *vars, char *text) {
    json_t *ms = json_object_get(vars, "messages"), *c = json_object_get(json_array_get(ms, json_array_size(ms) - 1), "content");
    const char *cs = json_string_value(c);
    size_t n = cs ? strlen(cs) : 0;
    while (n && strchr(" \t\n\r", cs[n - 1])) n--; /* templates often trim the content */
    while (n && strchr(" \t\n\r", *cs)) cs++, n--;
    char *at = NULL;
    size_t tl = strlen(text);
    for (char *p = n ? memmem(text, tl, cs, n) : NULL; p; p = memmem(p + 1, tl - (size_t)(p + 1 - text), cs, n)) at = p; /* the last */
    if (!at) return api_bad(ao, "'continue_final_message': the last message's content must be text the template shows");
    at[n] = 0;
    return 0;
}

/* A reasoning prompt ends its block after the request's thinking_budget tokens; with none given,
 * a reply whose grammar waits for the block's end gets half of max_tokens for reasoning. */
static int think_budget(api_out *ao, gen_req *g, int32_t end) {
    long long budget = g->think_budget;
    if (budget < 0 && g->p.grammar && g->p.max_tokens > 0) budget = g->p.max_tokens / 2;
    if (!g->think_prompt || budget < 0) return 0;
    if (end < 0) return api_bad(ao, "'thinking_budget' needs a </think> token, which this tokenizer lacks");
    g->p.think_budget_on = 1, g->p.think_budget = (int)budget, g->p.think_end = end;
    return 0;
}

/* limit: a prompt for generation, refused unread when its bytes cannot fit the context (no token is
 * longer than s->max_piece bytes), so its tokenizing is bounded. */
static int encode(srv *s, api_out *ao, const char *text, gen_req *g, int limit) {
    int n = 0;
    size_t len = strlen(text), most = (size_t)s->o->sched.ctx * (s->max_piece > 0 ? s->max_piece : 1);
    if (limit && len > most)
        return api_bad(ao, "the prompt has %zu bytes, more than the context of %d tokens can hold (at most %zu bytes)", len, s->o->sched.ctx, most);
    if (qf_tok_encode(s->e->tok, text, strlen(text), &g->prompt, &n) != QF_OK) return api_bad(ao, "cannot tokenize the prompt: %s", qf_last_error());
    g->p.prompt = g->prompt;
    g->p.n_prompt = n;
    return 0;
}

static int parse_logprobs_chat(api_out *ao, json_t *b, gen_req *g) {
    long long top = 0;
    if (opt_bool(ao, b, "logprobs", &g->logprobs_on) || opt_int(ao, b, "top_logprobs", 0, QF_MAX_TOP_LOGPROBS, &top)) return -1;
    json_t *t = json_object_get(b, "top_logprobs");
    if (t && !json_is_null(t) && !g->logprobs_on) return api_bad(ao, "'top_logprobs' needs 'logprobs': true");
    g->top_logprobs = (int)top;
    g->p.logprobs = g->logprobs_on ? (int)top : -1;
    return 0;
}

/* response_format: the grammar of a JSON reply (none for text). */
static int parse_response_format(api_out *ao, json_t *b, gen_req *g) {
    json_t *rf = json_object_get(b, "response_format");
    if (!rf || json_is_null(rf)) return 0;
    const char *t = json_string_value(json_object_get(rf, "type"));
    if (!json_is_object(rf) || !t) return api_bad(ao, "'response_format' must be an object with a 'type'");
    if (!strcmp(t, "text")) return 0;
    json_t *schema = NULL;
    if (!strcmp(t, "json_schema")) {
        json_t *js = json_object_get(rf, "json_schema");
        schema = json_object_get(js, "schema");
        if (!json_is_object(js)) return api_bad(ao, "'response_format.json_schema' must be an object");
        if (!json_is_object(schema) && !json_is_boolean(schema)) return api_bad(ao, "'response_format.json_schema.schema' must be a JSON schema (an object)");
    } else if (strcmp(t, "json_object")) return api_bad(ao, "'response_format.type' must be text, json_object or json_schema");
    if (qf_grammar_json(&g->p.grammar, schema) != QF_OK || qf_grammar_check(g->p.grammar) != QF_OK)
        return api_bad(ao, "'response_format.json_schema.schema': %s", qf_last_error());
    return 0;
}

/* tool_choice "required" or a named function: the reply is tool calls only, by grammar. */
static int parse_tool_choice(srv *s, api_out *ao, json_t *b, json_t *tools, gen_req *g) {
    json_t *choice = json_object_get(b, "tool_choice");
    int parallel = 1;
    if (opt_bool(ao, b, "parallel_tool_calls", &parallel)) return -1;
    if (!choice || json_is_null(choice)) return 0;
    const char *name = NULL, *cs = json_string_value(choice);
    if (cs && (!strcmp(cs, "none") || !strcmp(cs, "auto"))) return 0;
    if (cs && strcmp(cs, "required")) return api_bad(ao, "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    if (!cs) {
        name = json_string_value(json_object_get(json_object_get(choice, "function"), "name"));
        if (!name) return api_bad(ao, "'tool_choice.function.name' must be a string");
    }
    if (!json_is_array(tools) || !json_array_size(tools)) return api_bad(ao, "'tool_choice' %s needs 'tools'", cs ? cs : "naming a function");
    qf_grammar_free(g->p.grammar); /* a forced call wins over response_format */
    g->p.grammar = NULL;
    if (qf_grammar_tools(&g->p.grammar, tools, name, s->tool_form, parallel) != QF_OK || qf_grammar_check(g->p.grammar) != QF_OK)
        return api_bad(ao, "'tool_choice': %s", qf_last_error());
    return 0;
}

int api_parse_chat(srv *s, api_out *ao, json_t *b, gen_req *g) {
    g->p.logprobs = -1;
    g->p.grammar_after = -1;
    if (parse_common(s, ao, b, g) || parse_logprobs_chat(ao, b, g) || parse_response_format(ao, b, g)) return -1;
    if (!s->has_tmpl) return api_bad(ao, "this model has no chat template; use /v1/completions");
    json_t *vars = NULL;
    char *text = NULL;
    int cont = 0, rc = template_vars(s, ao, b, &vars, &cont);
    if (rc == 0 && qf_chat_render_vars(&s->tmpl, vars, &text) != QF_OK) rc = api_bad(ao, "cannot render the chat: %s", qf_last_error());
    if (rc == 0 && cont) rc = cut_at_final(ao, vars, text);
    if (rc == 0) {
        size_t tl = strlen(text);
        g->think_prompt = tl >= 8 && memcmp(text + tl - 8, "<think>\n", 8) == 0;
        rc = encode(s, ao, text, g, !g->tokenize_only);
        if (rc == 0) g->p.snap_at = qf_tok_turn_start(s->e->tok, g->p.prompt, g->p.n_prompt);
    }
    json_t *tools = json_object_get(vars, "tools"), *choice = json_object_get(b, "tool_choice");
    if (rc == 0 && json_is_array(tools) && !(json_is_string(choice) && !strcmp(json_string_value(choice), "none"))) g->tools = json_incref(tools);
    if (rc == 0) rc = parse_tool_choice(s, ao, b, tools, g);
    int32_t think_end = g->think_prompt ? qf_tok_lookup(s->e->tok, "</think>") : -1;
    if (rc == 0 && g->p.grammar && g->think_prompt) g->p.grammar_after = think_end;
    if (rc == 0) rc = think_budget(ao, g, think_end);
    json_decref(vars);
    free(text);
    return rc;
}

/* prompt: a string, a list of token ids, or a one-element list of either. */
static int parse_prompt(srv *s, api_out *ao, json_t *b, gen_req *g) {
    json_t *p = json_object_get(b, "prompt");
    if (json_is_array(p) && json_array_size(p) == 1 && (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        p = json_array_get(p, 0);
    if (json_is_string(p)) {
        if (json_string_length(p) == 0) return api_bad(ao, "'prompt' is empty");
        if (memchr(json_string_value(p), 0, json_string_length(p))) return api_bad(ao, "'prompt' contains a NUL character");
        return encode(s, ao, json_string_value(p), g, 1);
    }
    if (json_is_array(p) && (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        return api_bad(ao, "'prompt' holds %zu prompts: one prompt per request (send each as its own request, or use 'n' for several choices)", json_array_size(p));
    if (!json_is_array(p) || json_array_size(p) == 0) return api_bad(ao, "'prompt' must be a non-empty string or list of token ids (one prompt per request)");
    size_t n = json_array_size(p);
    if (n > (size_t)s->o->sched.ctx) return api_bad(ao, "the prompt has %zu tokens; the context is %d tokens", n, s->o->sched.ctx);
    g->prompt = malloc(n * sizeof *g->prompt);
    if (!g->prompt) return api_bad(ao, "out of memory");
    int V = qf_engine_config(s->e)->vocab;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(p, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= V)
            return api_bad(ao, "'prompt[%zu]' must be a token id between 0 and %d", i, V - 1);
        g->prompt[i] = (int32_t)json_integer_value(t);
    }
    g->p.prompt = g->prompt;
    g->p.n_prompt = (int)n;
    return 0;
}

int api_parse_completion(srv *s, api_out *ao, json_t *b, gen_req *g, int native) {
    g->p.logprobs = -1;
    g->p.grammar_after = -1;
    if (parse_common(s, ao, b, g) || parse_response_format(ao, b, g)) return -1;
    long long lp = -1;
    int echo = 0;
    if (opt_int(ao, b, "logprobs", 0, QF_MAX_TOP_LOGPROBS, &lp) || opt_bool(ao, b, "echo", &echo)) return -1;
    if (echo) return api_bad(ao, "'echo' is not supported");
    json_t *suffix = json_object_get(b, "suffix"), *best_of = json_object_get(b, "best_of");
    if (suffix && !json_is_null(suffix)) return api_bad(ao, "'suffix' is not supported");
    if (best_of && !json_is_null(best_of) && !(json_is_integer(best_of) && json_integer_value(best_of) == 1))
        return api_bad(ao, "'best_of' must be 1");
    g->logprobs_on = lp >= 0;
    g->top_logprobs = (int)(lp < 0 ? 0 : lp);
    g->p.logprobs = (int)lp;
    if (native) g->stream = 1;
    if (native && g->n > 1) return api_bad(ao, "'n' above 1 is for /v1/completions and /v1/chat/completions");
    return parse_prompt(s, ao, b, g);
}

void gen_req_clear(gen_req *g) {
    json_decref(g->xbody);
    json_decref(g->orig);
    g->xbody = g->orig = NULL;
    qf_grammar_free(g->p.grammar);
    g->p.grammar = NULL;
    free(g->prompt);
    g->prompt = NULL;
    json_decref(g->tools);
    g->tools = NULL;
    free(g->stop_ids), free(g->bias_ids), free(g->bias);
    g->stop_ids = g->bias_ids = NULL, g->bias = NULL;
}

/* ---- /tokenize, /detokenize (vLLM's and llama-server's field names both work) ---- */

void api_tokenize(srv *s, api_out *ao, json_t *b) {
    gen_req g;
    memset(&g, 0, sizeof g);
    g.tokenize_only = 1;
    json_t *text = json_object_get(b, "prompt");
    if (!text) text = json_object_get(b, "content");
    int rc;
    if (json_object_get(b, "messages")) {
        rc = api_parse_chat(s, ao, b, &g);
    } else if (!json_is_string(text)) {
        rc = api_bad(ao, "'prompt' (or 'content') must be a string, or give 'messages'");
    } else {
        rc = encode(s, ao, json_string_value(text), &g, 0);
    }
    if (rc == 0) {
        json_t *ids = json_array();
        for (int i = 0; i < g.p.n_prompt; i++) json_array_append_new(ids, json_integer(g.prompt[i]));
        ao->code = 200;
        ao->body = json_pack("{s:o,s:i,s:i}", "tokens", ids, "count", g.p.n_prompt, "max_model_len", s->o->sched.ctx);
    }
    gen_req_clear(&g);
}

void api_detokenize(srv *s, api_out *ao, json_t *b) {
    json_t *t = json_object_get(b, "tokens");
    int V = qf_tok_vocab_size(s->e->tok); /* the model's rows past the tokenizer's ids have no text */
    if (!json_is_array(t) || json_array_size(t) > (size_t)1 << 24) {
        api_bad(ao, "'tokens' must be a list of token ids");
        return;
    }
    size_t n = json_array_size(t);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    for (size_t i = 0; ids && i < n; i++) {
        json_t *v = json_array_get(t, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= V) {
            free(ids);
            api_bad(ao, "'tokens[%zu]' must be a token id between 0 and %d", i, V - 1);
            return;
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    char *text = NULL;
    size_t len = 0;
    int rc = ids ? qf_tok_decode(s->e->tok, ids, (int)n, 0, &text, &len) : QF_ENOMEM;
    if (rc != QF_OK) {
        free(ids);
        if (rc == QF_EINVAL) api_bad(ao, "'tokens': %s", qf_last_error());
        else ao->code = 500, snprintf(ao->msg, sizeof ao->msg, "cannot decode: out of memory");
        return;
    }
    ao->code = 200; /* text may hold NUL bytes (the byte token 0): sized strings */
    ao->body = json_pack("{s:s%,s:s%}", "prompt", text, len, "content", text, len);
    free(ids);
    free(text);
}
