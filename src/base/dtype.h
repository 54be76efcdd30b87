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
    QF_DT_COUNT
};

/* Parses a safetensors dtype name ("BF16"); QF_DT_UNKNOWN when unknown. */
int qf_dtype_parse(const char *s);
const char *qf_dtype_name(int dt);
size_t qf_dtype_size(int dt);

#endif
