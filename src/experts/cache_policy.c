#include "experts/cache_policy.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

static const char *const k_names[QF_N_POLICIES] = {"lru", "dlfu", "dlfu-admit", "min"};

const char *qf_policy_name(int p) { return p >= 0 && p < QF_N_POLICIES ? k_names[p] : "?"; }

int qf_policy_parse(const char *name) {
    for (int p = 0; p < QF_N_POLICIES; p++)
        if (strcmp(name, k_names[p]) == 0) return p;
    return -1;
}

int qf_slot_cache_init(qf_slot_cache *c, int policy, int n_experts, int n_slots, int half_life) {
    memset(c, 0, sizeof *c);
    if (policy < 0 || policy >= QF_N_POLICIES || n_experts < 1 || n_slots < 1 || half_life < 1)
        return qf_fail(QF_EINVAL, "a slot cache needs a policy, experts, slots and a half-life of a tick or more");
    c->policy = policy, c->n_experts = n_experts, c->n_slots = n_slots < n_experts ? n_slots : n_experts, c->half_life = half_life;
    c->slot_of = malloc((size_t)n_experts * sizeof *c->slot_of);
    c->expert_in = malloc((size_t)c->n_slots * sizeof *c->expert_in);
    c->last = calloc((size_t)c->n_slots, sizeof *c->last);
    c->count = calloc((size_t)n_experts, sizeof *c->count);
    c->count_at = calloc((size_t)n_experts, sizeof *c->count_at);
    c->seen = calloc((size_t)n_experts, sizeof *c->seen);
    if (!c->slot_of || !c->expert_in || !c->last || !c->count || !c->count_at || !c->seen) {
        qf_slot_cache_free(c);
        return qf_fail(QF_ENOMEM, "out of memory");
    }
    for (int e = 0; e < n_experts; e++) c->slot_of[e] = -1;
    for (int s = 0; s < c->n_slots; s++) c->expert_in[s] = -1;
    return QF_OK;
}

void qf_slot_cache_free(qf_slot_cache *c) {
    free(c->slot_of), free(c->expert_in), free(c->last), free(c->count), free(c->count_at), free(c->seen);
    memset(c, 0, sizeof *c);
}

/* e's decayed count now: halved once per multiple of half_life passed since it was counted. */
static uint32_t count_now(const qf_slot_cache *c, int e) {
    uint32_t halvings = c->now / (uint32_t)c->half_life - c->count_at[e] / (uint32_t)c->half_life;
    return halvings >= 32 ? 0 : c->count[e] >> halvings;
}

static void count_use(qf_slot_cache *c, int e) {
    uint32_t n = count_now(c, e);
    c->count[e] = n > UINT32_MAX - QF_COUNT_ONE ? UINT32_MAX : n + QF_COUNT_ONE;
    c->count_at[e] = c->now;
}

int qf_slot_cache_find(qf_slot_cache *c, int expert) {
    count_use(c, expert);
    int s = c->slot_of[expert];
    if (s >= 0) c->last[s] = c->now, c->hits++;
    else c->misses++;
    return s;
}

/* Whether slot a leaves before slot b: the lesser (count, last use) for the frequency policies,
 * the older last use for LRU, the later next use for MIN; the lower slot on ties. */
static int leaves_first(const qf_slot_cache *c, int a, int b, const uint64_t *next_use) {
    if (c->policy == QF_POLICY_MIN) {
        uint64_t na = next_use[c->expert_in[a]], nb = next_use[c->expert_in[b]];
        if (na != nb) return na > nb;
    } else if (c->policy != QF_POLICY_LRU) {
        uint32_t ca = count_now(c, c->expert_in[a]), cb = count_now(c, c->expert_in[b]);
        if (ca != cb) return ca < cb;
    }
    if (c->last[a] != c->last[b]) return c->last[a] < c->last[b];
    return a < b;
}

/* The slot whose expert leaves. Slots used this tick are never victims (the token needs them). */
static int victim(const qf_slot_cache *c, const uint64_t *next_use) {
    int best = -1;
    for (int s = 0; s < c->used; s++)
        if (c->last[s] != c->now && (best < 0 || leaves_first(c, s, best, next_use))) best = s;
    return best;
}

int qf_slot_cache_insert(qf_slot_cache *c, int expert, int *evicted, const uint64_t *next_use) {
    *evicted = -1;
    int s;
    if (c->used < c->n_slots) {
        s = c->used++;
    } else {
        s = victim(c, next_use);
        if (s < 0) return c->declined++, -1; /* every slot serves this token */
        int old = c->expert_in[s], admit = 1;
        if (c->policy == QF_POLICY_DLFU_AD) admit = count_now(c, expert) > count_now(c, old);
        if (c->policy == QF_POLICY_MIN) admit = next_use[expert] < next_use[old];
        if (!admit) return c->declined++, -1;
        c->slot_of[old] = -1;
        *evicted = old;
    }
    c->expert_in[s] = expert;
    c->slot_of[expert] = s;
    c->last[s] = c->now;
    return s;
}

void qf_slot_cache_tick(qf_slot_cache *c) { c->now++; }

int qf_slot_cache_prefetch(qf_slot_cache *c, int expert, const uint64_t *next_use) {
    if (c->slot_of[expert] >= 0) return 0;
    int s = c->used < c->n_slots ? c->used++ : victim(c, next_use);
    if (s < 0) return 0;
    if (s < c->used && c->expert_in[s] >= 0 && c->slot_of[c->expert_in[s]] == s && c->expert_in[s] != expert) c->slot_of[c->expert_in[s]] = -1;
    c->expert_in[s] = expert;
    c->slot_of[expert] = s;
    c->last[s] = c->now;
    return 1;
}

int qf_slot_cache_access(qf_slot_cache *c, const int32_t *ids, int n, const uint64_t *next_use, int32_t *fill_e, int32_t *fill_s) {
    uint32_t met = 2 * c->now + 1, done = met + 1; /* seen[e]: met in the first pass, done in the second */
    for (int i = 0; i < n; i++) { /* the hits first */
        int e = ids[i];
        if (c->seen[e] == met) continue;
        c->seen[e] = met;
        count_use(c, e);
        if (c->slot_of[e] >= 0) c->last[c->slot_of[e]] = c->now, c->hits++;
    }
    int nf = 0;
    for (int i = 0; i < n; i++) { /* then the misses, in order */
        int e = ids[i], evicted;
        if (c->seen[e] != met) continue;
        c->seen[e] = done;
        if (c->slot_of[e] >= 0) continue;
        c->misses++;
        int s = qf_slot_cache_insert(c, e, &evicted, next_use);
        if (s >= 0 && fill_e) fill_e[nf] = e, fill_s[nf] = s;
        nf += s >= 0;
    }
    return nf;
}
