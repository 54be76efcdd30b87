/* A fixed thread pool running one parallel-for at a time. The calling thread takes part, so a
 * pool of n threads starts n-1 workers. */
#ifndef QF_BASE_POOL_H
#define QF_BASE_POOL_H

typedef struct qf_pool qf_pool;

/* fn(ctx, i) runs for every i in [0, n_tasks); tasks are handed out dynamically. */
typedef void (*qf_task_fn)(void *ctx, int i);

qf_pool *qf_pool_create(int n_threads); /* NULL on failure */
void qf_pool_destroy(qf_pool *p);
int qf_pool_size(const qf_pool *p);
/* How long idle workers (and a caller waiting for them) spin before they sleep, microseconds
 * (0: the default, tens of microseconds). A pool whose parallel-fors come in bursts a fraction of
 * a millisecond apart (the host's experts of a decode step's layers) spins across the gaps, so
 * no run pays the sleeping threads' wake-up. */
void qf_pool_set_spin(qf_pool *p, int us);
/* Blocks until all tasks ran. p may be NULL (runs inline). */
void qf_pool_run(qf_pool *p, qf_task_fn fn, void *ctx, int n_tasks);
int qf_cpu_count(void);

#endif
