#ifndef QF_BASE_TIMER_H
#define QF_BASE_TIMER_H

#include <time.h>

/* Monotonic seconds. */
static inline double qf_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif
