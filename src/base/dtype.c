#include "base/dtype.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} k_dtypes[QF_DT_COUNT] = {
    [QF_DT_UNKNOWN] = {"?", 0}, [QF_DT_F32] = {"F32", 4}, [QF_DT_F16] = {"F16", 2},
    [QF_DT_BF16] = {"BF16", 2}, [QF_DT_F64] = {"F64", 8}, [QF_DT_I64] = {"I64", 8},
    [QF_DT_I32] = {"I32", 4},   [QF_DT_I16] = {"I16", 2}, [QF_DT_I8] = {"I8", 1},
    [QF_DT_U8] = {"U8", 1},     [QF_DT_BOOL] = {"BOOL", 1}, [QF_DT_F8_E4M3] = {"F8_E4M3", 1},
    [QF_DT_Q8_B32] = {"Q8_B32", 0}, [QF_DT_Q4_B32] = {"Q4_B32", 0},
};

int qf_dtype_parse(const char *s) {
    for (int i = 1; i < QF_DT_COUNT; i++)
        if (k_dtypes[i].size && strcmp(s, k_dtypes[i].name) == 0) return i;
    return QF_DT_UNKNOWN;
}

const char *qf_dtype_name(int dt) { return dt > 0 && dt < QF_DT_COUNT ? k_dtypes[dt].name : "?"; }

size_t qf_dtype_size(int dt) { return dt > 0 && dt < QF_DT_COUNT ? k_dtypes[dt].size : 0; }
