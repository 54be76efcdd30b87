/* The replies every handler sends: JSON bodies, OpenAI-style error objects, and the counts by
 * status that /metrics reports. */
#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/utf8.h"
#include "server/server_int.h"

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

/* The field an error names: its message starts with it quoted ('messages[2].content' ...). */
static json_t *error_param(const char *msg) {
    const char *end = msg[0] == '\'' ? strchr(msg + 1, '\'') : NULL;
    return end && end - msg < 200 ? json_stringn(msg + 1, (size_t)(end - msg - 1)) : json_null();
}

static const char *anthropic_type(int code) {
    return code == 401 ? "authentication_error" : code == 403 ? "permission_error" : code == 404 ? "not_found_error" : code == 413 ? "request_too_large"
         : code == 429 ? "rate_limit_error" : code == 503 || code == 529 ? "overloaded_error" : code >= 500 ? "api_error" : "invalid_request_error";
}

/* OpenAI's shape {"error": {message, type, param, code}}, or on /v1/messages Anthropic's
 * {"type": "error", "error": {type, message}}. */
static void send_error_v(struct evhttp_request *req, int code, const char *type, const char *ecode, const char *fmt, va_list ap) {
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    msg[qf_utf8_valid_prefix(msg, strlen(msg))] = 0; /* a cut-off quote of the input must not break the JSON */
    const char *uri = evhttp_request_get_uri(req);
    json_t *err;
    if (uri && !strncmp(uri, "/v1/messages", 12))
        err = json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "type", anthropic_type(code), "message", msg);
    else
        err = json_pack("{s:{s:s,s:s,s:o,s:o}}", "error", "message", msg, "type", type, "param", error_param(msg), "code",
                        ecode ? json_string(ecode) : code == 401 ? json_string("invalid_api_key") : json_null());
    srv_send_json(req, code, err);
}

void srv_send_error(struct evhttp_request *req, int code, const char *type, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    send_error_v(req, code, type, NULL, fmt, ap);
    va_end(ap);
}

void srv_send_error_code(struct evhttp_request *req, int code, const char *type, const char *ecode, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    send_error_v(req, code, type, ecode, fmt, ap);
    va_end(ap);
}

json_t *jstr_lossy(const char *p, size_t n) {
    if (qf_utf8_valid_prefix(p, n) == n) return json_stringn(p, n);
    char small[256], *buf = 3 * n + 1 <= sizeof small ? small : malloc(3 * n + 1);
    if (!buf) return json_string("");
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        int k = qf_utf8_seq_len((const unsigned char *)p + i, n - i);
        if (k > 0) {
            memcpy(buf + o, p + i, (size_t)k);
            o += (size_t)k, i += (size_t)k;
        } else {
            memcpy(buf + o, "\xEF\xBF\xBD", 3);
            o += 3, i++;
        }
    }
    json_t *j = json_stringn(buf, o);
    if (buf != small) free(buf);
    return j;
}

void acc_add(char **buf, size_t *len, size_t *cap, const char *p, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t nc = (*cap ? *cap * 2 : 256);
        while (nc < *len + n + 1) nc *= 2;
        char *nb = realloc(*buf, nc);
        if (!nb) return; /* the reply loses text rather than the server crashing */
        *buf = nb, *cap = nc;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    (*buf)[*len] = 0;
}
