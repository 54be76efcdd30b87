#include "runtime/prefix.h"

#include <stdlib.h>
#include <string.h>

#include "backend/ops.h"
#include "base/err.h"

#define MAX_SNAPS 4096

typedef struct snap {
    qf_state_snap st;
    int32_t *toks;
    uint64_t hash, stamp;
    size_t bytes;
} snap;

struct qf_prefix {
    qf_kv_pool *kv;
    qf_backend *be;
    int host;      /* the DeltaNet blocks in host memory (a device budget that leaves them no room) */
    float **spare; /* [MAX_SNAPS] blocks of dropped snapshots, taken again before any is allocated */
    int n_spare;
    uint64_t *h;   /* a prompt's prefix hashes (grown as prompts need) */
    int cap_h;
    size_t state_bytes, page_bytes;
    snap *s;
    int n;
    uint64_t clock;
    qf_prefix_stats st;
};

/* FNV-1a over the token ids, extended one token at a time. */
static uint64_t hash_step(uint64_t h, int32_t t) {
    for (int b = 0; b < 4; b++) h = (h ^ (uint64_t)((uint32_t)t >> (8 * b) & 0xff)) * 0x100000001b3ull;
    return h;
}

int qf_prefix_create(qf_prefix **out, qf_kv_pool *kv, qf_backend *be, int host, size_t state_bytes, size_t page_bytes, size_t budget) {
    *out = NULL;
    qf_prefix *p = calloc(1, sizeof *p);
    if (!p) return qf_fail(QF_ENOMEM, "out of memory for the prefix cache");
    p->kv = kv, p->be = be, p->host = host;
    p->state_bytes = state_bytes;
    p->page_bytes = page_bytes;
    p->st.budget = budget;
    p->s = calloc(MAX_SNAPS, sizeof *p->s);
    p->spare = calloc(MAX_SNAPS, sizeof *p->spare);
    if (!p->s || !p->spare) {
        free(p->s), free(p->spare), free(p);
        return qf_fail(QF_ENOMEM, "out of memory for the prefix cache");
    }
    *out = p;
    return QF_OK;
}

static void drop(qf_prefix *p, int i) {
    snap *e = &p->s[i];
    p->st.bytes -= e->bytes;
    p->spare[p->n_spare++] = e->st.block;
    qf_state_snap_drop(&e->st);
    free(e->toks);
    p->s[i] = p->s[--p->n];
    p->st.snapshots = p->n;
    p->st.evicted++;
}

void qf_prefix_free(qf_prefix *p) {
    if (!p) return;
    while (p->n) drop(p, p->n - 1);
    for (int i = 0; i < p->n_spare; i++) p->host ? qf_be_host_free(p->be, p->spare[i]) : qf_be_free(p->be, p->spare[i]);
    free(p->spare);
    free(p->h);
    free(p->s);
    free(p);
}

static int lru(const qf_prefix *p) {
    int best = -1;
    for (int i = 0; i < p->n; i++)
        if (best < 0 || p->s[i].stamp < p->s[best].stamp) best = i;
    return best;
}

int qf_prefix_restore(qf_prefix *p, qf_state *st, const int32_t *toks, int n) {
    int best = -1;
    if (n > p->cap_h) { /* the prompt's prefix hashes, then each snapshot checked against its length's */
        uint64_t *h = realloc(p->h, (size_t)n * sizeof *h);
        if (h) p->h = h, p->cap_h = n;
    }
    if (p->n && n <= p->cap_h) {
        uint64_t h = 0xcbf29ce484222325ull;
        for (int k = 0; k < n; k++) p->h[k] = h = hash_step(h, toks[k]); /* h[k]: tokens 0..k */
        for (int i = 0; i < p->n; i++) {
            const snap *e = &p->s[i];
            int k = e->st.pos;
            if (k < n && e->hash == p->h[k - 1] && (best < 0 || k > p->s[best].st.pos) && !memcmp(e->toks, toks, (size_t)k * sizeof *toks)) best = i;
        }
    }
    if (best < 0 || qf_state_adopt(st, &p->s[best].st) != QF_OK) {
        p->st.misses++;
        return 0;
    }
    p->s[best].stamp = ++p->clock;
    p->st.hits++;
    p->st.tokens_reused += (uint64_t)p->s[best].st.pos;
    return p->s[best].st.pos;
}

/* A dropped snapshot's block, else a new one: the blocks held never exceed the snapshots the
 * budget allows at once. */
static float *take_block(qf_prefix *p) {
    if (p->n_spare) return p->spare[--p->n_spare];
    float *b = p->host ? qf_be_host_alloc(p->be, p->state_bytes) : qf_be_alloc(p->be, p->state_bytes);
    p->st.blocks += b != NULL;
    return b;
}

void qf_prefix_save(qf_prefix *p, const qf_state *st, const int32_t *toks) {
    int pos = st->pos;
    if (pos < 1) return;
    uint64_t h = 0xcbf29ce484222325ull;
    for (int k = 0; k < pos; k++) h = hash_step(h, toks[k]);
    for (int i = 0; i < p->n; i++)
        if (p->s[i].st.pos == pos && p->s[i].hash == h && !memcmp(p->s[i].toks, toks, (size_t)pos * sizeof *toks)) {
            p->s[i].stamp = ++p->clock;
            return;
        }
    int pt = qf_kv_pool_page_tokens(p->kv);
    size_t bytes = p->state_bytes + (size_t)((pos + pt - 1) / pt) * p->page_bytes + (size_t)pos * sizeof *toks;
    if (bytes > p->st.budget) return;
    while (p->n && (p->st.bytes + bytes > p->st.budget || p->n == MAX_SNAPS)) drop(p, lru(p));
    snap *e = &p->s[p->n];
    memset(e, 0, sizeof *e);
    e->toks = malloc((size_t)pos * sizeof *toks);
    float *block = take_block(p);
    if (!e->toks || !block || qf_state_snap_take(st, &e->st, block, p->host) != QF_OK) {
        free(e->toks);
        if (block) p->spare[p->n_spare++] = block;
        return; /* no snapshot: the next request prefills in full */
    }
    memcpy(e->toks, toks, (size_t)pos * sizeof *toks);
    e->hash = h;
    e->bytes = bytes;
    e->stamp = ++p->clock;
    p->n++;
    p->st.bytes += bytes;
    p->st.snapshots = p->n;
    p->st.saved++;
}

int qf_prefix_evict(qf_prefix *p, int pages) {
    int dropped = 0;
    while (p->n && qf_kv_pool_free_pages(p->kv) < pages) drop(p, lru(p)), dropped++;
    return dropped;
}

qf_prefix_stats qf_prefix_get_stats(const qf_prefix *p) { return p->st; }
