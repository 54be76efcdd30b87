/* Preparation workers: the part of a request that grows with its body (rendering the chat
 * template, tokenizing) runs here, off the event loop, so /health and every other client are
 * answered while a large prompt is being tokenized. Jobs go in a FIFO; a finished job goes to a
 * done list and the loop is woken (an event made active from this thread, which libevent allows
 * with its pthreads support). Only the loop touches the evhttp request. */
#include <event2/buffer.h>
#include <event2/http.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "server/server_int.h"

typedef struct job {
    struct evhttp_request *req;
    struct evbuffer *raw; /* the request body as it came */
    json_t *body;
    int what;
    atomic_int gone; /* the client left while the job waited or ran */
    api_out out;
    gen_req g;
    struct job *next;
} job;

struct prep {
    srv *s;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *head, *tail, *done;
    int stop, n_threads;
    pthread_t threads[8];
    struct event *finished;
};

/* The body as a JSON object, or a 400 naming what is wrong with it. */
static int parse_body(job *j) {
    size_t n = evbuffer_get_length(j->raw);
    const char *p = (const char *)evbuffer_pullup(j->raw, -1);
    json_error_t je;
    j->body = json_loadb(p ? p : "", n, JSON_REJECT_DUPLICATES, &je);
    if (!j->body)
        snprintf(j->out.msg, sizeof j->out.msg, "the body is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    else if (!json_is_object(j->body)) snprintf(j->out.msg, sizeof j->out.msg, "the body must be a JSON object");
    else return 0;
    j->out.code = 400;
    return -1;
}

static void run_job(srv *s, job *j) {
    j->out.code = 0;
    if (parse_body(j)) return;
    switch (j->what) {
    case PREP_CHAT: api_parse_chat(s, &j->out, j->body, &j->g); break;
    case PREP_COMPLETION: api_parse_completion(s, &j->out, j->body, &j->g, 0); break;
    case PREP_GENERATE: api_parse_completion(s, &j->out, j->body, &j->g, 1); break;
    case PREP_RESPONSES: api_parse_responses(s, &j->out, j->body, &j->g); break;
    case PREP_MESSAGES: api_parse_messages(s, &j->out, j->body, &j->g); break;
    case PREP_TOKENIZE: api_tokenize(s, &j->out, j->body); break;
    case PREP_COUNT_TOKENS: api_count_tokens(s, &j->out, j->body); break;
    default: api_detokenize(s, &j->out, j->body); break;
    }
    if (j->out.code == 200) { /* large replies (a long prompt's ids) are serialized here, not on the loop */
        j->out.text = json_dumps(j->out.body, JSON_COMPACT);
        j->out.text_len = j->out.text ? strlen(j->out.text) : 0;
    }
}

static void *worker(void *arg) {
    prep *p = arg;
    /* below the event loop and the scheduler: on a machine with few cores a long tokenization
     * must not take the loop's turn (Linux gives threads their own nice value) */
    (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10); /* lowering one's own priority needs no privilege */
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
        if (p->stop) break;
        job *j = p->head;
        p->head = j->next;
        if (!p->head) p->tail = NULL;
        pthread_mutex_unlock(&p->mu);
        if (!atomic_load(&j->gone)) run_job(p->s, j);
        pthread_mutex_lock(&p->mu);
        j->next = p->done;
        p->done = j;
        event_active(p->finished, EV_READ, 0);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* The client left: libevent detached the request (it is ours to free) and the job, wherever it is,
 * ends without a reply. */
static void on_gone(struct evhttp_connection *evcon, void *arg) {
    (void)evcon;
    job *j = arg;
    if (!evhttp_request_get_connection(j->req)) evhttp_request_free(j->req);
    atomic_store(&j->gone, 1);
}

static void job_free(job *j) {
    if (j->raw) evbuffer_free(j->raw);
    free(j->out.text);
    json_decref(j->body);
    json_decref(j->out.body);
    gen_req_clear(&j->g);
    free(j);
}

static const int k_call_kind[] = {CALL_CHAT, CALL_COMPLETION, CALL_GENERATE, CALL_CHAT, CALL_CHAT};

/* On the loop: the finished job's answer, or the call it starts. */
static void answer(srv *s, job *j) {
    struct evhttp_connection *evcon = evhttp_request_get_connection(j->req);
    if (evcon) evhttp_connection_set_closecb(evcon, NULL, NULL);
    if (j->out.code == 0 && j->what <= PREP_LAST_CALL && s->draining) { /* the signal came while it was prepared */
        srv_count(s, 503);
        evhttp_add_header(evhttp_request_get_output_headers(j->req), "Retry-After", "5");
        srv_send_error(j->req, 503, "unavailable_error", "the server is shutting down");
    } else if (j->out.code == 0 && j->what <= PREP_LAST_CALL) {
        call_start(s, j->req, &j->g, k_call_kind[j->what]);
    } else if (j->out.code == 200 && j->out.text) {
        srv_count(s, 200);
        srv_send_text(j->req, 200, j->out.text, j->out.text_len);
    } else {
        srv_count(s, j->out.code);
        srv_send_error_code(j->req, j->out.code, j->out.code < 500 ? "invalid_request_error" : "server_error", j->out.err_code, "%s", j->out.msg);
    }
}

static void on_finished(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    prep *p = arg;
    pthread_mutex_lock(&p->mu);
    job *list = p->done;
    p->done = NULL;
    pthread_mutex_unlock(&p->mu);
    while (list) {
        job *j = list;
        list = j->next;
        if (!atomic_load(&j->gone)) answer(p->s, j);
        job_free(j);
    }
}

int prep_create(srv *s, int n_workers) {
    prep *p = calloc(1, sizeof *p);
    if (!p) return qf_fail(QF_ENOMEM, "out of memory");
    p->s = s;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    s->prep = p;
    p->finished = event_new(s->base, -1, EV_PERSIST, on_finished, p);
    if (!p->finished) return qf_fail(QF_ENOMEM, "out of memory");
    for (; p->n_threads < n_workers && p->n_threads < (int)(sizeof p->threads / sizeof *p->threads); p->n_threads++)
        if (pthread_create(&p->threads[p->n_threads], NULL, worker, p) != 0) return qf_fail(QF_ENOMEM, "cannot start a preparation thread");
    return QF_OK;
}

void prep_submit(srv *s, struct evhttp_request *req, int what) {
    job *j = calloc(1, sizeof *j);
    if (j && !(j->raw = evbuffer_new())) free(j), j = NULL;
    if (!j) {
        srv_count(s, 500);
        srv_send_error(req, 500, "server_error", "out of memory");
        return;
    }
    evbuffer_add_buffer(j->raw, evhttp_request_get_input_buffer(req));
    j->req = req, j->what = what;
    evhttp_connection_set_closecb(evhttp_request_get_connection(req), on_gone, j);
    prep *p = s->prep;
    pthread_mutex_lock(&p->mu);
    if (p->tail) p->tail->next = j;
    else p->head = j;
    p->tail = j;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void prep_destroy(srv *s) {
    prep *p = s->prep;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    job *lists[2] = {p->head, p->done};
    for (int k = 0; k < 2; k++)
        for (job *j = lists[k], *next; j; j = next) {
            next = j->next;
            struct evhttp_connection *evcon = atomic_load(&j->gone) ? NULL : evhttp_request_get_connection(j->req);
            if (evcon) evhttp_connection_set_closecb(evcon, NULL, NULL);
            job_free(j);
        }
    if (p->finished) event_free(p->finished);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
    s->prep = NULL;
}
