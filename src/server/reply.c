/* The replies every handler sends: JSON bodies, OpenAI-style error objects, and the counts by
 * status that /metrics reports. */
#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/utf8.h"
#include "server/srv_int.h"

void srv_count(srv *s, int code) {
    int i = code < 300 ? 0 : code == 401 ? 2 : code == 404 ? 3 : code == 405 || code == 413 ? 4 : code < 500 ? 1 : 5;
    s->http_requests[i]++;
}

void srv_send_text(struct evhttp_request *req, int code, const char *text, size_t len) {
    struct evbuffer *b = evbuffer_new();
    if (text && b) {
        evbuffer_add(b, text, len);
        evbuffer_add(b, "\n", 1);
    }
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
    evhttp_send_reply(req, code, code == 200 ? "OK" : "Error", b);
    if (b) evbuffer_free(b);
}

void srv_send_json(struct evhttp_request *req, int code, json_t *body) {
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    srv_send_text(req, code, text, text ? strlen(text) : 0);
    free(text);
}

void srv_send_error(struct evhttp_request *req, int code, const char *type, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    msg[qf_utf8_valid_prefix(msg, strlen(msg))] = 0; /* a cut-off quote of the input must not break the JSON */
    json_t *err = json_pack("{s:{s:s,s:s,s:i}}", "error", "message", msg, "type", type, "code", code);
    srv_send_json(req, code, err);
}
