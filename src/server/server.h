/* qflash serve: an OpenAI-compatible HTTP server (libevent's evhttp, jansson) in front of the
 * continuous-batching scheduler. The HTTP side runs on one event-loop thread; the model runs on
 * the scheduler's thread; they meet only through qf_req channels and a wake-up event. */
#ifndef QF_SERVER_SERVER_H
#define QF_SERVER_SERVER_H

#include <stddef.h>

#include "runtime/engine.h"
#include "runtime/sched.h"

#define QF_SRV_MAX_DP 16

typedef struct qf_server_opts {
    const char *model_dir;
    const char *host;
    int port;
    const char *model_name;   /* id in /v1/models; default: the first served name, or the directory's name */
    const char *served_names; /* comma-separated names a request's model may give; NULL: the id alone */
    int metrics_auth;         /* /metrics needs the API key (default: public) */
    const char *api_key;      /* NULL: no auth */
    const char *chat_template; /* a Jinja file used instead of the model's template (NULL: the model's) */
    const char *template_kwargs; /* a JSON object of template variables every request starts from (the
                                    request's chat_template_kwargs win); NULL: none */
    size_t max_body;          /* bytes */
    int max_conns;            /* open connections; beyond them the longest-idle one closes, or 503 */
    double header_timeout;    /* seconds from a request's first byte to the end of its head */
    double body_timeout;      /* seconds from the end of a head to the end of its body */
    double idle_timeout;      /* seconds a kept-alive connection may wait for its next request */
    double shutdown_timeout;  /* seconds to let in-flight requests finish on SIGTERM */
    int verbose;
    qf_engine_opts engine;
    qf_sched_opts sched;
    /* replicas in this process (--dp N, at most QF_SRV_MAX_DP): an engine and a scheduler each,
     * on device cuda:i (--device cuda) or with the threads shared out (CPU); a request goes to
     * the one with the fewest running and waiting. 0 or 1: one. */
    int dp;
    void (*ready)(void *ud, int port); /* optional: called once the model is loaded */
    void *ready_ud;
} qf_server_opts;

/* Binds, loads the model in the background (/health answers 503 meanwhile), serves until
 * SIGINT/SIGTERM, drains, and returns QF_OK; an error when it cannot bind or load. */
int qf_server_run(const qf_server_opts *o);

#endif
