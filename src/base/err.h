/* Error codes and the per-thread error message.
 * Library functions return 0 or a negative qf_status and leave a one-line message naming what is
 * wrong and where; only app/ decides to print it or exit. Cleanup functions (_free, _close,
 * _destroy) never call qf_fail, so a constructor may clean up after a failure and return rc. */
#ifndef QF_BASE_ERR_H
#define QF_BASE_ERR_H

enum qf_status {
    QF_OK = 0,
    QF_EINVAL = -1,      /* bad argument or request */
    QF_EIO = -2,         /* file missing, unreadable, short */
    QF_ENOMEM = -3,      /* allocation failed */
    QF_EFORMAT = -4,     /* corrupt or inconsistent file contents */
    QF_EUNSUPPORTED = -5, /* valid input we do not handle (e.g. another model_type) */
    QF_EBUSY = -6,        /* a bounded queue is full; try again later */
    QF_EDEVICE = -7       /* a device (GPU) operation failed */
};

/* Records the message for this thread and returns code, so callers write
 * `return qf_fail(QF_EIO, "cannot open %s", path);`. */
int qf_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *qf_last_error(void);
void qf_clear_error(void);

#endif

#ifndef QF_BASE_DIAG
# define QF_BASE_DIAG
/* A sink for "one line per problem" reports (qflash verify): checkers that find several problems
 * call it for each and still return the first error code. May be NULL. */
typedef void (*qf_diag_fn)(void *ud, const char *line);
typedef struct qf_diag {
    qf_diag_fn fn;
    void *ud;
    int count;
} qf_diag;
/* Reports the current qf_last_error() line to d (if any) and counts it. */
void qf_diag_report(qf_diag *d);
#endif
