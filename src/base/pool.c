#include "base/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

/* Workers spin this many rounds on the generation counter before sleeping: a decode step issues
 * hundreds of short parallel-fors, and a futex wake-up per op would cost more than the op. */
#define SPIN_ROUNDS 20000

struct qf_pool {
    int n_threads;
    pthread_t *workers;
    pthread_mutex_t mu;
    pthread_cond_t start_cv, done_cv;
    atomic_ulong generation;
    atomic_int busy, quit;
    qf_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void drain(qf_pool *p) {
    for (;;) {
        int i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n_tasks) break;
        p->fn(p->ctx, i);
    }
}

static void wait_for_work(qf_pool *p, unsigned long seen) {
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        if (atomic_load(&p->generation) != seen || atomic_load(&p->quit)) return;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->generation) == seen && !atomic_load(&p->quit)) pthread_cond_wait(&p->start_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

static void *worker_main(void *arg) {
    qf_pool *p = arg;
    unsigned long seen = 0;
    for (;;) {
        wait_for_work(p, seen);
        if (atomic_load(&p->quit)) break;
        seen = atomic_load(&p->generation);
        drain(p);
        if (atomic_fetch_sub(&p->busy, 1) == 1) {
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

void qf_pool_run(qf_pool *p, qf_task_fn fn, void *ctx, int n_tasks) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int i = 0; i < n_tasks; i++) fn(ctx, i);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    atomic_store(&p->busy, p->n_threads - 1);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    drain(p);
    for (int i = 0; i < SPIN_ROUNDS && atomic_load(&p->busy) > 0; i++) cpu_relax();
    if (atomic_load(&p->busy) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->busy) > 0) pthread_cond_wait(&p->done_cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

int qf_cpu_count(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}
