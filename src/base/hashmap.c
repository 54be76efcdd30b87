#include "base/hashmap.h"

#include <stdlib.h>
#include <string.h>

#include "base/err.h"

uint64_t qf_fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_bytes(const char *s, size_t n) { return qf_fnv1a(QF_HASH_START, s, n); }

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n * 2) c <<= 1;
    return c;
}

int qf_strmap_init(qf_strmap *m, size_t expected) {
    memset(m, 0, sizeof *m);
    m->cap = pow2_at_least(expected);
    m->keys = calloc(m->cap, sizeof *m->keys);
    m->klens = calloc(m->cap, sizeof *m->klens);
    m->vals = calloc(m->cap, sizeof *m->vals);
    if (!m->keys || !m->klens || !m->vals) {
        qf_strmap_free(m);
        return qf_fail(QF_ENOMEM, "out of memory (hash map)");
    }
    return QF_OK;
}

void qf_strmap_free(qf_strmap *m) {
    free(m->keys);
    free(m->klens);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

static int strmap_grow(qf_strmap *m) {
    qf_strmap n;
    if (qf_strmap_init(&n, m->cap) != QF_OK) return QF_ENOMEM;
    for (size_t i = 0; i < m->cap; i++)
        if (m->keys[i]) qf_strmap_put(&n, m->keys[i], m->klens[i], m->vals[i]);
    qf_strmap_free(m);
    *m = n;
    return QF_OK;
}

int qf_strmap_put(qf_strmap *m, const char *key, size_t klen, int val) {
    if ((m->count + 1) * 2 > m->cap && strmap_grow(m) != QF_OK) return QF_ENOMEM;
    size_t i = hash_bytes(key, klen) & (m->cap - 1);
    while (m->keys[i]) {
        if (m->klens[i] == klen && memcmp(m->keys[i], key, klen) == 0) return 0;
        i = (i + 1) & (m->cap - 1);
    }
    m->keys[i] = key;
    m->klens[i] = klen;
    m->vals[i] = val;
    m->count++;
    return 1;
}

int qf_strmap_get(const qf_strmap *m, const char *key, size_t klen) {
    if (!m->cap) return -1;
    size_t i = hash_bytes(key, klen) & (m->cap - 1);
    while (m->keys[i]) {
        if (m->klens[i] == klen && memcmp(m->keys[i], key, klen) == 0) return m->vals[i];
        i = (i + 1) & (m->cap - 1);
    }
    return -1;
}

int qf_u64map_init(qf_u64map *m, size_t expected) {
    memset(m, 0, sizeof *m);
    m->cap = pow2_at_least(expected);
    m->keys = calloc(m->cap, sizeof *m->keys);
    m->vals = malloc(m->cap * sizeof *m->vals);
    if (!m->keys || !m->vals) {
        qf_u64map_free(m);
        return qf_fail(QF_ENOMEM, "out of memory (hash map)");
    }
    memset(m->vals, 0xff, m->cap * sizeof *m->vals);
    return QF_OK;
}

void qf_u64map_free(qf_u64map *m) {
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

int qf_u64map_put(qf_u64map *m, uint64_t key, int val) {
    if ((m->count + 1) * 2 > m->cap) {
        qf_u64map n;
        if (qf_u64map_init(&n, m->cap) != QF_OK) return QF_ENOMEM;
        for (size_t i = 0; i < m->cap; i++)
            if (m->vals[i] >= 0) qf_u64map_put(&n, m->keys[i], m->vals[i]);
        qf_u64map_free(m);
        *m = n;
    }
    size_t i = hash_u64(key) & (m->cap - 1);
    while (m->vals[i] >= 0) {
        if (m->keys[i] == key) return 0;
        i = (i + 1) & (m->cap - 1);
    }
    m->keys[i] = key;
    m->vals[i] = val;
    m->count++;
    return 1;
}

int qf_u64map_get(const qf_u64map *m, uint64_t key) {
    if (!m->cap) return -1;
    size_t i = hash_u64(key) & (m->cap - 1);
    while (m->vals[i] >= 0) {
        if (m->keys[i] == key) return m->vals[i];
        i = (i + 1) & (m->cap - 1);
    }
    return -1;
}
