/* Internals shared by the server's files. Everything here runs on the event-loop thread except
 * call_notify, which the scheduler thread calls. */
#ifndef QF_SERVER_SRV_INT_H
#define QF_SERVER_SRV_INT_H

#include <event2/event.h>
#include <event2/listener.h>
#include <sys/socket.h>
#include <event2/http.h>
#include <jansson.h>
#include <stdatomic.h>

#include "server/server.h"
#include "grammar/json.h"
#include "server/think.h"
#include "tokenizer/chat.h"

enum call_kind { CALL_CHAT, CALL_COMPLETION, CALL_GENERATE };
#define QF_MAX_CHOICES 16 /* n */
struct group;
/* The wire format of a chat call: OpenAI chat completions, OpenAI Responses, Anthropic Messages. */
enum call_api { API_CHAT, API_RESPONSES, API_MESSAGES };

/* A Responses or Messages reply being streamed (dialect.c). */
typedef struct dialect_state {
    int seq;          /* Responses: the next event's sequence_number */
    int open;         /* the open output item / content block: -1 none, 0 text, 1 reasoning */
    int index;        /* the next item / block index */
    char *all_c, *all_r; /* everything sent, for the final object */
    size_t len_c, cap_c, len_r, cap_r;
    size_t block_at;  /* where the open block's text starts in all_c / all_r */
    json_t *calls;    /* the tool calls sent (OpenAI form) */
} dialect_state;

typedef struct srv srv;
typedef struct prep prep;

/* One generation request in flight, from submit to the last byte sent (or the client leaving). */
typedef struct call {
    srv *s;
    qf_sched *sched; /* the replica running it */
    struct evhttp_request *http; /* NULL once the client is gone or the reply has ended */
    qf_req *r;
    int kind, stream, include_usage, logprobs;
    char id[64];
    long long created;
    think_split think;
    /* non-streamed replies accumulate here */
    char *acc_c, *acc_r;
    size_t len_c, cap_c, len_r, cap_r;
    json_t *lp;                  /* logprobs entries (chat: content array; completion: object) */
    json_t *tools;               /* the request's tools when the reply may call them (else NULL) */
    size_t sent_c;               /* a stream with tools: content bytes of acc_c sent (the rest may be a call) */
    int tool_called;             /* the stream sent tool_calls */
    int api;                     /* enum call_api */
    json_t *orig;                /* a Responses request's body (echoed in its reply) */
    int index;                   /* n > 1: this choice's index in the shared reply */
    int done;                    /* n > 1: this choice has ended (its group's reply may not have) */
    struct group *grp;           /* n > 1: the choices of one request (NULL: a single one) */
    dialect_state dl;
    long long lp_offset;         /* completions logprobs: characters of text before the next token */
    int n_prompt;                /* prompt tokens (known before the first poll) */
    struct call *prev, *next;
} call;

struct srv {
    const qf_server_opts *o;
    struct event_base *base;
    struct evhttp *http;
    struct evhttp_bound_socket *sock;
    struct event *wake, *loaded, *sigint, *sigterm, *drain_timer;
    atomic_int ready, load_failed;
    qf_engine *e;     /* replica 0's: the tokenizer and template every replica shares */
    qf_sched *sched;  /* replica 0's */
    qf_engine *ex[QF_SRV_MAX_DP];
    qf_sched *sx[QF_SRV_MAX_DP];
    int n_dp;
    qf_chat_tmpl tmpl;
    int has_tmpl;
    json_t *template_kwargs;   /* --default-chat-template-kwargs, parsed (NULL: none) */
    int tool_form;             /* QF_TOOLS_XML when the template teaches <function=...>, else QF_TOOLS_JSON */
    char model_name[256];
    int port; /* the bound port (o->port may be 0: any free port) */
    int draining;
    double drain_deadline;
    call *calls;
    int n_calls;
    uint64_t http_requests[6]; /* 2xx 4xx(400) 401 404 413/405 5xx: see server.c */
    int exit_rc;
    size_t max_piece;          /* bytes of the tokenizer's longest token */
    prep *prep;                /* the preparation workers (prep.c) */
    struct conn *conns;        /* every client connection (front.c) */
    int n_conns;
    struct evconnlistener *listener; /* the public socket; evhttp serves s->sock, a local one */
    struct sockaddr_storage backend_addr;
    socklen_t backend_len;
    struct event *accept_pause;
    double accept_logged;
};

/* front.c: the strict front of every connection (framing, half-close, deadlines, the cap). A
 * request it refuses reaches the handler as a POST to FRONT_PATH with the status and reason in
 * these headers; the handler answers it as a JSON error and the connection closes. */
#define FRONT_PATH "/.qflash-front"
#define FRONT_STATUS "X-Qflash-Status"
#define FRONT_REASON "X-Qflash-Reason"
int front_start(srv *s);           /* binds the public and the internal sockets */
void front_stop_accepting(srv *s); /* the public socket closes (shutdown) */
void front_free(srv *s);           /* every client connection closes */

/* reply.c */
void srv_send_json(struct evhttp_request *req, int code, json_t *body); /* steals body */
void srv_send_text(struct evhttp_request *req, int code, const char *json, size_t len); /* a serialized JSON body */
void srv_send_error(struct evhttp_request *req, int code, const char *type, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* the same with OpenAI's error code (model_not_found; NULL: none) */
void srv_send_error_code(struct evhttp_request *req, int code, const char *type, const char *ecode, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
void srv_count(srv *s, int code);
/* Text as a JSON string, invalid UTF-8 replaced by U+FFFD (a reply never fails on a cut character). */
json_t *jstr_lossy(const char *p, size_t n);
/* Appends n bytes to a growing NUL-terminated buffer (on OOM the text is dropped, not the server). */
void acc_add(char **buf, size_t *len, size_t *cap, const char *p, size_t n);
/* Whether a request's model name is served (the id or one of --served-model-name). */
int srv_model_known(const srv *s, const char *name);
/* The replica a new request goes to: the fewest running and waiting (the first on ties). */
qf_sched *srv_pick(srv *s);
/* Every replica's scheduler statistics summed. */
void srv_stats(srv *s, qf_sched_stats *out);

/* api.c: request bodies to scheduler parameters, on the preparation workers. The answer: code 0
 * (parsed, go on), 200 with body (tokenize), or an error code with its message. */
typedef struct api_out {
    int code;
    const char *err_code;       /* the error's OpenAI code (model_not_found), or NULL */
    json_t *body;
    char msg[768];
    char *text; /* body serialized by the worker */
    size_t text_len;
} api_out;
typedef struct gen_req {
    qf_req_params p;
    int32_t *prompt;            /* heap */
    int stream, include_usage, logprobs_on, top_logprobs, think_prompt;
    int tokenize_only;          /* /tokenize: no limit from the context */
    json_t *tools;              /* tools the reply may call (a reference; NULL: none, or tool_choice none) */
    int api;                    /* enum call_api */
    int n;                      /* choices */
    json_t *xbody, *orig;       /* Responses / Messages: the translated chat body, and the request's own */
    int32_t *stop_ids, *bias_ids; /* heap: stop_token_ids, logit_bias */
    float *bias;
    long long think_budget;     /* thinking_budget / max_thinking_tokens; -1: none given */
} gen_req;
/* 400 with the message (ao->msg); returns -1. */
int api_bad(api_out *ao, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Each returns 0, or -1 with ao->code 400 and the message naming the field. */
int api_parse_chat(srv *s, api_out *ao, json_t *body, gen_req *g);
int api_parse_completion(srv *s, api_out *ao, json_t *body, gen_req *g, int native);
void gen_req_clear(gen_req *g);
/* api_compat.c: /v1/responses and /v1/messages bodies, translated to a chat body and parsed. */
int api_parse_responses(srv *s, api_out *ao, json_t *body, gen_req *g);
int api_parse_messages(srv *s, api_out *ao, json_t *body, gen_req *g);
/* POST /v1/messages/count_tokens: {"input_tokens": N} of a Messages body (max_tokens not needed) */
void api_count_tokens(srv *s, api_out *ao, json_t *body);
/* POST /tokenize and /detokenize */
void api_tokenize(srv *s, api_out *ao, json_t *body);
void api_detokenize(srv *s, api_out *ao, json_t *body);

/* prep.c: a request's body is parsed, rendered and tokenized on one of a few worker threads, so
 * no request's preprocessing holds the event loop; the loop is woken to answer or start the call.
 * route: the server.c route id, kind: the call kind for generation routes. */
enum { PREP_CHAT, PREP_COMPLETION, PREP_GENERATE, PREP_RESPONSES, PREP_MESSAGES, PREP_TOKENIZE, PREP_DETOKENIZE, PREP_COUNT_TOKENS };
#define PREP_LAST_CALL PREP_MESSAGES /* the kinds up to here start a call */
int prep_create(srv *s, int n_workers);
void prep_submit(srv *s, struct evhttp_request *req, int what); /* takes the request's body */
void prep_destroy(srv *s); /* joins the workers; queued requests are dropped with their connections */

/* call.c */
void call_start(srv *s, struct evhttp_request *req, gen_req *g, int kind);
void call_notify(void *ud);      /* scheduler thread */
void calls_pump(srv *s);          /* event thread: drain every call's output */
void calls_cancel_all(srv *s);

/* dialect.c: Responses and Messages replies (c->api != API_CHAT) */
void dl_stream_begin(call *c);
void dl_stream_text(call *c, int reasoning, const char *p, size_t n);
void dl_stream_calls(call *c, json_t *calls); /* OpenAI-form tool calls */
void dl_stream_end(call *c, const qf_req_status *st);
void dl_reply_whole(call *c, const qf_req_status *st, const char *content, size_t clen, json_t *calls);
void dl_free(call *c);

/* endpoints.c */
void ep_models(srv *s, struct evhttp_request *req);
void ep_model(srv *s, struct evhttp_request *req, const char *escaped_id); /* GET /v1/models/{id} */
void ep_metrics(srv *s, struct evhttp_request *req);
void ep_ready(srv *s, struct evhttp_request *req);
void ep_webui(srv *s, struct evhttp_request *req);

#endif
