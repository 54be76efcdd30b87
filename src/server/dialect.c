/* Replies in the OpenAI Responses and Anthropic Messages formats: whole objects, and streams of
 * named events (event: NAME / data: {...}) that open an item or block for reasoning, for text and
 * for each tool call, send deltas into it and close it, then end with the whole object
 * (response.completed) or message_delta + message_stop. */
#include <event2/buffer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_int.h"

static void send_event(call *c, const char *name, json_t *data) {
    json_object_set_new(data, "type", json_string(name));
    if (c->api == API_RESPONSES) json_object_set_new(data, "sequence_number", json_integer(c->dl.seq++));
    char *text = json_dumps(data, JSON_COMPACT);
    json_decref(data);
    struct evbuffer *b = evbuffer_new();
    if (text && b && c->http) {
        evbuffer_add_printf(b, "event: %s\ndata: %s\n\n", name, text);
        evhttp_send_reply_chunk(c->http, b);
    }
    if (b) evbuffer_free(b);
    free(text);
}

static void item_id(const call *c, const char *kind, int i, char *out, size_t n) { snprintf(out, n, "%s_%s_%d", kind, c->id, i); }

/* The tool call's arguments as an object (Messages' input). */
static json_t *call_input(json_t *tc) {
    const char *a = json_string_value(json_object_get(json_object_get(tc, "function"), "arguments"));
    json_t *o = a ? json_loads(a, JSON_DECODE_ANY, NULL) : NULL;
    return json_is_object(o) ? o : (json_decref(o), json_object());
}

/* Messages' id of an OpenAI-form tool call. */
static void tool_use_id(json_t *tc, char *out, size_t n) { snprintf(out, n, "toolu_%s", json_string_value(json_object_get(tc, "id"))); }

/* A Responses reasoning or message item holding its whole text. */
static json_t *text_item(int reasoning, const char *id, const char *text, size_t n, const char *status) {
    if (reasoning) return json_pack("{s:s,s:s,s:[],s:[{s:s,s:o}]}", "type", "reasoning", "id", id, "summary", "content", "type", "reasoning_text", "text", jstr_lossy(text, n));
    return json_pack("{s:s,s:s,s:s,s:s,s:[{s:s,s:o,s:[]}]}", "type", "message", "id", id, "status", status, "role", "assistant", "content", "type", "output_text",
                     "text", jstr_lossy(text, n), "annotations");
}

/* A Responses function_call item of an OpenAI-form tool call (args NULL: the call's own). */
static json_t *call_item(json_t *tc, const char *id, const char *args, const char *status) {
    json_t *fn = json_object_get(tc, "function");
    return json_pack("{s:s,s:s,s:O,s:O,s:o,s:s}", "type", "function_call", "id", id, "call_id", json_object_get(tc, "id"), "name", json_object_get(fn, "name"),
                     "arguments", args ? json_string(args) : json_incref(json_object_get(fn, "arguments")), "status", status);
}

/* ---- whole objects ---- */

/* The matched stop sequence of a Messages reply (the request's stop_sequences[i]), or NULL. */
static json_t *stop_sequence(const call *c, const qf_req_status *st) {
    if (!st || st->finish != QF_FINISH_STOP || st->stop_index < 0) return NULL;
    return json_array_get(json_object_get(c->orig, "stop_sequences"), (size_t)st->stop_index);
}

static const char *stop_reason(const call *c, const qf_req_status *st, int called) {
    return called ? "tool_use" : st->finish == QF_FINISH_LENGTH ? "max_tokens" : stop_sequence(c, st) ? "stop_sequence" : "end_turn";
}

static json_t *responses_output(const call *c, const char *content, size_t clen, const char *reasoning, size_t rlen, json_t *calls) {
    json_t *out = json_array();
    char id[96];
    int i = 0;
    if (rlen) {
        item_id(c, "rs", i++, id, sizeof id);
        json_array_append_new(out, text_item(1, id, reasoning, rlen, "completed"));
    }
    if (clen || (!json_array_size(calls) && !rlen)) {
        item_id(c, "msg", i++, id, sizeof id);
        json_array_append_new(out, text_item(0, id, content ? content : "", clen, "completed"));
    }
    for (size_t k = 0; k < json_array_size(calls); k++) {
        item_id(c, "fc", i++, id, sizeof id);
        json_array_append_new(out, call_item(json_array_get(calls, k), id, NULL, "completed"));
    }
    return out;
}

static json_t *responses_object(const call *c, const qf_req_status *st, const char *status, json_t *output) {
    json_t *b = c->orig, *r = json_pack("{s:s,s:s,s:I,s:s,s:s,s:n}", "id", c->id, "object", "response", "created_at", (json_int_t)c->created, "status", status,
                                         "model", c->s->model_name, "error");
    json_object_set_new(r, "incomplete_details", st && st->finish == QF_FINISH_LENGTH ? json_pack("{s:s}", "reason", "max_output_tokens") : json_null());
    static const char *const echo[] = {"instructions", "max_output_tokens", "temperature", "top_p", "tool_choice", "tools", "text", "metadata", NULL};
    for (const char *const *k = echo; *k; k++) {
        json_t *v = json_object_get(b, *k);
        json_object_set(r, *k, v ? v : json_null());
    }
    if (!json_object_get(b, "tools")) json_object_set_new(r, "tools", json_array());
    if (!json_object_get(b, "tool_choice")) json_object_set_new(r, "tool_choice", json_string("auto"));
    json_t *ptc = json_object_get(b, "parallel_tool_calls");
    json_object_set_new(r, "parallel_tool_calls", json_boolean(!ptc || json_is_true(ptc)));
    json_object_set_new(r, "output", output);
    json_object_set_new(r, "usage", st ? json_pack("{s:i,s:{s:i},s:i,s:{s:i},s:i}", "input_tokens", st->prompt_tokens, "input_tokens_details", "cached_tokens", st->cached_tokens,
                                                   "output_tokens", st->gen_tokens, "output_tokens_details", "reasoning_tokens", 0, "total_tokens",
                                                   st->prompt_tokens + st->gen_tokens)
                                          : json_null());
    return r;
}

/* Anthropic counts input_tokens apart from the tokens read from the cache; before the first poll
 * (message_start) the whole prompt is counted as input. */
static json_t *messages_usage(const call *c, const qf_req_status *st) {
    return json_pack("{s:i,s:i,s:i,s:i}", "input_tokens", st ? st->prompt_tokens - st->cached_tokens : c->n_prompt, "output_tokens", st ? st->gen_tokens : 0,
                     "cache_read_input_tokens", st ? st->cached_tokens : 0, "cache_creation_input_tokens", 0);
}

static json_t *messages_object(const call *c, const qf_req_status *st, json_t *content, const char *stop) {
    json_t *m = json_pack("{s:s,s:s,s:s,s:s,s:o}", "id", c->id, "type", "message", "role", "assistant", "model", c->s->model_name, "content", content);
    json_t *seq = stop_sequence(c, st);
    json_object_set_new(m, "stop_reason", stop ? json_string(stop) : json_null());
    json_object_set(m, "stop_sequence", seq ? seq : json_null());
    json_object_set_new(m, "usage", messages_usage(c, st));
    return m;
}

static json_t *messages_content(const char *content, size_t clen, const char *reasoning, size_t rlen, json_t *calls) {
    json_t *out = json_array();
    if (rlen) json_array_append_new(out, json_pack("{s:s,s:o,s:s}", "type", "thinking", "thinking", jstr_lossy(reasoning, rlen), "signature", ""));
    if (clen || (!json_array_size(calls) && !rlen)) json_array_append_new(out, json_pack("{s:s,s:o}", "type", "text", "text", jstr_lossy(content ? content : "", clen)));
    for (size_t k = 0; k < json_array_size(calls); k++) {
        json_t *tc = json_array_get(calls, k);
        char id[96];
        tool_use_id(tc, id, sizeof id);
        json_array_append_new(out, json_pack("{s:s,s:s,s:O,s:o}", "type", "tool_use", "id", id, "name", json_object_get(json_object_get(tc, "function"), "name"),
                                             "input", call_input(tc)));
    }
    return out;
}

void dl_reply_whole(call *c, const qf_req_status *st, const char *content, size_t clen, json_t *calls) {
    json_t *body;
    if (c->api == API_RESPONSES)
        body = responses_object(c, st, st->finish == QF_FINISH_LENGTH ? "incomplete" : "completed",
                                responses_output(c, content, clen, c->acc_r, c->len_r, calls));
    else
        body = messages_object(c, st, messages_content(content, clen, c->acc_r, c->len_r, calls), stop_reason(c, st, json_array_size(calls) > 0));
    json_decref(calls);
    srv_count(c->s, 200);
    srv_send_json(c->http, 200, body);
}

/* ---- streams ---- */

void dl_stream_begin(call *c) {
    c->dl.open = -1;
    if (c->api == API_RESPONSES) {
        send_event(c, "response.created", json_pack("{s:o}", "response", responses_object(c, NULL, "in_progress", json_array())));
        send_event(c, "response.in_progress", json_pack("{s:o}", "response", responses_object(c, NULL, "in_progress", json_array())));
    } else {
        send_event(c, "message_start", json_pack("{s:o}", "message", messages_object(c, NULL, json_array(), NULL)));
    }
}

static void close_block(call *c) {
    dialect_state *d = &c->dl;
    if (d->open < 0) return;
    int i = d->index - 1, r = d->open;
    const char *text = (r ? d->all_r : d->all_c) + d->block_at;
    size_t n = (r ? d->len_r : d->len_c) - d->block_at;
    if (c->api == API_RESPONSES) {
        char id[96];
        item_id(c, r ? "rs" : "msg", i, id, sizeof id);
        if (r) send_event(c, "response.reasoning_text.done", json_pack("{s:s,s:i,s:i,s:o}", "item_id", id, "output_index", i, "content_index", 0, "text", jstr_lossy(text, n)));
        else {
            send_event(c, "response.output_text.done", json_pack("{s:s,s:i,s:i,s:o,s:[]}", "item_id", id, "output_index", i, "content_index", 0, "text", jstr_lossy(text, n), "logprobs"));
            send_event(c, "response.content_part.done", json_pack("{s:s,s:i,s:i,s:{s:s,s:o,s:[]}}", "item_id", id, "output_index", i, "content_index", 0, "part", "type",
                                                                  "output_text", "text", jstr_lossy(text, n), "annotations"));
        }
        send_event(c, "response.output_item.done", json_pack("{s:i,s:o}", "output_index", i, "item", text_item(r, id, text, n, "completed")));
    } else {
        if (r) send_event(c, "content_block_delta", json_pack("{s:i,s:{s:s,s:s}}", "index", i, "delta", "type", "signature_delta", "signature", ""));
        send_event(c, "content_block_stop", json_pack("{s:i}", "index", i));
    }
    d->open = -1;
}

static void open_block(call *c, int r) {
    dialect_state *d = &c->dl;
    int i = d->index++;
    d->block_at = r ? d->len_r : d->len_c;
    d->open = r;
    if (c->api == API_RESPONSES) {
        char id[96];
        item_id(c, r ? "rs" : "msg", i, id, sizeof id);
        send_event(c, "response.output_item.added", json_pack("{s:i,s:o}", "output_index", i, "item", r ? json_pack("{s:s,s:s,s:[]}", "type", "reasoning", "id", id, "summary")
                                                                                                     : json_pack("{s:s,s:s,s:s,s:s,s:[]}", "type", "message", "id", id, "status", "in_progress", "role", "assistant", "content")));
        if (!r) send_event(c, "response.content_part.added", json_pack("{s:s,s:i,s:i,s:{s:s,s:s,s:[]}}", "item_id", id, "output_index", i, "content_index", 0, "part", "type",
                                                                       "output_text", "text", "", "annotations"));
    } else {
        send_event(c, "content_block_start", json_pack("{s:i,s:o}", "index", i, "content_block", r ? json_pack("{s:s,s:s,s:s}", "type", "thinking", "thinking", "", "signature", "")
                                                                                                   : json_pack("{s:s,s:s}", "type", "text", "text", "")));
    }
}

void dl_stream_text(call *c, int r, const char *p, size_t n) {
    dialect_state *d = &c->dl;
    if (!n) return;
    if (d->open != r) {
        close_block(c);
        open_block(c, r);
    }
    if (r) acc_add(&d->all_r, &d->len_r, &d->cap_r, p, n);
    else acc_add(&d->all_c, &d->len_c, &d->cap_c, p, n);
    int i = d->index - 1;
    if (c->api == API_RESPONSES) {
        char id[96];
        item_id(c, r ? "rs" : "msg", i, id, sizeof id);
        send_event(c, r ? "response.reasoning_text.delta" : "response.output_text.delta",
                   r ? json_pack("{s:s,s:i,s:i,s:o}", "item_id", id, "output_index", i, "content_index", 0, "delta", jstr_lossy(p, n))
                     : json_pack("{s:s,s:i,s:i,s:o,s:[]}", "item_id", id, "output_index", i, "content_index", 0, "delta", jstr_lossy(p, n), "logprobs"));
    } else {
        send_event(c, "content_block_delta", json_pack("{s:i,s:{s:s,s:o}}", "index", i, "delta", "type", r ? "thinking_delta" : "text_delta", r ? "thinking" : "text",
                                                       jstr_lossy(p, n)));
    }
}

void dl_stream_calls(call *c, json_t *calls) {
    close_block(c);
    dialect_state *d = &c->dl;
    if (!d->calls) d->calls = json_array();
    for (size_t k = 0; k < json_array_size(calls); k++) {
        json_t *tc = json_array_get(calls, k), *fn = json_object_get(tc, "function");
        json_array_append(d->calls, tc);
        int i = d->index++;
        if (c->api == API_RESPONSES) {
            char id[96];
            item_id(c, "fc", i, id, sizeof id);
            send_event(c, "response.output_item.added", json_pack("{s:i,s:o}", "output_index", i, "item", call_item(tc, id, "", "in_progress")));
            send_event(c, "response.function_call_arguments.delta", json_pack("{s:s,s:i,s:O}", "item_id", id, "output_index", i, "delta", json_object_get(fn, "arguments")));
            send_event(c, "response.function_call_arguments.done", json_pack("{s:s,s:i,s:O,s:O}", "item_id", id, "output_index", i, "name", json_object_get(fn, "name"),
                                                                              "arguments", json_object_get(fn, "arguments")));
            send_event(c, "response.output_item.done", json_pack("{s:i,s:o}", "output_index", i, "item", call_item(tc, id, NULL, "completed")));
        } else {
            char id[96];
            tool_use_id(tc, id, sizeof id);
            send_event(c, "content_block_start", json_pack("{s:i,s:{s:s,s:s,s:O,s:{}}}", "index", i, "content_block", "type", "tool_use", "id", id, "name",
                                                           json_object_get(fn, "name"), "input"));
            char *args = json_dumps(call_input(tc), JSON_COMPACT); /* the input object, normalised */
            send_event(c, "content_block_delta", json_pack("{s:i,s:{s:s,s:s}}", "index", i, "delta", "type", "input_json_delta", "partial_json", args ? args : "{}"));
            free(args);
            send_event(c, "content_block_stop", json_pack("{s:i}", "index", i));
        }
    }
}

void dl_stream_end(call *c, const qf_req_status *st) {
    dialect_state *d = &c->dl;
    if (st->finish == QF_FINISH_ERROR) {
        if (c->api == API_RESPONSES) send_event(c, "error", json_pack("{s:s,s:s,s:n}", "code", "server_error", "message", st->error, "param"));
        else send_event(c, "error", json_pack("{s:{s:s,s:s}}", "error", "type", "api_error", "message", st->error));
    } else {
        close_block(c);
        int called = json_array_size(d->calls) > 0;
        if (c->api == API_RESPONSES) {
            const char *status = st->finish == QF_FINISH_LENGTH ? "incomplete" : "completed";
            json_t *out = responses_output(c, d->all_c, d->len_c, d->all_r, d->len_r, d->calls);
            send_event(c, st->finish == QF_FINISH_LENGTH ? "response.incomplete" : "response.completed", json_pack("{s:o}", "response", responses_object(c, st, status, out)));
        } else {
            json_t *seq = stop_sequence(c, st);
            send_event(c, "message_delta", json_pack("{s:{s:s,s:O},s:o}", "delta", "stop_reason", stop_reason(c, st, called), "stop_sequence", seq ? seq : json_null(),
                                                     "usage", messages_usage(c, st)));
            send_event(c, "message_stop", json_object());
        }
    }
    evhttp_send_reply_end(c->http);
}

void dl_free(call *c) {
    free(c->dl.all_c);
    free(c->dl.all_r);
    json_decref(c->dl.calls);
    json_decref(c->orig);
}
