/* The front of every connection: clients connect here, and what evhttp sees comes through a local
 * socket per client, checked.
 *
 * Requests: a request head is held until it is whole and checked strictly (RFC 9112: a request
 * line of three parts, header names of token characters with the colon right after them, no
 * obs-fold, no control characters in values, at most one Content-Length of digits only, no
 * Content-Length beside Transfer-Encoding, Transfer-Encoding "chunked" only). A chunked body is
 * checked (hexadecimal sizes, extensions of token characters) and handed on with a Content-Length,
 * so evhttp only ever sees framing nobody can read two ways. A request that fails is replaced by
 * a synthetic one to FRONT_PATH carrying the status and the reason, which server.c answers as a
 * JSON error before closing; nothing after it is read.
 *
 * Responses are followed (heads, Content-Length and chunked bodies) to know when every request
 * has been answered, which gives: half-closed clients (an EOF after a whole request) keep their
 * reply and the connection closes once it is written; deadlines to send a head and a body, an
 * idle keep-alive deadline (server.h), and none while a reply is owed; a
 * cap on connections, the longest-idle connection giving way to a new one, 503 when none can;
 * accept errors (out of descriptors) pause the listener instead of spinning. A client's socket to
 * evhttp is opened only once it has sent a whole, valid request head, and closed with it. */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/listener.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/timer.h"
#include "server/server_int.h"

#define HEAD_MAX (64 * 1024)
#define OVER_CAP_SECONDS 2.0
#define PIPE_MAX 64 /* requests answered in order, HEAD or not */

enum { R_HEAD, R_BODY, R_CHUNK_SIZE, R_CHUNK_DATA, R_CHUNK_CRLF, R_TRAILER, R_DISCARD };
enum { W_HEAD, W_BODY, W_CHUNK_SIZE, W_CHUNK_DATA, W_CHUNK_CRLF, W_TRAILER };

typedef struct conn {
    srv *s;
    struct bufferevent *client, *backend; /* backend: to evhttp, NULL until a request goes there */
    struct event *timer;
    double opened, activity, head_start, body_start;
    /* requests */
    int rstate;
    uint64_t left, body_len;
    struct evbuffer *held;  /* a chunked request's body, decoded, until its last chunk */
    char *head_text;        /* that request's head, held with it */
    size_t head_len;
    int n_in, half_closed, backend_gone, over_cap;
    unsigned char is_head[PIPE_MAX];
    /* responses */
    int wstate, n_out;
    uint64_t wleft;
    char wline[64];
    int wline_len;
    struct conn *prev, *next;
} conn;

/* ---- checking a request head ---- */

static int tchar(unsigned char c) { return c > 32 && c < 127 && !strchr("\"(),/:;<=>?@[\\]{}", c); }

typedef struct head_info {
    int cl_count, te_chunked, te_other, is_head, http10;
    uint64_t cl;
    char why[160];
} head_info;

static int why(head_info *h, const char *reason) {
    snprintf(h->why, sizeof h->why, "%s", reason);
    return -1;
}

static int check_request_line(const char *p, size_t n, head_info *h) {
    const char *sp1 = memchr(p, ' ', n), *sp2 = sp1 ? memchr(sp1 + 1, ' ', n - (size_t)(sp1 + 1 - p)) : NULL;
    if (!sp1 || !sp2 || sp1 == p || sp2 == sp1 + 1) return why(h, "malformed request line");
    for (const char *q = p; q < sp1; q++)
        if (!tchar((unsigned char)*q)) return why(h, "malformed method in the request line");
    for (const char *q = sp1 + 1; q < sp2; q++)
        if ((unsigned char)*q <= 32 || *q == 127) return why(h, "malformed target in the request line");
    size_t vl = n - (size_t)(sp2 + 1 - p);
    if (!(vl == 8 && (memcmp(sp2 + 1, "HTTP/1.1", 8) == 0 || memcmp(sp2 + 1, "HTTP/1.0", 8) == 0)))
        return why(h, "unsupported HTTP version in the request line");
    h->is_head = sp1 - p == 4 && memcmp(p, "HEAD", 4) == 0;
    h->http10 = sp2[8] == '0';
    return 0;
}

static int check_value(const char *v, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)v[i] < 32 && v[i] != '\t') || v[i] == 127) return -1;
    return 0;
}

static void trim(const char **v, size_t *n) {
    while (*n && (**v == ' ' || **v == '\t')) (*v)++, (*n)--;
    while (*n && ((*v)[*n - 1] == ' ' || (*v)[*n - 1] == '\t')) (*n)--;
}

/* One header line (no CRLF): name, colon, value. */
static int check_header(const char *p, size_t n, head_info *h) {
    if (!n) return why(h, "empty header line");
    if (p[0] == ' ' || p[0] == '\t') return why(h, "obsolete line folding in the headers");
    const char *colon = memchr(p, ':', n);
    if (!colon || colon == p) return why(h, "a header line without a name and a colon");
    for (const char *q = p; q < colon; q++)
        if (!tchar((unsigned char)*q)) return why(h, "a header name with a character not allowed there (whitespace before the colon?)");
    const char *v = colon + 1;
    size_t vn = n - (size_t)(v - p), nl = (size_t)(colon - p);
    if (check_value(v, vn)) return why(h, "a control character in a header value");
    trim(&v, &vn);
    if (nl == 14 && strncasecmp(p, "content-length", 14) == 0) {
        if (++h->cl_count > 1) return why(h, "more than one Content-Length");
        if (!vn || vn > 18) return why(h, "Content-Length is not a decimal number");
        h->cl = 0;
        for (size_t i = 0; i < vn; i++) {
            if (v[i] < '0' || v[i] > '9') return why(h, "Content-Length is not a decimal number");
            h->cl = h->cl * 10 + (uint64_t)(v[i] - '0');
        }
    } else if (nl == 17 && strncasecmp(p, "transfer-encoding", 17) == 0) {
        if (h->te_chunked || h->te_other) return why(h, "more than one Transfer-Encoding");
        if (vn == 7 && strncasecmp(v, "chunked", 7) == 0) h->te_chunked = 1;
        else h->te_other = 1;
    }
    return 0;
}

/* The head (request line to the empty line, CRLFs included) checked; 0 or -1 with h->why. */
static int check_head(const char *p, size_t n, head_info *h) {
    memset(h, 0, sizeof *h);
    const char *end = p + n - 2; /* the final empty line's CRLF */
    int first = 1;
    for (const char *line = p; line < end;) {
        const char *cr = memchr(line, '\r', (size_t)(end - line) + 1);
        if (!cr || cr[1] != '\n') return why(h, "a line not ended by CRLF");
        if (memchr(line, '\n', (size_t)(cr - line))) return why(h, "a bare LF in the head");
        if (first ? check_request_line(line, (size_t)(cr - line), h) : check_header(line, (size_t)(cr - line), h)) return -1;
        first = 0;
        line = cr + 2;
    }
    if (h->te_other) return why(h, "a Transfer-Encoding other than chunked");
    if (h->te_chunked && h->cl_count) return why(h, "both Content-Length and Transfer-Encoding");
    if (h->te_chunked && h->http10) return why(h, "Transfer-Encoding in an HTTP/1.0 request");
    return 0;
}

/* ---- requests, client to evhttp ---- */

/* The request in its place: a synthetic one that server.c answers with code and reason. */
static void refuse(conn *c, struct evbuffer *dst, int code, const char *reason) {
    evbuffer_add_printf(dst, "POST " FRONT_PATH " HTTP/1.1\r\nHost: qflash\r\nConnection: close\r\n" FRONT_STATUS ": %d\r\n" FRONT_REASON
                             ": %s\r\nContent-Length: 0\r\n\r\n", code, reason);
    c->is_head[c->n_in % PIPE_MAX] = 0;
    c->n_in++;
    c->rstate = R_DISCARD;
}

static void request_done(conn *c, int is_head) {
    c->is_head[c->n_in % PIPE_MAX] = (unsigned char)is_head;
    c->n_in++;
    c->rstate = R_HEAD;
}

/* A whole head is at the front of src (n bytes): checked, then passed on or held. */
static void take_head(conn *c, struct evbuffer *src, struct evbuffer *dst, size_t n) {
    char *head = malloc(n);
    if (!head) return refuse(c, dst, 500, "out of memory");
    evbuffer_remove(src, head, n);
    head_info h;
    size_t max_body = c->s->o->max_body;
    if (c->n_in - c->n_out >= PIPE_MAX) refuse(c, dst, 400, "too many pipelined requests");
    else if (check_head(head, n, &h)) refuse(c, dst, 400, h.why);
    else if (h.cl_count && h.cl > max_body) refuse(c, dst, 413, "the body is larger than --max-body");
    else if (h.te_chunked) {
        free(c->head_text);
        c->head_text = head, c->head_len = n, head = NULL;
        c->body_len = 0, c->rstate = R_CHUNK_SIZE, c->body_start = qf_now();
        c->is_head[c->n_in % PIPE_MAX] = (unsigned char)h.is_head;
    } else {
        evbuffer_add(dst, head, n);
        c->left = h.cl_count ? h.cl : 0;
        if (c->left) c->rstate = R_BODY, c->body_start = qf_now(), c->is_head[c->n_in % PIPE_MAX] = (unsigned char)h.is_head;
        else request_done(c, h.is_head);
    }
    free(head);
}

/* The chunked request as evhttp reads it: its head without Transfer-Encoding, a Content-Length,
 * the body. */
static void pass_chunked(conn *c, struct evbuffer *dst) {
    const char *p = c->head_text, *end = p + c->head_len - 2;
    for (const char *line = p; line < end;) {
        const char *cr = memchr(line, '\r', (size_t)(end - line) + 1);
        size_t n = (size_t)(cr - line);
        if (!(n >= 18 && strncasecmp(line, "transfer-encoding:", 18) == 0)) evbuffer_add(dst, line, n + 2);
        line = cr + 2;
    }
    evbuffer_add_printf(dst, "Content-Length: %llu\r\n\r\n", (unsigned long long)c->body_len);
    evbuffer_add_buffer(dst, c->held);
    request_done(c, c->is_head[c->n_in % PIPE_MAX]);
}

/* A chunk-size line (no CRLF): hex digits, then extensions of token characters (and '=', quotes). */
static int chunk_size(const char *p, size_t n, uint64_t *size) {
    size_t i = 0;
    *size = 0;
    for (; i < n && i < 16 && p[i] && strchr("0123456789abcdefABCDEF", p[i]); i++)
        *size = *size * 16 + (uint64_t)(p[i] <= '9' ? p[i] - '0' : (p[i] | 32) - 'a' + 10);
    if (i == 0 || (i < n && p[i] != ';')) return -1;
    for (; i < n; i++)
        if (!(tchar((unsigned char)p[i]) || p[i] == ';' || p[i] == '=' || p[i] == '"')) return -1;
    return 0;
}

/* A line of a chunked body (a size or a trailer field). */
static void chunk_line(conn *c, struct evbuffer *dst, const char *line, size_t n) {
    if (c->rstate == R_TRAILER) {
        head_info h;
        memset(&h, 0, sizeof h);
        if (n == 0) pass_chunked(c, dst);
        else if (check_header(line, n, &h) || h.cl_count || h.te_chunked || h.te_other) refuse(c, dst, 400, "a malformed trailer field");
        return;
    }
    uint64_t size;
    if (chunk_size(line, n, &size)) return refuse(c, dst, 400, "a chunk size that is not hexadecimal digits");
    if (size > c->s->o->max_body || c->body_len + size > c->s->o->max_body) return refuse(c, dst, 413, "the body is larger than --max-body");
    c->body_len += size, c->left = size;
    c->rstate = size ? R_CHUNK_DATA : R_TRAILER;
}

/* A line ended by LF alone in what has come so far (which would never end the head). */
static int bare_lf(struct evbuffer *src, size_t have) {
    const char *p = (const char *)evbuffer_pullup(src, (ev_ssize_t)have);
    for (const char *q = p ? memchr(p, '\n', have) : NULL; q; q = memchr(q + 1, '\n', have - (size_t)(q + 1 - p)))
        if (q == p || q[-1] != '\r') return 1;
    return 0;
}

/* One step of the request state machine; 0 when it needs more bytes. */
static int request_step(conn *c, struct evbuffer *src, struct evbuffer *dst) {
    size_t have = evbuffer_get_length(src);
    if (!have) return 0;
    if (c->rstate == R_DISCARD) return evbuffer_drain(src, have), 0;
    if (c->rstate == R_BODY || c->rstate == R_CHUNK_DATA) {
        size_t n = have < c->left ? have : (size_t)c->left;
        evbuffer_remove_buffer(src, c->rstate == R_BODY ? dst : c->held, n);
        c->left -= n;
        if (!c->left) {
            if (c->rstate == R_BODY) request_done(c, c->is_head[c->n_in % PIPE_MAX]);
            else c->rstate = R_CHUNK_CRLF;
        }
        return 1;
    }
    if (c->rstate == R_CHUNK_CRLF) {
        if (have < 2) return 0;
        char crlf[2];
        evbuffer_remove(src, crlf, 2);
        if (crlf[0] != '\r' || crlf[1] != '\n') refuse(c, dst, 400, "chunk data not followed by CRLF");
        else c->rstate = R_CHUNK_SIZE;
        return 1;
    }
    int head = c->rstate == R_HEAD;
    struct evbuffer_ptr at = evbuffer_search(src, head ? "\r\n\r\n" : "\r\n", head ? 4 : 2, NULL);
    if (at.pos < 0) {
        if (have > (head ? HEAD_MAX : 4096)) refuse(c, dst, head ? 431 : 400, head ? "the request head is larger than 64 KiB" : "a chunk line is too long");
        else if (bare_lf(src, have)) refuse(c, dst, 400, "a line not ended by CRLF");
        return c->rstate == R_DISCARD;
    }
    if (head && at.pos == 0) return evbuffer_drain(src, 2), 1; /* an empty line before a request is ignored (RFC 9112 2.2) */
    if (head) return take_head(c, src, dst, (size_t)at.pos + 4), 1;
    char line[4096];
    size_t n = (size_t)at.pos;
    if (n >= sizeof line) return refuse(c, dst, 400, "a chunk line is too long"), 1;
    evbuffer_remove(src, line, n + 2);
    chunk_line(c, dst, line, n);
    return 1;
}

/* ---- responses, evhttp to client: where each ends ---- */

static void response_done(conn *c) {
    c->n_out++;
    c->wstate = W_HEAD;
}

/* The response head (evhttp writes it at once): its status and framing. */
static void take_response_head(conn *c, struct evbuffer *src, struct evbuffer *dst, size_t n) {
    char *head = malloc(n + 1);
    if (!head) return evbuffer_remove_buffer(src, dst, n), response_done(c);
    evbuffer_remove(src, head, n);
    head[n] = 0;
    int status = n > 12 ? atoi(head + 9) : 200;
    uint64_t cl = 0;
    int has_cl = 0, chunked = 0;
    for (char *line = strstr(head, "\r\n"); line && line[2] != '\r'; line = strstr(line + 2, "\r\n")) {
        char *l = line + 2;
        if (strncasecmp(l, "content-length:", 15) == 0) has_cl = 1, cl = strtoull(l + 15, NULL, 10);
        else if (strncasecmp(l, "transfer-encoding:", 18) == 0 && strstr(l, "chunked")) chunked = 1;
    }
    evbuffer_add(dst, head, n);
    free(head);
    if (status >= 100 && status < 200) return; /* interim (100 Continue): the final one follows */
    if (c->is_head[c->n_out % PIPE_MAX] || status == 204 || status == 304 || (!chunked && (!has_cl || !cl))) response_done(c);
    else if (chunked) c->wstate = W_CHUNK_SIZE, c->wline_len = 0;
    else c->wstate = W_BODY, c->wleft = cl;
}

/* A line of a chunked response (size, the CRLF after data, or a trailer), copied as it passes. */
static int response_line(conn *c, struct evbuffer *src, struct evbuffer *dst) {
    char ch;
    while (evbuffer_remove(src, &ch, 1) == 1) {
        evbuffer_add(dst, &ch, 1);
        if (c->wline_len < (int)sizeof c->wline - 1) c->wline[c->wline_len++] = ch;
        if (ch != '\n') continue;
        c->wline[c->wline_len] = 0;
        int empty = c->wline_len <= 2;
        c->wline_len = 0;
        if (c->wstate == W_TRAILER) {
            if (empty) response_done(c);
        } else if (c->wstate == W_CHUNK_CRLF) {
            c->wstate = W_CHUNK_SIZE;
        } else {
            c->wleft = strtoull(c->wline, NULL, 16);
            c->wstate = c->wleft ? W_CHUNK_DATA : W_TRAILER;
        }
        return 1;
    }
    return 0;
}

static void responses(conn *c, struct evbuffer *src, struct evbuffer *dst) {
    for (size_t have; (have = evbuffer_get_length(src)) > 0;) {
        if (c->wstate == W_HEAD) {
            struct evbuffer_ptr at = evbuffer_search(src, "\r\n\r\n", 4, NULL);
            if (at.pos < 0) {
                if (have > HEAD_MAX) evbuffer_remove_buffer(src, dst, have); /* not a head we understand: passed on */
                return;
            }
            take_response_head(c, src, dst, (size_t)at.pos + 4);
        } else if (c->wstate == W_BODY || c->wstate == W_CHUNK_DATA) {
            size_t n = have < c->wleft ? have : (size_t)c->wleft;
            evbuffer_remove_buffer(src, dst, n);
            c->wleft -= n;
            if (!c->wleft) {
                if (c->wstate == W_BODY) response_done(c);
                else c->wstate = W_CHUNK_CRLF;
            }
        } else if (!response_line(c, src, dst)) {
            return;
        }
    }
}

/* ---- the connection's life ---- */

static int owed(const conn *c) { return c->n_in > c->n_out || c->wstate != W_HEAD; }

static void conn_close(conn *c) {
    srv *s = c->s;
    if (c->prev) c->prev->next = c->next;
    else s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->n_conns--;
    if (c->backend) bufferevent_free(c->backend); /* evhttp sees the close: a call still running is cancelled */
    bufferevent_free(c->client);
    event_free(c->timer);
    evbuffer_free(c->held);
    free(c->head_text);
    free(c);
}

/* The deadline of the connection's state; none while a reply is owed and no request is coming in. */
static void rearm(conn *c) {
    double due = 0;
    if (c->over_cap) due = c->opened + OVER_CAP_SECONDS;
    else if (c->rstate == R_HEAD && c->head_start) due = c->head_start + c->s->o->header_timeout;
    else if (c->rstate != R_HEAD && c->rstate != R_DISCARD) due = c->body_start + c->s->o->body_timeout;
    else if (!owed(c) && !c->half_closed) due = c->activity + c->s->o->idle_timeout;
    if (!due) {
        event_del(c->timer);
        return;
    }
    double in = due - qf_now();
    if (in < 0) in = 0;
    struct timeval tv = {(time_t)in, (suseconds_t)((in - (double)(time_t)in) * 1e6)};
    event_add(c->timer, &tv);
}

static void on_timer(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    conn_close(arg);
}

/* Everything owed is written and nothing more can come: the connection ends. */
static int finished(conn *c) {
    return (c->half_closed || c->backend_gone) && !owed(c) && evbuffer_get_length(bufferevent_get_output(c->client)) == 0;
}

static void backend_read(struct bufferevent *bev, void *arg) {
    conn *c = arg;
    responses(c, bufferevent_get_input(bev), bufferevent_get_output(c->client));
    c->activity = qf_now();
    rearm(c);
}

/* evhttp closed its side (after a reply with Connection: close, or at shutdown): what it sent is
 * written out, then the client's connection closes too. */
static void backend_event(struct bufferevent *bev, short what, void *arg) {
    conn *c = arg;
    if (what & BEV_EVENT_CONNECTED) return;
    responses(c, bufferevent_get_input(bev), bufferevent_get_output(c->client));
    c->backend_gone = 1;
    c->n_out = c->n_in, c->wstate = W_HEAD; /* nothing more will be answered */
    if (evbuffer_get_length(bufferevent_get_output(c->client)) == 0) conn_close(c);
    else bufferevent_disable(c->client, EV_READ);
}

static int open_backend(conn *c) {
    struct event_base *base = bufferevent_get_base(c->client);
    c->backend = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
    if (!c->backend) return -1;
    bufferevent_setcb(c->backend, backend_read, NULL, backend_event, c);
    bufferevent_enable(c->backend, EV_READ | EV_WRITE);
    const srv *s = c->s;
    return bufferevent_socket_connect(c->backend, (const struct sockaddr *)&s->backend_addr, (int)s->backend_len);
}

static void client_read(struct bufferevent *bev, void *arg) {
    conn *c = arg;
    struct evbuffer *src = bufferevent_get_input(bev), *dst = evbuffer_new();
    if (!dst) return conn_close(c);
    c->activity = qf_now();
    if (c->over_cap && c->rstate != R_DISCARD) refuse(c, dst, 503, "too many connections");
    if (c->rstate == R_HEAD && !c->head_start && evbuffer_get_length(src)) c->head_start = c->activity;
    while (request_step(c, src, dst))
        if (c->rstate == R_HEAD) c->head_start = evbuffer_get_length(src) ? c->activity : 0;
    if (evbuffer_get_length(dst) && !c->backend && open_backend(c) != 0) {
        evbuffer_free(dst);
        return conn_close(c);
    }
    if (c->backend) evbuffer_add_buffer(bufferevent_get_output(c->backend), dst);
    evbuffer_free(dst);
    rearm(c);
}

static void client_write(struct bufferevent *bev, void *arg) {
    (void)bev;
    conn *c = arg;
    if (finished(c)) conn_close(c);
}

/* An EOF after whole requests is a half-close: their replies are still written, and a request
 * the EOF cut short (bytes past a Content-Length) is dropped without taking them along. Anything
 * else (an EOF inside the only request, a reset, a failed write) ends the connection. */
static void client_event(struct bufferevent *bev, short what, void *arg) {
    conn *c = arg;
    int between = (c->rstate == R_HEAD && !c->head_start) || c->rstate == R_DISCARD; /* no request half-sent */
    if ((what & BEV_EVENT_EOF) && (what & BEV_EVENT_READING) && (between || owed(c))) {
        c->half_closed = 1;
        bufferevent_disable(bev, EV_READ);
        if (!finished(c)) return rearm(c);
    }
    conn_close(c);
}

/* At the cap: the connection idle the longest gives way; 0 when every one is busy. */
static int evict_idle(srv *s) {
    conn *oldest = NULL;
    for (conn *c = s->conns; c; c = c->next)
        if (!c->over_cap && c->rstate == R_HEAD && !owed(c) && (!oldest || c->activity < oldest->activity)) oldest = c;
    if (!oldest) return 0;
    conn_close(oldest);
    return 1;
}

static void on_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *addr, int len, void *arg) {
    (void)l, (void)addr, (void)len;
    srv *s = arg;
    conn *c = calloc(1, sizeof *c);
    struct event_base *base = s->base;
    if (c) c->client = bufferevent_socket_new(base, fd, BEV_OPT_CLOSE_ON_FREE);
    if (c) c->held = evbuffer_new(), c->timer = evtimer_new(base, on_timer, c);
    if (!c || !c->client || !c->held || !c->timer) {
        if (c && c->client) bufferevent_free(c->client);
        else evutil_closesocket(fd);
        if (c && c->held) evbuffer_free(c->held);
        if (c && c->timer) event_free(c->timer);
        free(c);
        return;
    }
    c->s = s;
    c->opened = c->activity = qf_now();
    if (s->n_conns >= s->o->max_conns && !evict_idle(s)) c->over_cap = 1;
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    bufferevent_setcb(c->client, client_read, client_write, client_event, c);
    bufferevent_enable(c->client, EV_READ | EV_WRITE);
    rearm(c);
}

/* Out of descriptors (or another accept error): the listener rests 100 ms instead of spinning,
 * and says so at most once a second. */
static void on_accept_error(struct evconnlistener *l, void *arg) {
    srv *s = arg;
    int err = EVUTIL_SOCKET_ERROR();
    double now = qf_now();
    if (now - s->accept_logged >= 1.0) {
        fprintf(stderr, "qflash serve: accept: %s (%d connections open); pausing new connections\n", evutil_socket_error_to_string(err), s->n_conns);
        s->accept_logged = now;
    }
    evconnlistener_disable(l);
    struct timeval tv = {0, 100000};
    event_add(s->accept_pause, &tv);
}

static void on_accept_resume(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    srv *s = arg;
    if (s->listener) evconnlistener_enable(s->listener);
}

/* evhttp's own socket: an abstract Unix socket only this process knows. */
static int bind_backend(srv *s) {
    static unsigned counter;
    struct sockaddr_un *a = (struct sockaddr_un *)&s->backend_addr;
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "qflash-%d-%u", (int)getpid(), counter++);
    s->backend_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
    evutil_socket_t fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)a, s->backend_len) != 0 || listen(fd, 1024) != 0 || evutil_make_socket_nonblocking(fd) != 0) {
        if (fd >= 0) close(fd);
        return qf_fail(QF_EIO, "cannot make the server's internal socket: %s", strerror(errno));
    }
    s->sock = evhttp_accept_socket_with_handle(s->http, fd);
    if (!s->sock) {
        close(fd);
        return qf_fail(QF_EIO, "cannot serve on the internal socket");
    }
    return QF_OK;
}

int front_start(srv *s) {
    const qf_server_opts *o = s->o;
    char port[16];
    snprintf(port, sizeof port, "%d", o->port);
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC, hints.ai_socktype = SOCK_STREAM, hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int gai = getaddrinfo(o->host, port, &hints, &ai);
    if (gai != 0) return qf_fail(QF_EINVAL, "cannot listen on %s:%d: %s", o->host, o->port, gai_strerror(gai));
    s->listener = evconnlistener_new_bind(s->base, on_accept, s, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE, 1024, ai->ai_addr, (int)ai->ai_addrlen);
    freeaddrinfo(ai);
    if (!s->listener) return qf_fail(QF_EIO, "cannot listen on %s:%d: %s", o->host, o->port, strerror(errno));
    evconnlistener_set_error_cb(s->listener, on_accept_error);
    s->accept_pause = evtimer_new(s->base, on_accept_resume, s);
    if (!s->accept_pause) return qf_fail(QF_ENOMEM, "out of memory");
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    s->port = o->port;
    if (getsockname(evconnlistener_get_fd(s->listener), (struct sockaddr *)&ss, &sl) == 0)
        s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port : ((struct sockaddr_in *)&ss)->sin_port);
    return bind_backend(s);
}

void front_stop_accepting(srv *s) {
    if (s->listener) evconnlistener_free(s->listener);
    s->listener = NULL;
}

void front_free(srv *s) {
    while (s->conns) conn_close(s->conns);
    front_stop_accepting(s);
}
