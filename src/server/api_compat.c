/* /v1/responses (OpenAI Responses) and /v1/messages (Anthropic Messages) requests, translated into
 * the chat-completions body that api_parse_chat takes, so both share every check, the template,
 * tools and constrained output. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_int.h"

/* Copies the fields whose names are the same in both bodies. */
static void copy_fields(json_t *from, json_t *to, const char *const *keys) {
    for (; *keys; keys++) {
        json_t *v = json_object_get(from, *keys);
        if (v) json_object_set(to, *keys, v);
    }
}

/* The chat body's thinking switch, unless the caller's chat_template_kwargs set one. */
static void set_thinking(json_t *chat, int on) {
    if (!json_object_get(chat, "chat_template_kwargs")) json_object_set_new(chat, "chat_template_kwargs", json_pack("{s:b}", "enable_thinking", on));
}

/* tool_choice naming one function, as the chat body takes it. */
static void choose_tool(json_t *chat, const char *name) {
    json_object_set_new(chat, "tool_choice", json_pack("{s:s,s:{s:s}}", "type", "function", "function", "name", name));
}

/* Text parts ([{type: input_text|output_text|text, text}]) or a string, as one string. */
static json_t *joined_text(api_out *ao, json_t *content, const char *where) {
    if (json_is_string(content)) return json_incref(content);
    if (!json_is_array(content)) return api_bad(ao, "'%s' must be a string or a list of text parts", where), NULL;
    size_t i;
    json_t *p, *out = json_string("");
    json_array_foreach(content, i, p) {
        const char *t = json_string_value(json_object_get(p, "type")), *text = json_string_value(json_object_get(p, "text"));
        if (!t || !text || (strcmp(t, "input_text") && strcmp(t, "output_text") && strcmp(t, "text"))) {
            json_decref(out);
            return api_bad(ao, "'%s[%zu]' must be a text part (only text is supported)", where, i), NULL;
        }
        char *joined = NULL;
        if (asprintf(&joined, "%s%s", json_string_value(out), text) < 0) return json_decref(out), NULL;
        json_string_set(out, joined);
        free(joined);
    }
    return out;
}

/* body translated by translate into a chat body (kept in g), then parsed as a chat request. */
static int parse_translated(srv *s, api_out *ao, json_t *body, gen_req *g, int api, int (*translate)(api_out *, json_t *, json_t *)) {
    json_t *chat = json_object();
    g->xbody = chat;
    g->orig = json_incref(body);
    g->api = api;
    if (translate(ao, body, chat)) return -1;
    return api_parse_chat(s, ao, chat, g);
}

/* ---- Responses ---- */

/* The function calls of consecutive input items go into one assistant message. */
static json_t *last_assistant(json_t *msgs) {
    json_t *m = json_array_get(msgs, json_array_size(msgs) - 1);
    const char *role = json_string_value(json_object_get(m, "role"));
    if (role && !strcmp(role, "assistant")) return m;
    m = json_pack("{s:s,s:s}", "role", "assistant", "content", "");
    json_array_append_new(msgs, m);
    return m;
}

static int responses_item(api_out *ao, json_t *it, size_t i, json_t *msgs) {
    char where[64];
    snprintf(where, sizeof where, "input[%zu]", i);
    const char *type = json_string_value(json_object_get(it, "type"));
    if (!json_is_object(it)) return api_bad(ao, "'%s' must be an object", where);
    if (!type || !strcmp(type, "message")) {
        const char *role = json_string_value(json_object_get(it, "role"));
        if (!role) return api_bad(ao, "'%s.role' must be a string", where);
        json_t *text = joined_text(ao, json_object_get(it, "content"), where);
        if (!text) return -1;
        json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", role, "content", text));
    } else if (!strcmp(type, "function_call")) {
        json_t *m = last_assistant(msgs), *calls = json_object_get(m, "tool_calls");
        const char *id = json_string_value(json_object_get(it, "call_id")), *name = json_string_value(json_object_get(it, "name"));
        const char *args = json_string_value(json_object_get(it, "arguments"));
        if (!id || !name || !args) return api_bad(ao, "'%s' (a function_call) needs call_id, name and arguments", where);
        if (!calls) json_object_set_new(m, "tool_calls", calls = json_array());
        json_array_append_new(calls, json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", id, "type", "function", "function", "name", name, "arguments", args));
    } else if (!strcmp(type, "function_call_output")) {
        const char *id = json_string_value(json_object_get(it, "call_id"));
        json_t *out = json_object_get(it, "output");
        json_t *text = json_is_string(out) ? json_incref(out) : joined_text(ao, out, where);
        if (!id || !text) return json_decref(text), api_bad(ao, "'%s' (a function_call_output) needs call_id and output", where);
        json_array_append_new(msgs, json_pack("{s:s,s:s,s:o}", "role", "tool", "tool_call_id", id, "content", text));
    } else if (strcmp(type, "reasoning")) {
        return api_bad(ao, "'%s.type' %s is not supported (message, function_call, function_call_output, reasoning)", where, type);
    }
    return 0;
}

static int responses_tools(api_out *ao, json_t *b, json_t *chat) {
    json_t *tools = json_object_get(b, "tools"), *out = json_array(), *choice = json_object_get(b, "tool_choice");
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *type = json_string_value(json_object_get(t, "type"));
        if (!type || strcmp(type, "function")) return json_decref(out), api_bad(ao, "'tools[%zu].type' must be function (built-in tools are not served)", i);
        json_t *fn = json_object();
        copy_fields(t, fn, (const char *const[]){"name", "description", "parameters", "strict", NULL});
        json_array_append_new(out, json_pack("{s:s,s:o}", "type", "function", "function", fn));
    }
    json_object_set_new(chat, "tools", out);
    if (json_is_object(choice)) { /* {type: function, name} */
        const char *name = json_string_value(json_object_get(choice, "name"));
        if (!name) return api_bad(ao, "'tool_choice.name' must be a string");
        choose_tool(chat, name);
    } else if (choice) json_object_set(chat, "tool_choice", choice);
    return 0;
}

/* text.format: text, json_object, or json_schema {name, schema, strict} */
static int responses_format(api_out *ao, json_t *b, json_t *chat) {
    json_t *fmt = json_object_get(json_object_get(b, "text"), "format");
    if (!fmt || json_is_null(fmt)) return 0;
    const char *type = json_string_value(json_object_get(fmt, "type"));
    if (!type) return api_bad(ao, "'text.format.type' must be a string");
    if (!strcmp(type, "json_schema")) {
        json_t *js = json_object();
        copy_fields(fmt, js, (const char *const[]){"name", "schema", "strict", NULL});
        json_object_set_new(chat, "response_format", json_pack("{s:s,s:o}", "type", "json_schema", "json_schema", js));
    } else json_object_set_new(chat, "response_format", json_pack("{s:s}", "type", type));
    return 0;
}

static int responses_body(api_out *ao, json_t *b, json_t *chat) {
    static const char *const refused[] = {"previous_response_id", "conversation", "background", "prompt", NULL};
    for (const char *const *k = refused; *k; k++)
        if (json_object_get(b, *k) && !json_is_null(json_object_get(b, *k)))
            return api_bad(ao, "'%s' is not supported: nothing is stored between requests (send the whole input)", *k);
    json_t *msgs = json_array(), *in = json_object_get(b, "input"), *ins = json_object_get(b, "instructions");
    json_object_set_new(chat, "messages", msgs);
    if (json_is_string(ins)) json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "system", "content", ins));
    if (json_is_string(in)) json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "user", "content", in));
    else if (json_is_array(in)) {
        size_t i;
        json_t *it;
        json_array_foreach(in, i, it) if (responses_item(ao, it, i, msgs)) return -1;
    } else return api_bad(ao, "'input' must be a string or a list of items");
    copy_fields(b, chat, (const char *const[]){"model", "temperature", "top_p", "stream", "parallel_tool_calls", "top_logprobs", "seed",
                                               "top_k", "min_p", "chat_template_kwargs", NULL});
    json_t *mx = json_object_get(b, "max_output_tokens"), *rs = json_object_get(b, "reasoning");
    if (mx) json_object_set(chat, "max_tokens", mx);
    json_t *effort = json_object_get(rs, "effort");
    if (json_is_string(effort)) json_object_set(chat, "reasoning_effort", effort);
    return responses_tools(ao, b, chat) || responses_format(ao, b, chat);
}

int api_parse_responses(srv *s, api_out *ao, json_t *body, gen_req *g) { return parse_translated(s, ao, body, g, API_RESPONSES, responses_body); }

/* ---- Messages ---- */

/* A user message's blocks: tool_result blocks become tool messages, the text one user message. */
static int messages_user(api_out *ao, json_t *content, size_t i, json_t *msgs) {
    char where[64];
    snprintf(where, sizeof where, "messages[%zu].content", i);
    if (json_is_string(content)) return json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "user", "content", content)), 0;
    if (!json_is_array(content)) return api_bad(ao, "'%s' must be a string or a list of blocks", where);
    json_t *text = json_array();
    size_t k;
    json_t *blk;
    json_array_foreach(content, k, blk) {
        const char *type = json_string_value(json_object_get(blk, "type"));
        if (type && !strcmp(type, "text")) json_array_append(text, blk);
        else if (type && !strcmp(type, "tool_result")) {
            const char *id = json_string_value(json_object_get(blk, "tool_use_id"));
            json_t *c = json_object_get(blk, "content"), *ct = !c ? json_string("") : joined_text(ao, c, where);
            if (!id || !ct) return json_decref(text), json_decref(ct), api_bad(ao, "'%s[%zu]' (tool_result) needs tool_use_id and text content", where, k);
            json_array_append_new(msgs, json_pack("{s:s,s:s,s:o}", "role", "tool", "tool_call_id", id, "content", ct));
        } else return json_decref(text), api_bad(ao, "'%s[%zu].type' %s is not supported (text, tool_result)", where, k, type ? type : "(none)");
    }
    if (json_array_size(text)) {
        json_t *t = joined_text(ao, text, where);
        if (!t) return json_decref(text), -1;
        json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", "user", "content", t));
    }
    json_decref(text);
    return 0;
}

/* An assistant message's blocks: text, thinking (reasoning_content) and tool_use (tool_calls). */
static int messages_assistant(api_out *ao, json_t *content, size_t i, json_t *msgs) {
    char where[64];
    snprintf(where, sizeof where, "messages[%zu].content", i);
    if (json_is_string(content)) return json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "assistant", "content", content)), 0;
    if (!json_is_array(content)) return api_bad(ao, "'%s' must be a string or a list of blocks", where);
    json_t *m = json_pack("{s:s,s:s}", "role", "assistant", "content", ""), *calls = json_array();
    json_array_append_new(msgs, m);
    size_t k;
    json_t *blk;
    json_array_foreach(content, k, blk) {
        const char *type = json_string_value(json_object_get(blk, "type"));
        const char *key = type && !strcmp(type, "text") ? "content" : type && !strcmp(type, "thinking") ? "reasoning_content" : NULL;
        if (key) {
            const char *t = json_string_value(json_object_get(blk, !strcmp(key, "content") ? "text" : "thinking"));
            const char *had = json_string_value(json_object_get(m, key));
            char *joined = NULL;
            if (!t || asprintf(&joined, "%s%s", had ? had : "", t) < 0) return json_decref(calls), api_bad(ao, "'%s[%zu]' has no text", where, k);
            json_object_set_new(m, key, json_string(joined));
            free(joined);
        } else if (type && !strcmp(type, "tool_use")) {
            const char *id = json_string_value(json_object_get(blk, "id")), *name = json_string_value(json_object_get(blk, "name"));
            char *args = json_dumps(json_object_get(blk, "input"), JSON_COMPACT | JSON_ENCODE_ANY);
            if (!id || !name || !args) return free(args), json_decref(calls), api_bad(ao, "'%s[%zu]' (tool_use) needs id, name and input", where, k);
            json_array_append_new(calls, json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", id, "type", "function", "function", "name", name, "arguments", args));
            free(args);
        } else if (!type || strcmp(type, "redacted_thinking")) {
            return json_decref(calls), api_bad(ao, "'%s[%zu].type' %s is not supported (text, thinking, tool_use)", where, k, type ? type : "(none)");
        }
    }
    if (json_array_size(calls)) json_object_set(m, "tool_calls", calls);
    json_decref(calls);
    return 0;
}

static int messages_tools(api_out *ao, json_t *b, json_t *chat) {
    json_t *tools = json_object_get(b, "tools"), *out = json_array(), *tc = json_object_get(b, "tool_choice");
    json_object_set_new(chat, "tools", out);
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *name = json_string_value(json_object_get(t, "name"));
        json_t *schema = json_object_get(t, "input_schema");
        if (!name || !json_is_object(schema)) return api_bad(ao, "'tools[%zu]' needs a name and an input_schema (server tools are not served)", i);
        json_t *fn = json_pack("{s:s,s:O}", "name", name, "parameters", schema);
        if (json_object_get(t, "description")) json_object_set(fn, "description", json_object_get(t, "description"));
        json_array_append_new(out, json_pack("{s:s,s:o}", "type", "function", "function", fn));
    }
    if (!tc || json_is_null(tc)) return 0;
    const char *type = json_string_value(json_object_get(tc, "type"));
    if (!type) return api_bad(ao, "'tool_choice.type' must be auto, any, tool or none");
    if (json_is_true(json_object_get(tc, "disable_parallel_tool_use"))) json_object_set_new(chat, "parallel_tool_calls", json_false());
    if (!strcmp(type, "tool")) {
        const char *name = json_string_value(json_object_get(tc, "name"));
        if (!name) return api_bad(ao, "'tool_choice.name' must be a string");
        choose_tool(chat, name);
    } else if (!strcmp(type, "any")) json_object_set_new(chat, "tool_choice", json_string("required"));
    else if (!strcmp(type, "auto") || !strcmp(type, "none")) json_object_set_new(chat, "tool_choice", json_string(type));
    else return api_bad(ao, "'tool_choice.type' must be auto, any, tool or none");
    return 0;
}

static int messages_body(api_out *ao, json_t *b, json_t *chat) {
    json_t *msgs = json_array(), *sys = json_object_get(b, "system"), *in = json_object_get(b, "messages");
    json_object_set_new(chat, "messages", msgs);
    if (!json_is_integer(json_object_get(b, "max_tokens"))) return api_bad(ao, "'max_tokens' is required (an integer)");
    if (sys && !json_is_null(sys)) {
        json_t *t = joined_text(ao, sys, "system");
        if (!t) return -1;
        json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", "system", "content", t));
    }
    if (!json_is_array(in) || !json_array_size(in)) return api_bad(ao, "'messages' must be a non-empty list");
    size_t i;
    json_t *m;
    json_array_foreach(in, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        json_t *content = json_object_get(m, "content");
        int rc = role && !strcmp(role, "user") ? messages_user(ao, content, i, msgs)
               : role && !strcmp(role, "assistant") ? messages_assistant(ao, content, i, msgs)
                                                     : api_bad(ao, "'messages[%zu].role' must be user or assistant", i);
        if (rc) return -1;
    }
    copy_fields(b, chat, (const char *const[]){"model", "max_tokens", "temperature", "top_p", "top_k", "stream", "chat_template_kwargs", NULL});
    json_t *stops = json_object_get(b, "stop_sequences"), *th = json_object_get(b, "thinking");
    if (stops) json_object_set(chat, "stop", stops);
    const char *tht = json_string_value(json_object_get(th, "type"));
    if (tht) set_thinking(chat, strcmp(tht, "disabled") != 0);
    json_t *budget = json_object_get(th, "budget_tokens");
    if (tht && !strcmp(tht, "enabled") && budget) json_object_set(chat, "thinking_budget", budget);
    const char *last = json_string_value(json_object_get(json_array_get(in, json_array_size(in) - 1), "role"));
    if (last && !strcmp(last, "assistant")) json_object_set_new(chat, "continue_final_message", json_true()); /* a prefill */
    return messages_tools(ao, b, chat);
}

int api_parse_messages(srv *s, api_out *ao, json_t *body, gen_req *g) { return parse_translated(s, ao, body, g, API_MESSAGES, messages_body); }

void api_count_tokens(srv *s, api_out *ao, json_t *body) {
    gen_req g;
    memset(&g, 0, sizeof g);
    g.tokenize_only = 1;
    json_t *b = json_copy(body);
    if (b && !json_object_get(b, "max_tokens")) json_object_set_new(b, "max_tokens", json_integer(1));
    if (b && api_parse_messages(s, ao, b, &g) == 0) ao->code = 200, ao->body = json_pack("{s:i}", "input_tokens", g.p.n_prompt);
    else if (!b) api_bad(ao, "out of memory");
    json_decref(b);
    gen_req_clear(&g);
}
