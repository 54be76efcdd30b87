/* Open-addressing maps used by the loaders: string -> int (vocabulary, tensor names) and
 * u64 -> int (BPE merge pairs). Keys are borrowed: the caller keeps strings alive. */
#ifndef QF_BASE_HASHMAP_H
#define QF_BASE_HASHMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct qf_strmap {
    const char **keys;
    size_t *klens;
    int *vals;
    size_t cap, count;
} qf_strmap;

int qf_strmap_init(qf_strmap *m, size_t expected);
void qf_strmap_free(qf_strmap *m);
/* Returns 1 when the key was new, 0 when it already existed (value unchanged), <0 on error. */
int qf_strmap_put(qf_strmap *m, const char *key, size_t klen, int val);
/* Returns the value or -1. */
int qf_strmap_get(const qf_strmap *m, const char *key, size_t klen);

typedef struct qf_u64map {
    uint64_t *keys;
    int *vals; /* -1 marks an empty slot */
    size_t cap, count;
} qf_u64map;

int qf_u64map_init(qf_u64map *m, size_t expected);
void qf_u64map_free(qf_u64map *m);
int qf_u64map_put(qf_u64map *m, uint64_t key, int val); /* val >= 0 */
int qf_u64map_get(const qf_u64map *m, uint64_t key);

/* FNV-1a of n bytes, continuing from h. The maps and the synthetic model's tensor seeds start from
 * QF_HASH_START (one digit short of FNV's offset basis: kept, since the synthetic weights are
 * seeded from it); a fresh FNV-1a starts from QF_FNV_BASIS. */
#define QF_HASH_START 1469598103934665603ull
#define QF_FNV_BASIS 14695981039346656037ull
uint64_t qf_fnv1a(uint64_t h, const void *p, size_t n);

#endif
