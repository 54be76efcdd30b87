/* Element types as stored in checkpoints. */
#ifndef QF_BASE_DTYPE_H
#define QF_BASE_DTYPE_H

#include <stddef.h>

enum qf_dtype {
    QF_DT_UNKNOWN = 0,
    QF_DT_F32,
    QF_DT_F16,
    QF_DT_BF16,
    QF_DT_F64,
    QF_DT_I64,
    QF_DT_I32,
    QF_DT_I16,
    QF_DT_I8,
    QF_DT_U8,
    QF_DT_BOOL,
    QF_DT_F8_E4M3, /* the OCP e4m3fn byte; a weight of it has 128 x 128 block scales (base/quant.h) */
    /* qflash's blocked weight formats (base/quant.h): stored in files as U8 rows of blocks, never
     * named in a safetensors header, so they have no per-element size */
    QF_DT_Q8_B32,
    QF_DT_Q4_B32,
    QF_DT_COUNT
};

/* Parses a safetensors dtype name ("BF16"); QF_DT_UNKNOWN when unknown (or a blocked format). */
int qf_dtype_parse(const char *s);
const char *qf_dtype_name(int dt);
size_t qf_dtype_size(int dt); /* 0 for the blocked formats */

#endif
