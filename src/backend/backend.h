/* Choosing a backend: the one place that knows which ones exist. Code above src/backend opens
 * one by name and reaches it through its ops table (backend/ops.h). */
#ifndef QF_BACKEND_BACKEND_H
#define QF_BACKEND_BACKEND_H

#include <stddef.h>
#include <stdio.h>

#include "backend/ops.h"

/* The backends' tuning options as the layers above see them: assignments by name, checked and
 * documented by the backend that takes them (today the CUDA backend's; a CPU build still parses
 * them, so a command line is the same on every build). Made with the defaults and the diagnosis
 * variable QFLASH_CUDA_OPTS applied; one owner frees it. */
typedef struct qf_backend_opts qf_backend_opts;
int qf_backend_opts_create(qf_backend_opts **out); /* QF_EINVAL naming a malformed QFLASH_CUDA_OPTS */
void qf_backend_opts_free(qf_backend_opts *o);
/* "name=value" (--cuda-opt): QF_EINVAL naming the option or the value when either is wrong. */
int qf_backend_opts_set(qf_backend_opts *o, const char *assignment);
/* The prompt products' numerics (--precision): bf16x2, fp32 or bf16; QF_EINVAL for anything else. */
int qf_backend_opts_precision(qf_backend_opts *o, const char *name);
/* Every option with its default and doc (o NULL), or with its value in o. */
void qf_backend_opts_print(FILE *f, const qf_backend_opts *o);

/* "cpu" (the fastest CPU table this machine runs), "cuda" or "cuda:N" (GPU N). opts: the tuning
 * options (NULL: the defaults); pool: the CPU threads (may be NULL). QF_EINVAL for an unknown
 * name, QF_EUNSUPPORTED when the build or the machine has no such device. */
int qf_backend_open(qf_backend *be, const char *name, qf_pool *pool, const qf_backend_opts *opts);
void qf_backend_close(qf_backend *be);
/* 1 when the backend's memory is not host memory (weights must be moved there). */
int qf_backend_is_device(const qf_backend *be);
/* The device's name ("cpu" for the CPU) and its peak memory in use (0 on the CPU). */
const char *qf_backend_device_name(const qf_backend *be);
size_t qf_backend_peak_bytes(const qf_backend *be);
/* 1 when this build has the CUDA backend. */
int qf_backend_has_cuda(void);

#endif
