#include "base/err.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char g_msg[1024];

int qf_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_msg, sizeof g_msg, fmt, ap);
    va_end(ap);
    return code;
}

const char *qf_last_error(void) { return g_msg[0] ? g_msg : "no error"; }

void qf_clear_error(void) { g_msg[0] = 0; }

void qf_diag_report(qf_diag *d) {
    if (!d) return;
    d->count++;
    if (d->fn) d->fn(d->ud, qf_last_error());
}
