/* sched_getaffinity: _GNU_SOURCE comes from the build */
#include "base/pool.h"

#include "base/timer.h"

#include <sched.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

/* Workers spin a short while on the work word before sleeping: a decode step issues hundreds of
 * short parallel-fors, and a futex wake-up per op would cost more than the op. The spin is short
 * (tens of microseconds) so that on a machine whose cores are busy with other work the workers
 * give their core back soon. */
#define SPIN_ROUNDS 2000

/* The work word: (run << 40) | (tasks << 20) | next task. A thread claims task i of the run by
 * incrementing it; the run's task count is in the same word, so a claim is valid or not by itself,
 * and the run's fn and ctx (published before the word) hold while any claimant is active: the
 * caller waits only for the threads that claimed, never for workers that are late or not
 * scheduled at all (which on a loaded machine made every op wait for a time slice). */
#define W_IDX_BITS 20
#define W_MASK ((1ull << W_IDX_BITS) - 1)

struct qf_pool {
    int n_threads;
    pthread_t *workers;
    pthread_mutex_t mu;
    pthread_cond_t start_cv, done_cv;
    atomic_ullong work;
    atomic_int active, sleeping, quit;
    atomic_int spin_us; /* qf_pool_set_spin's time; 0: SPIN_ROUNDS */
    qf_task_fn fn;
    void *ctx;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int claim(qf_pool *p) {
    unsigned long long w = atomic_fetch_add(&p->work, 1);
    int idx = (int)(w & W_MASK), n = (int)((w >> W_IDX_BITS) & W_MASK);
    return idx < n ? idx : -1;
}

static void drain(qf_pool *p) {
    for (int i; (i = claim(p)) >= 0;) p->fn(p->ctx, i);
}

static int has_work(qf_pool *p, unsigned long long run) {
    unsigned long long w = atomic_load(&p->work);
    return (w >> (2 * W_IDX_BITS)) != run && (w & W_MASK) < ((w >> W_IDX_BITS) & W_MASK);
}

/* A spin's start: its time limit (qf_pool_set_spin's), and the clock only when there is one (the
 * default spin is by rounds: a parallel-for's wait reads no clock). */
typedef struct spin {
    int us;
    double t0;
} spin;

static spin spin_start(qf_pool *p) {
    spin s = {atomic_load_explicit(&p->spin_us, memory_order_relaxed), 0.0};
    if (s.us > 0) s.t0 = qf_now();
    return s;
}

/* Whether the spin goes on at round i. */
static int spinning(const spin *s, int i) {
    if (s->us <= 0) return i < SPIN_ROUNDS;
    return (i & 255) || qf_now() - s->t0 < 1e-6 * s->us;
}

/* Until a run after `run` has tasks left (or quit). */
static unsigned long long wait_for_work(qf_pool *p, unsigned long long run) {
    spin sp = spin_start(p);
    for (int i = 0; spinning(&sp, i); i++) {
        if (has_work(p, run) || atomic_load(&p->quit)) return atomic_load(&p->work) >> (2 * W_IDX_BITS);
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleeping, 1);
    while (!has_work(p, run) && !atomic_load(&p->quit)) pthread_cond_wait(&p->start_cv, &p->mu);
    atomic_fetch_sub(&p->sleeping, 1);
    pthread_mutex_unlock(&p->mu);
    return atomic_load(&p->work) >> (2 * W_IDX_BITS);
}

static void *worker_main(void *arg) {
    qf_pool *p = arg;
    unsigned long long run = 0;
    for (;;) {
        run = wait_for_work(p, run);
        if (atomic_load(&p->quit)) break;
        atomic_fetch_add(&p->active, 1);
        drain(p);
        if (atomic_fetch_sub(&p->active, 1) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done_cv);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

qf_pool *qf_pool_create(int n_threads) {
    qf_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads < 1 ? 1 : n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->start_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    p->workers = calloc((size_t)p->n_threads, sizeof *p->workers);
    if (!p->workers) {
        qf_pool_destroy(p);
        return NULL;
    }
    for (int i = 1; i < p->n_threads; i++) {
        if (pthread_create(&p->workers[i], NULL, worker_main, p) != 0) {
            p->n_threads = i;
            qf_pool_destroy(p);
            return NULL;
        }
    }
    return p;
}

void qf_pool_destroy(qf_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->quit, 1);
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads && p->workers; i++) pthread_join(p->workers[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->start_cv);
    pthread_cond_destroy(&p->done_cv);
    free(p->workers);
    free(p);
}

int qf_pool_size(const qf_pool *p) { return p ? p->n_threads : 1; }

void qf_pool_set_spin(qf_pool *p, int us) {
    if (p) atomic_store(&p->spin_us, us > 0 ? us : 0);
}

/* Until no thread holds a claim of the last run. */
static void wait_idle(qf_pool *p) {
    spin sp = spin_start(p);
    for (int i = 0; spinning(&sp, i) && atomic_load(&p->active) > 0; i++) cpu_relax();
    if (atomic_load(&p->active) == 0) return;
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->active) > 0) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

void qf_pool_run(qf_pool *p, qf_task_fn fn, void *ctx, int n_tasks) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1 || (unsigned long long)n_tasks > W_MASK / 2) {
        for (int i = 0; i < n_tasks; i++) fn(ctx, i);
        return;
    }
    wait_idle(p); /* a late claimant of the last run leaves before fn and ctx change */
    p->fn = fn;
    p->ctx = ctx;
    unsigned long long run = (atomic_load(&p->work) >> (2 * W_IDX_BITS)) + 1;
    atomic_store(&p->work, (run << (2 * W_IDX_BITS)) | ((unsigned long long)n_tasks << W_IDX_BITS));
    if (atomic_load(&p->sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->start_cv);
        pthread_mutex_unlock(&p->mu);
    }
    drain(p);
    wait_idle(p);
}

/* The cores this process may run on (its affinity mask: a container's or taskset's share), not
 * every core of the machine. */
int qf_cpu_count(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}
