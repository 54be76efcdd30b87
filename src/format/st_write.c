#include "format/st_write.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

int qf_st_write_header(FILE *f, const char *path, const qf_st_entry *e, int n) {
    json_t *h = json_object();
    json_object_set_new(h, "__metadata__", json_pack("{s:s}", "format", "pt"));
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        json_t *shape = json_array();
        for (int d = 0; d < e[i].ndim; d++) json_array_append_new(shape, json_integer(e[i].shape[d]));
        json_object_set_new(h, e[i].name, json_pack("{s:s,s:o,s:[I,I]}", "dtype", e[i].dtype, "shape", shape, "data_offsets", (json_int_t)at,
                                                    (json_int_t)(at + e[i].nbytes)));
        at += e[i].nbytes;
    }
    char *text = json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(h);
    size_t len = text ? strlen(text) : 0, pad = (8 - len % 8) % 8;
    uint64_t hl = len + pad;
    unsigned char le[8];
    for (int i = 0; i < 8; i++) le[i] = (unsigned char)(hl >> (8 * i));
    int ok = text && fwrite(le, 1, 8, f) == 8 && fwrite(text, 1, len, f) == len && fwrite("        ", 1, pad, f) == pad;
    free(text);
    return ok ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
}
