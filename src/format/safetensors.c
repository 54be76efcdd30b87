#include "format/safetensors.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/dtype.h"
#include "format/config.h"

typedef struct range {
    uint64_t begin, end;
    int idx;
} range;

static int cmp_range(const void *a, const void *b) {
    const range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : (x->end > y->end);
}

static int grow_tensors(qf_st_set *set, int extra) {
    if (set->n_tensors + extra <= set->cap_tensors) return QF_OK;
    int cap = set->cap_tensors ? set->cap_tensors : 64;
    while (cap < set->n_tensors + extra) cap *= 2;
    qf_st_tensor *t = realloc(set->tensors, (size_t)cap * sizeof *t);
    if (!t) return qf_fail(QF_ENOMEM, "out of memory (tensor table)");
    set->tensors = t;
    set->cap_tensors = cap;
    return QF_OK;
}

/* Parses one header entry into t (name set by caller). Offsets are relative to the data
 * section, checked against data_len. */
static int parse_entry(const char *path, const char *name, json_t *v, uint64_t data_len,
                       qf_st_tensor *t, range *r) {
    if (!json_is_object(v)) return qf_fail(QF_EFORMAT, "%s: tensor '%s': entry is not an object", path, name);
    json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape");
    json_t *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd) || !json_is_array(js) || !json_is_array(jo) || json_array_size(jo) != 2)
        return qf_fail(QF_EFORMAT, "%s: tensor '%s': needs dtype, shape and data_offsets[2]", path, name);
    t->dtype = qf_dtype_parse(json_string_value(jd));
    if (t->dtype == QF_DT_UNKNOWN)
        return qf_fail(QF_EFORMAT, "%s: tensor '%s': unknown dtype '%s'", path, name, json_string_value(jd));
    size_t nd = json_array_size(js);
    if (nd > QF_ST_MAX_DIMS) return qf_fail(QF_EFORMAT, "%s: tensor '%s': %zu dims (max %d)", path, name, nd, QF_ST_MAX_DIMS);
    t->ndim = (int)nd;
    uint64_t n = 1;
    for (size_t i = 0; i < nd; i++) {
        json_t *d = json_array_get(js, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0 || json_integer_value(d) > (1ll << 40))
            return qf_fail(QF_EFORMAT, "%s: tensor '%s': bad shape entry %zu", path, name, i);
        t->shape[i] = json_integer_value(d);
        if (t->shape[i] && n > (UINT64_MAX >> 4) / (uint64_t)t->shape[i])
            return qf_fail(QF_EFORMAT, "%s: tensor '%s': shape overflows", path, name);
        n *= (uint64_t)t->shape[i];
    }
    t->n_elem = (int64_t)n;
    json_t *b = json_array_get(jo, 0), *e = json_array_get(jo, 1);
    if (!json_is_integer(b) || !json_is_integer(e) || json_integer_value(b) < 0 ||
        json_integer_value(e) < json_integer_value(b))
        return qf_fail(QF_EFORMAT, "%s: tensor '%s': bad data_offsets", path, name);
    r->begin = (uint64_t)json_integer_value(b);
    r->end = (uint64_t)json_integer_value(e);
    if (r->end > data_len)
        return qf_fail(QF_EFORMAT, "%s: tensor '%s': bytes [%llu, %llu) lie past the end of the data (%llu bytes; file truncated?)",
                       path, name, (unsigned long long)r->begin, (unsigned long long)r->end, (unsigned long long)data_len);
    uint64_t want = n * qf_dtype_size(t->dtype);
    if (r->end - r->begin != want)
        return qf_fail(QF_EFORMAT, "%s: tensor '%s': shape x dtype = %llu bytes but data_offsets span %llu",
                       path, name, (unsigned long long)want, (unsigned long long)(r->end - r->begin));
    t->nbytes = (size_t)want;
    return QF_OK;
}

/* Validates the header of an already mapped file and appends its tensors to the set. */
static int parse_header(qf_st_set *set, int file_idx) {
    qf_st_file *f = &set->files[file_idx];
    const char *path = f->path;
    if (f->map.size < 8) return qf_fail(QF_EFORMAT, "%s: file too short for a safetensors header (%zu bytes)", path, f->map.size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f->map.data[i];
    if (hlen > f->map.size - 8)
        return qf_fail(QF_EFORMAT, "%s: header length %llu runs past the end of the file (%zu bytes)", path, (unsigned long long)hlen, f->map.size);
    if (hlen > QF_ST_HEADER_CAP) return qf_fail(QF_EFORMAT, "%s: header length %llu over the %u-byte cap", path, (unsigned long long)hlen, QF_ST_HEADER_CAP);
    json_error_t jerr;
    json_t *root = json_loadb((const char *)f->map.data + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) return qf_fail(QF_EFORMAT, "%s: header is not valid JSON: %s (at byte %d)", path, jerr.text, jerr.position);
    if (!json_is_object(root)) {
        json_decref(root);
        return qf_fail(QF_EFORMAT, "%s: header is not a JSON object", path);
    }
    uint64_t data_len = f->map.size - 8 - hlen;
    const unsigned char *data = f->map.data + 8 + hlen;
    size_t n = json_object_size(root);
    range *ranges = calloc(n ? n : 1, sizeof *ranges);
    int rc = ranges ? grow_tensors(set, (int)n) : qf_fail(QF_ENOMEM, "out of memory");
    int first = set->n_tensors, cnt = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (rc != QF_OK) break;
        if (strcmp(key, "__metadata__") == 0) continue;
        qf_st_tensor *t = &set->tensors[first + cnt];
        memset(t, 0, sizeof *t);
        rc = parse_entry(path, key, val, data_len, t, &ranges[cnt]);
        if (rc != QF_OK) break;
        t->name = strdup(key);
        t->file = file_idx;
        t->data = data + ranges[cnt].begin;
        ranges[cnt].idx = first + cnt;
        if (!t->name) rc = qf_fail(QF_ENOMEM, "out of memory");
        else cnt++;
    }
    if (rc == QF_OK) {
        qsort(ranges, (size_t)cnt, sizeof *ranges, cmp_range);
        for (int i = 1; i < cnt && rc == QF_OK; i++)
            if (ranges[i].begin < ranges[i - 1].end)
                rc = qf_fail(QF_EFORMAT, "%s: tensors '%s' and '%s' overlap", path,
                             set->tensors[ranges[i - 1].idx].name, set->tensors[ranges[i].idx].name);
    }
    for (int i = 0; i < cnt && rc == QF_OK; i++) {
        qf_st_tensor *t = &set->tensors[first + i];
        int put = qf_strmap_put(&set->by_name, t->name, strlen(t->name), first + i);
        if (put == 0) rc = qf_fail(QF_EFORMAT, "%s: tensor '%s' also appears in %s", path, t->name,
                                   set->files[set->tensors[qf_st_find(set, t->name) - set->tensors].file].path);
        else if (put < 0) rc = QF_ENOMEM;
    }
    if (rc == QF_OK) {
        set->n_tensors += cnt;
    } else {
        /* a failed file contributes nothing; names registered before the failure stay borrowed
           from these strings, so drop the whole map entry set by rebuilding it */
        for (int i = 0; i < cnt; i++) free(set->tensors[first + i].name);
        qf_strmap_free(&set->by_name);
        qf_strmap_init(&set->by_name, (size_t)set->n_tensors + 16);
        for (int i = 0; i < set->n_tensors; i++)
            qf_strmap_put(&set->by_name, set->tensors[i].name, strlen(set->tensors[i].name), i);
    }
    free(ranges);
    json_decref(root);
    return rc;
}

static int ensure_init(qf_st_set *set) {
    if (set->by_name.cap) return QF_OK;
    return qf_strmap_init(&set->by_name, 1024);
}

int qf_st_add_file(qf_st_set *set, const char *path) {
    int rc = ensure_init(set);
    if (rc != QF_OK) return rc;
    qf_st_file *nf = realloc(set->files, (size_t)(set->n_files + 1) * sizeof *nf);
    if (!nf) return qf_fail(QF_ENOMEM, "out of memory");
    set->files = nf;
    qf_st_file *f = &set->files[set->n_files];
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path) return qf_fail(QF_ENOMEM, "out of memory");
    rc = qf_mapfile_open(&f->map, path);
    if (rc == QF_OK) {
        set->n_files++;
        rc = parse_header(set, set->n_files - 1);
        if (rc != QF_OK) {
            set->n_files--;
            qf_mapfile_close(&f->map);
        }
    }
    if (rc != QF_OK) free(f->path);
    return rc;
}

int qf_st_open(qf_st_set *set, const char *path) {
    memset(set, 0, sizeof *set);
    int rc = qf_st_add_file(set, path);
    if (rc != QF_OK) {
        qf_st_close(set); /* cleanup never touches the error message */
    }
    return rc;
}

static char *join_path(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int note(qf_diag *diag, int *first_rc, int rc) {
    if (rc == QF_OK) return rc;
    if (*first_rc == QF_OK) *first_rc = rc;
    qf_diag_report(diag);
    return rc;
}

/* Reads the index, opens each distinct shard once, then checks that every name in weight_map
 * was found in the shard the index assigns it to. */
static int open_index(qf_st_set *set, const char *dir, const char *index_path, qf_diag *diag) {
    json_error_t jerr;
    json_t *root = json_load_file(index_path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) return qf_fail_json(index_path, &jerr);
    json_t *wm = json_object_get(root, "weight_map");
    int first_rc = QF_OK;
    if (!json_is_object(wm)) {
        json_decref(root);
        return qf_fail(QF_EFORMAT, "%s: no \"weight_map\" object", index_path);
    }
    qf_strmap shards;
    if (qf_strmap_init(&shards, 16) != QF_OK) {
        json_decref(root);
        return QF_ENOMEM;
    }
    const char *key;
    json_t *val;
    json_object_foreach(wm, key, val) {
        if (!json_is_string(val)) {
            note(diag, &first_rc, qf_fail(QF_EFORMAT, "%s: weight_map['%s'] is not a file name", index_path, key));
            continue;
        }
        const char *shard = json_string_value(val);
        if (strchr(shard, '/') || strcmp(shard, "..") == 0) {
            note(diag, &first_rc, qf_fail(QF_EFORMAT, "%s: shard name '%s' is not a plain file name", index_path, shard));
            continue;
        }
        if (qf_strmap_get(&shards, shard, strlen(shard)) != -1) continue;
        char *p = join_path(dir, shard);
        int rc = !p ? qf_fail(QF_ENOMEM, "out of memory")
                 : access(p, F_OK) != 0 ? qf_fail(QF_EIO, "%s: missing shard '%s' named by %s", dir, shard, index_path)
                 : qf_st_add_file(set, p);
        qf_strmap_put(&shards, shard, strlen(shard), rc == QF_OK ? set->n_files - 1 : -2);
        note(diag, &first_rc, rc);
        free(p);
    }
    json_object_foreach(wm, key, val) {
        if (!json_is_string(val)) continue;
        int fi = qf_strmap_get(&shards, json_string_value(val), strlen(json_string_value(val)));
        if (fi < 0) continue; /* shard already reported */
        const qf_st_tensor *t = qf_st_find(set, key);
        if (!t) note(diag, &first_rc, qf_fail(QF_EFORMAT, "%s: tensor '%s' is listed in the index but missing from %s", index_path, key, set->files[fi].path));
        else if (t->file != fi) note(diag, &first_rc, qf_fail(QF_EFORMAT, "%s: tensor '%s' is indexed in %s but stored in %s", index_path, key, set->files[fi].path, set->files[t->file].path));
    }
    qf_strmap_free(&shards);
    json_decref(root);
    if (first_rc != QF_OK && diag) qf_fail(first_rc, "%d problem(s) in the checkpoint files", diag->count);
    return first_rc;
}

int qf_st_open_dir(qf_st_set *set, const char *dir, qf_diag *diag) {
    memset(set, 0, sizeof *set);
    int rc = ensure_init(set);
    if (rc != QF_OK) return rc;
    char *index = join_path(dir, "model.safetensors.index.json");
    char *single = join_path(dir, "model.safetensors");
    if (!index || !single) rc = qf_fail(QF_ENOMEM, "out of memory");
    else if (access(index, R_OK) == 0) rc = open_index(set, dir, index, diag);
    else if (access(single, R_OK) == 0) {
        rc = qf_st_add_file(set, single);
        if (rc != QF_OK) qf_diag_report(diag);
    } else rc = qf_fail(QF_EIO, "%s: neither model.safetensors.index.json nor model.safetensors found", dir);
    free(index);
    free(single);
    if (rc != QF_OK) {
        qf_st_close(set); /* cleanup never touches the error message */
    }
    return rc;
}

const qf_st_tensor *qf_st_find(const qf_st_set *set, const char *name) {
    int i = qf_strmap_get(&set->by_name, name, strlen(name));
    return i >= 0 ? &set->tensors[i] : NULL;
}

int qf_st_add_memory(qf_st_set *set, const char *name, int dtype, int ndim, const int64_t *shape, void *data) {
    int rc = ensure_init(set);
    if (rc == QF_OK) rc = grow_tensors(set, 1);
    if (rc == QF_OK && qf_st_find(set, name)) rc = qf_fail(QF_EINVAL, "tensor '%s' added twice", name);
    if (rc == QF_OK && (ndim < 0 || ndim > QF_ST_MAX_DIMS)) rc = qf_fail(QF_EINVAL, "tensor '%s': %d dimensions", name, ndim);
    qf_st_tensor *t = rc == QF_OK ? &set->tensors[set->n_tensors] : NULL;
    if (t) {
        memset(t, 0, sizeof *t);
        t->name = strdup(name);
        t->dtype = dtype, t->ndim = ndim, t->n_elem = 1, t->file = -1;
        for (int i = 0; i < ndim; i++) t->shape[i] = shape[i], t->n_elem *= shape[i];
        t->nbytes = (size_t)t->n_elem * qf_dtype_size(dtype);
        t->data = t->owned = data;
        if (!t->name) rc = qf_fail(QF_ENOMEM, "out of memory");
    }
    if (rc == QF_OK && qf_strmap_put(&set->by_name, t->name, strlen(t->name), set->n_tensors) <= 0) rc = qf_fail(QF_ENOMEM, "out of memory");
    if (rc != QF_OK) {
        if (t) free(t->name);
        free(data);
        return rc;
    }
    set->n_tensors++;
    return QF_OK;
}

void qf_st_close(qf_st_set *set) {
    for (int i = 0; i < set->n_tensors; i++) free(set->tensors[i].name), free(set->tensors[i].owned);
    for (int i = 0; i < set->n_files; i++) {
        qf_mapfile_close(&set->files[i].map);
        free(set->files[i].path);
    }
    free(set->tensors);
    free(set->files);
    qf_strmap_free(&set->by_name);
    memset(set, 0, sizeof *set);
}

int qf_st_read(const qf_st_set *set, const void *p, void *dst, size_t n) {
    const unsigned char *q = p;
    for (int i = 0; set && i < set->n_files; i++) {
        const qf_mapfile *m = &set->files[i].map;
        if (q < m->data || q + n > m->data + m->size || m->fd < 0) continue;
        size_t done = 0;
        while (done < n) {
            ssize_t r = pread(m->fd, (char *)dst + done, n - done, (off_t)(q - m->data) + (off_t)done);
            if (r <= 0) return qf_fail(QF_EIO, "%s: cannot read %zu bytes at %zu", set->files[i].path, n, (size_t)(q - m->data));
            done += (size_t)r;
        }
        return QF_OK;
    }
    memcpy(dst, p, n);
    return QF_OK;
}
