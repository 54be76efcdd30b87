/* A minimal assertion layer for the CTest executables: CHECK records a failure and goes on;
 * main returns qt_finish(), non-zero when anything failed. */
#ifndef QF_TEST_UTIL_H
#define QF_TEST_UTIL_H

#include <stdint.h>
#include <stdio.h>

#include "format/safetensors.h"

extern int qt_failures, qt_checks;
extern const char *qt_root; /* repository root, argv[1] */

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        qt_checks++;                                                       \
        if (!(cond)) {                                                     \
            qt_failures++;                                                 \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
        }                                                                  \
    } while (0)

void qt_init(int argc, char **argv);
int qt_finish(void);
/* root-relative path in a static rotating buffer */
const char *qt_path(const char *rel);
/* Reference tensors: pointer into the mapped file, with element count; aborts the test on
 * absence (a missing reference is a broken test, not a skipped one). */
const float *qt_ref_f32(const qf_st_set *s, const char *name, int64_t *n, int64_t *rows);
const int32_t *qt_ref_i32(const qf_st_set *s, const char *name, int64_t *n);
double qt_max_abs_diff(const float *a, const float *b, int64_t n);
/* Largest difference relative to the largest reference magnitude (NaN: infinite). */
double qt_rel_err(const float *a, const float *ref, size_t n);
/* Uniform in [-1, 1) from one fixed-seed stream per test process; qt_rnd: n of them times scale,
 * in a heap array the caller frees. */
float qt_frand(void);
float *qt_rnd(size_t n, float scale);
int qt_argmax(const float *x, int n);
/* Runs a shell command, captures its stdout into out (NUL-terminated); returns the exit status
 * (-1 when it did not exit normally). */
int qt_run_capture(const char *cmd, char *out, size_t cap);

#endif
