#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "base/dtype.h"

int qt_failures, qt_checks;
const char *qt_root = ".";

void qt_init(int argc, char **argv) {
    if (argc > 1) qt_root = argv[1];
}

int qt_finish(void) {
    fprintf(stderr, "%d checks, %d failures\n", qt_checks, qt_failures);
    return qt_failures ? 1 : 0;
}

const char *qt_path(const char *rel) {
    static char bufs[8][4096];
    static int k;
    char *b = bufs[k++ % 8];
    snprintf(b, 4096, "%s/%s", qt_root, rel);
    return b;
}

static const qf_st_tensor *must(const qf_st_set *s, const char *name, int dtype) {
    const qf_st_tensor *t = qf_st_find(s, name);
    if (!t || t->dtype != dtype) {
        fprintf(stderr, "FATAL: reference tensor %s missing or not %s\n", name, qf_dtype_name(dtype));
        exit(2);
    }
    return t;
}

const float *qt_ref_f32(const qf_st_set *s, const char *name, int64_t *n, int64_t *rows) {
    const qf_st_tensor *t = must(s, name, QF_DT_F32);
    if (n) *n = t->n_elem;
    if (rows) *rows = t->shape[0];
    return t->data;
}

const int32_t *qt_ref_i32(const qf_st_set *s, const char *name, int64_t *n) {
    const qf_st_tensor *t = must(s, name, QF_DT_I32);
    if (n) *n = t->n_elem;
    return t->data;
}

double qt_max_abs_diff(const float *a, const float *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > m || d != d) m = d != d ? INFINITY : d;
    }
    return m;
}

double qt_rel_err(const float *a, const float *ref, size_t n) {
    double m = 1e-30, d = qt_max_abs_diff(a, ref, (int64_t)n);
    for (size_t i = 0; i < n; i++) m = fabs(ref[i]) > m ? fabs(ref[i]) : m;
    return d / m;
}

static uint64_t qt_rand_state = 0x1234567;

float qt_frand(void) {
    qt_rand_state = qt_rand_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((qt_rand_state >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

float *qt_rnd(size_t n, float scale) {
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; p && i < n; i++) p[i] = qt_frand() * scale;
    return p;
}

int qt_argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

int qt_run_capture(const char *cmd, char *out, size_t cap) {
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, cap - 1, p) : 0;
    out[n] = 0;
    int st = p ? pclose(p) : -1;
    return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
