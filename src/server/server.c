/* The event loop: binding, routing, auth, errors, loading in the background, and the drain on
 * SIGINT/SIGTERM. */
#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/mapfile.h"
#include "base/timer.h"
#include "base/utf8.h"
#include "base/pool.h"
#include "server/server_int.h"

/* ---- loading ---- */

static int s_n(const qf_server_opts *o) { return o->dp > 1 ? o->dp : 1; }

/* Replica i's engine options: device cuda:i (a GPU each), or its share of the threads. */
static qf_engine_opts replica_opts(const qf_server_opts *o, int i, char *dev, size_t cap) {
    qf_engine_opts eo = o->engine;
    if (s_n(o) < 2) return eo;
    if (eo.device && strncmp(eo.device, "cuda", 4) == 0) {
        snprintf(dev, cap, "cuda:%d", i);
        eo.device = dev;
    } else {
        int all = eo.n_threads > 0 ? eo.n_threads : qf_cpu_count(), n = s_n(o), share = all / n + (i < all % n);
        eo.n_threads = share > 0 ? share : 1;
    }
    return eo;
}

/* The replicas after the first: the same model, their own engine and scheduler each. */
static int open_replicas(srv *s) {
    const qf_server_opts *o = s->o;
    s->ex[0] = s->e, s->sx[0] = s->sched, s->n_dp = 1;
    for (int i = 1; i < s_n(o); i++) {
        char dev[32];
        qf_engine_opts eo = replica_opts(o, i, dev, sizeof dev);
        int rc = qf_engine_open(&s->ex[i], o->model_dir, &eo);
        if (rc == QF_OK) rc = qf_sched_create(&s->sx[i], s->ex[i], &o->sched);
        if (rc != QF_OK) return qf_fail(rc, "replica %d: %s", i, qf_last_error());
        s->n_dp = i + 1;
    }
    return QF_OK;
}

static void *load_main(void *arg) {
    srv *s = arg;
    const qf_server_opts *o = s->o;
    char dev0[32];
    qf_engine_opts eo0 = replica_opts(o, 0, dev0, sizeof dev0);
    int rc = qf_engine_open(&s->e, o->model_dir, &eo0);
    if (rc == QF_OK && !s->e->tok) rc = qf_fail(QF_EINVAL, "%s has no tokenizer.json; the server needs one", o->model_dir);
    if (rc == QF_OK) s->max_piece = qf_tok_max_piece_len(s->e->tok);
    char *own = NULL;
    if (rc == QF_OK && o->chat_template) rc = qf_read_file(o->chat_template, &own, NULL);
    const char *tmpl = own ? own : rc == QF_OK ? qf_tok_chat_template(s->e->tok) : NULL;
    if (tmpl) {
        rc = qf_chat_tmpl_parse(&s->tmpl, tmpl);
        qf_chat_tmpl_tokens(&s->tmpl, qf_tok_bos_text(s->e->tok), qf_tok_eos_text(s->e->tok));
        s->has_tmpl = rc == QF_OK;
        s->tool_form = strstr(tmpl, "<function=") ? QF_TOOLS_XML : QF_TOOLS_JSON;
    }
    free(own);
    if (rc == QF_OK) qf_plan_print(stderr, &s->e->plan);
    if (rc == QF_OK) rc = qf_sched_create(&s->sched, s->e, &o->sched);
    if (rc == QF_OK) rc = open_replicas(s);
    if (rc != QF_OK) {
        fprintf(stderr, "error: %s\n", qf_last_error());
        atomic_store(&s->load_failed, 1);
    }
    event_active(s->loaded, EV_READ, 0);
    return NULL;
}

static void on_loaded(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    srv *s = arg;
    if (atomic_load(&s->load_failed)) {
        s->exit_rc = QF_EIO;
        event_base_loopexit(s->base, NULL);
        return;
    }
    atomic_store(&s->ready, 1);
    const qf_expert_stats *es = qf_engine_expert_stats(s->e);
    if (es && es->slots)
        fprintf(stderr, "qflash serve: expert cache: %d of %d experts a layer and a scratch slot, %.1f MiB\n", es->slots, qf_engine_config(s->e)->n_experts,
                (double)es->pool_bytes / 1048576.0);
    fprintf(stderr, "qflash serve: model loaded in %.2f s; listening on http://%s:%d\n", s->e->load_seconds, s->o->host, s->port);
    if (s->o->ready) s->o->ready(s->o->ready_ud, s->port);
}

/* Leaves the loop a moment later, so the last replies reach their clients. */
static void exit_soon(srv *s) {
    struct timeval tv = {0, 200000};
    event_base_loopexit(s->base, &tv);
}

static void on_wake(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    srv *s = arg;
    calls_pump(s);
    if (s->draining && s->n_calls == 0) exit_soon(s);
}

/* ---- shutdown ---- */

static void on_drain_timer(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    srv *s = arg;
    if (s->n_calls > 0 && qf_now() >= s->drain_deadline) {
        fprintf(stderr, "qflash serve: cancelling %d requests still running\n", s->n_calls);
        calls_cancel_all(s);
    }
    if (s->n_calls == 0) exit_soon(s);
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    (void)what;
    srv *s = arg;
    if (s->draining) {
        fprintf(stderr, "qflash serve: second signal, stopping now\n");
        calls_cancel_all(s);
        event_base_loopexit(s->base, NULL);
        return;
    }
    s->draining = 1;
    s->drain_deadline = qf_now() + s->o->shutdown_timeout;
    fprintf(stderr, "qflash serve: signal %d: no new requests; waiting up to %.0f s for %d in flight\n", (int)sig, s->o->shutdown_timeout, s->n_calls);
    front_stop_accepting(s);
    struct timeval tv = {0, 100000};
    event_add(s->drain_timer, &tv);
    if (s->n_calls == 0) exit_soon(s);
}

/* ---- routing ---- */

/* Authorization: Bearer KEY, or x-api-key: KEY (Anthropic's clients). */
static int authorized(srv *s, struct evhttp_request *req) {
    if (!s->o->api_key || !*s->o->api_key) return 1;
    const char *h = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
    const char *x = evhttp_find_header(evhttp_request_get_input_headers(req), "x-api-key");
    if ((!h || strncmp(h, "Bearer ", 7) != 0) && !x) return 0;
    const char *k = h && !strncmp(h, "Bearer ", 7) ? h + 7 : x, *want = s->o->api_key;
    size_t n = strlen(want), m = strlen(k);
    unsigned diff = (unsigned)(n ^ m); /* constant time over the key's length */
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)want[i] ^ (unsigned char)(i < m ? k[i] : 0);
    return diff == 0;
}

int srv_model_known(const srv *s, const char *name) {
    if (!strcmp(name, s->model_name)) return 1;
    size_t n = strlen(name);
    for (const char *p = s->o->served_names; p && *p;) {
        size_t k = strcspn(p, ",");
        if (k == n && !memcmp(p, name, n)) return 1;
        p += k + (p[k] == ',');
    }
    return 0;
}

typedef struct route {
    const char *path;
    int method; /* EVHTTP_REQ_* */
    int needs_model, needs_auth;
    int id;
} route;

enum { R_CHAT, R_COMPL, R_GENERATE, R_RESPONSES, R_MESSAGES, R_COUNT_TOKENS, R_MODELS, R_MODEL, R_HEALTH, R_READY, R_METRICS, R_TOKENIZE, R_DETOKENIZE, R_WEBUI };

static const route MODEL_ROUTE = {"/v1/models/", EVHTTP_REQ_GET, 0, 1, R_MODEL}; /* /v1/models/{id} */
static const route ROUTES[] = {
    {"/v1/chat/completions", EVHTTP_REQ_POST, 1, 1, R_CHAT},
    {"/v1/completions", EVHTTP_REQ_POST, 1, 1, R_COMPL},
    {"/generate", EVHTTP_REQ_POST, 1, 1, R_GENERATE},
    {"/v1/responses", EVHTTP_REQ_POST, 1, 1, R_RESPONSES},
    {"/v1/messages", EVHTTP_REQ_POST, 1, 1, R_MESSAGES},
    {"/v1/messages/count_tokens", EVHTTP_REQ_POST, 1, 1, R_COUNT_TOKENS},
    {"/v1/models", EVHTTP_REQ_GET, 0, 1, R_MODELS},
    {"/health", EVHTTP_REQ_GET, 0, 0, R_HEALTH},
    {"/ready", EVHTTP_REQ_GET, 0, 0, R_READY},
    {"/metrics", EVHTTP_REQ_GET, 0, 1, R_METRICS},
    {"/tokenize", EVHTTP_REQ_POST, 1, 1, R_TOKENIZE},
    {"/detokenize", EVHTTP_REQ_POST, 1, 1, R_DETOKENIZE},
    {"/", EVHTTP_REQ_GET, 0, 0, R_WEBUI},
    {"/index.html", EVHTTP_REQ_GET, 0, 0, R_WEBUI},
};

/* The body goes to the preparation workers as it came (they parse it). */
static void dispatch_body(srv *s, struct evhttp_request *req, int id) {
    int what = id == R_CHAT ? PREP_CHAT : id == R_COMPL ? PREP_COMPLETION : id == R_GENERATE ? PREP_GENERATE : id == R_RESPONSES ? PREP_RESPONSES
             : id == R_MESSAGES ? PREP_MESSAGES : id == R_TOKENIZE ? PREP_TOKENIZE : id == R_COUNT_TOKENS ? PREP_COUNT_TOKENS : PREP_DETOKENIZE;
    prep_submit(s, req, what);
}

static void handle(struct evhttp_request *req, void *arg) {
    srv *s = arg;
    char path[512];
    const char *uri = evhttp_request_get_uri(req);
    size_t n = strcspn(uri, "?#");
    snprintf(path, sizeof path, "%.*s", (int)(n < sizeof path ? n : sizeof path - 1), uri);
    const char *refused = evhttp_find_header(evhttp_request_get_input_headers(req), FRONT_STATUS);
    if (refused && strcmp(path, FRONT_PATH) == 0) { /* a request the front would not pass on */
        int code = atoi(refused);
        code = code >= 400 && code < 600 ? code : 400;
        const char *why = evhttp_find_header(evhttp_request_get_input_headers(req), FRONT_REASON);
        srv_count(s, code);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
        if (code == 503) evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", "1");
        srv_send_error(req, code, code == 503 ? "unavailable_error" : "invalid_request_error", "%s", why ? why : "malformed request");
        return;
    }
    const route *rt = NULL;
    for (size_t i = 0; i < sizeof ROUTES / sizeof *ROUTES; i++)
        if (strcmp(ROUTES[i].path, path) == 0) rt = &ROUTES[i];
    if (!rt && !strncmp(path, MODEL_ROUTE.path, strlen(MODEL_ROUTE.path)) && path[strlen(MODEL_ROUTE.path)]) rt = &MODEL_ROUTE;
    int method = (int)evhttp_request_get_command(req);
    if (!rt) {
        srv_count(s, 404);
        srv_send_error(req, 404, "not_found_error", "no such endpoint: %s", path);
    } else if (method != rt->method && !(method == EVHTTP_REQ_HEAD && rt->method == EVHTTP_REQ_GET)) {
        srv_count(s, 405);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", rt->method == EVHTTP_REQ_GET ? "GET, HEAD" : "POST");
        srv_send_error(req, 405, "invalid_request_error", "%s accepts %s only", path, rt->method == EVHTTP_REQ_GET ? "GET" : "POST");
    } else if (rt->needs_auth && (rt->id != R_METRICS || s->o->metrics_auth) && !authorized(s, req)) {
        srv_count(s, 401);
        evhttp_add_header(evhttp_request_get_output_headers(req), "WWW-Authenticate", "Bearer");
        srv_send_error(req, 401, "authentication_error", "missing or wrong API key (send Authorization: Bearer KEY)");
    } else if (s->draining && rt->needs_model) {
        srv_count(s, 503);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", "5");
        srv_send_error(req, 503, "unavailable_error", "the server is shutting down");
    } else if (rt->id == R_READY) {
        ep_ready(s, req);
    } else if ((rt->needs_model || rt->id == R_HEALTH) && !atomic_load(&s->ready)) {
        srv_count(s, 503);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", "1");
        srv_send_error(req, 503, "unavailable_error", "Loading model");
    } else if (rt->id == R_HEALTH) {
        srv_count(s, 200);
        srv_send_json(req, 200, json_pack("{s:s}", "status", "ok"));
    } else if (rt->id == R_MODELS) {
        ep_models(s, req);
    } else if (rt->id == R_MODEL) {
        ep_model(s, req, path + strlen(MODEL_ROUTE.path));
    } else if (rt->id == R_METRICS) {
        ep_metrics(s, req);
    } else if (rt->id == R_WEBUI) {
        ep_webui(s, req);
    } else {
        dispatch_body(s, req, rt->id);
    }
}

/* ---- setup ---- */

/* A connection in use holds three descriptors (the client's, and both ends of its local socket to
 * evhttp): the soft limit is raised to the hard one, and a cap the limit cannot hold is said. */
static void raise_fd_limit(const qf_server_opts *o) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    rlim_t need = (rlim_t)o->max_conns * 3 + 64;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < need)
        fprintf(stderr, "qflash serve: --max-conns %d may need %llu file descriptors; the limit is %llu (beyond it new connections wait)\n",
                o->max_conns, (unsigned long long)need, (unsigned long long)rl.rlim_cur);
}

static int start(srv *s) {
    const qf_server_opts *o = s->o;
    raise_fd_limit(o);
    if (evthread_use_pthreads() != 0) return qf_fail(QF_ENOMEM, "libevent has no pthreads support");
    s->base = event_base_new();
    s->http = s->base ? evhttp_new(s->base) : NULL;
    if (!s->http) return qf_fail(QF_ENOMEM, "cannot create the event loop");
    evhttp_set_max_body_size(s->http, (ev_ssize_t)o->max_body);
    evhttp_set_max_headers_size(s->http, 64 * 1024);
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD | EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                            EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PATCH);
    evhttp_set_timeout(s->http, 3600 * 24); /* on the internal socket: the deadlines are the front's (front.c) */
    evhttp_set_gencb(s->http, handle, s);
    int rc = front_start(s);
    if (rc != QF_OK) return rc;
    s->wake = event_new(s->base, -1, EV_PERSIST, on_wake, s);
    s->loaded = event_new(s->base, -1, 0, on_loaded, s);
    s->drain_timer = event_new(s->base, -1, EV_PERSIST, on_drain_timer, s);
    s->sigint = evsignal_new(s->base, SIGINT, on_signal, s);
    s->sigterm = evsignal_new(s->base, SIGTERM, on_signal, s);
    if (!s->wake || !s->loaded || !s->drain_timer || !s->sigint || !s->sigterm) return qf_fail(QF_ENOMEM, "out of memory");
    rc = prep_create(s, 2);
    if (rc != QF_OK) return rc;
    event_add(s->sigint, NULL);
    event_add(s->sigterm, NULL);
    return QF_OK;
}

static void stop(srv *s) {
    for (int i = 1; i < s->n_dp; i++) qf_sched_destroy(s->sx[i]);
    if (s->sched) qf_sched_destroy(s->sched); /* cancels what is left; no notify can fire after this */
    s->sched = NULL;
    prep_destroy(s);                          /* requests still being prepared are dropped */
    calls_pump(s);                            /* ends the replies of those cancelled calls */
    front_free(s);                            /* closes the clients' connections */
    if (s->http) evhttp_free(s->http);        /* closes connections; close callbacks free calls */
    qf_chat_tmpl_free(&s->tmpl);
    json_decref(s->template_kwargs);
    for (int i = 1; i < s->n_dp; i++) qf_engine_close(s->ex[i]);
    qf_engine_close(s->e);
    struct event *evs[] = {s->wake, s->loaded, s->drain_timer, s->sigint, s->sigterm, s->accept_pause};
    for (size_t i = 0; i < sizeof evs / sizeof *evs; i++)
        if (evs[i]) event_free(evs[i]);
    if (s->base) event_base_free(s->base);
}

static int parse_template_kwargs(srv *s) {
    if (!s->o->template_kwargs) return QF_OK;
    json_error_t err;
    s->template_kwargs = json_loads(s->o->template_kwargs, 0, &err);
    if (!s->template_kwargs) return qf_fail(QF_EINVAL, "--default-chat-template-kwargs: %s at character %d", err.text, err.position);
    if (!json_is_object(s->template_kwargs)) return qf_fail(QF_EINVAL, "--default-chat-template-kwargs must be a JSON object");
    return QF_OK;
}

int qf_server_run(const qf_server_opts *o) {
    srv s;
    memset(&s, 0, sizeof s);
    s.o = o;
    const char *name = o->model_name;
    size_t first = o->served_names ? strcspn(o->served_names, ",") : 0;
    if (name) snprintf(s.model_name, sizeof s.model_name, "%s", name);
    else if (first) snprintf(s.model_name, sizeof s.model_name, "%.*s", (int)first, o->served_names);
    else {
        const char *slash = strrchr(o->model_dir, '/');
        snprintf(s.model_name, sizeof s.model_name, "%s", slash && slash[1] ? slash + 1 : o->model_dir);
    }
    signal(SIGPIPE, SIG_IGN);
    int rc = parse_template_kwargs(&s);
    if (rc == QF_OK) rc = start(&s);
    pthread_t loader;
    int loading = 0;
    if (rc == QF_OK) {
        fprintf(stderr, "qflash serve: bound to %s:%d; loading %s\n", o->host, s.port, o->model_dir);
        loading = pthread_create(&loader, NULL, load_main, &s) == 0;
        if (!loading) rc = qf_fail(QF_ENOMEM, "cannot start the loader thread");
    }
    if (rc == QF_OK) {
        event_base_dispatch(s.base);
        rc = s.exit_rc;
        if (rc != QF_OK) qf_fail(rc, "the model did not load");
    }
    if (loading) pthread_join(loader, NULL); /* a signal during loading waits for it to end */
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", qf_last_error());
    stop(&s);
    if (rc != QF_OK) qf_fail(rc, "%s", saved);
    else fprintf(stderr, "qflash serve: stopped\n");
    return rc;
}
