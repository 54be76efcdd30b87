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

int qf_slot_cache_init(qf_slot_cache *c, int policy, int n_experts, int n_slots, double half_life) {
    memset(c, 0, sizeof *c);
    if (policy < 0 || policy >= QF_N_POLICIES || n_experts < 1 || n_slots < 1 || half_life <= 0)
        return qf_fail(QF_EINVAL, "a slot cache needs a policy, experts, slots and a half-life above 0");
    c->policy = policy, c->n_experts = n_experts, c->n_slots = n_slots < n_experts ? n_slots : n_experts;
    c->decay = pow(0.5, 1.0 / half_life);
    c->slot_of = malloc((size_t)n_experts * sizeof *c->slot_of);
    c->expert_in = malloc((size_t)c->n_slots * sizeof *c->expert_in);
    c->last = calloc((size_t)c->n_slots, sizeof *c->last);
    c->count = calloc((size_t)n_experts, sizeof *c->count);
    c->count_at = calloc((size_t)n_experts, sizeof *c->count_at);
    if (!c->slot_of || !c->expert_in || !c->last || !c->count || !c->count_at) {
        qf_slot_cache_free(c);
        return qf_fail(QF_ENOMEM, "out of memory");
    }
    for (int e = 0; e < n_experts; e++) c->slot_of[e] = -1;
    for (int s = 0; s < c->n_slots; s++) c->expert_in[s] = -1;
    return QF_OK;
}

void qf_slot_cache_free(qf_slot_cache *c) {
    free(c->slot_of), free(c->expert_in), free(c->last), free(c->count), free(c->count_at);
    memset(c, 0, sizeof *c);
}

/* e's decayed count now. */
static double count_now(const qf_slot_cache *c, int e) { return c->count[e] * pow(c->decay, (double)(c->now - c->count_at[e])); }

static void count_use(qf_slot_cache *c, int e) {
    c->count[e] = count_now(c, e) + 1.0;
    c->count_at[e] = c->now;
}

int qf_slot_cache_find(qf_slot_cache *c, int expert) {
    count_use(c, expert);
    int s = c->slot_of[expert];
    if (s >= 0) c->last[s] = c->now, c->hits++;
    else c->misses++;
    return s;
}

/* The slot whose expert leaves. Slots used this tick are never victims (the token needs them). */
static int victim(const qf_slot_cache *c, const uint64_t *next_use) {
    int best = -1;
    double best_key = 0;
    for (int s = 0; s < c->used; s++) {
        if (c->last[s] == c->now) continue;
        int e = c->expert_in[s];
        double key = c->policy == QF_POLICY_LRU   ? (double)c->last[s]
                     : c->policy == QF_POLICY_MIN ? -(double)next_use[e]
                                                  : count_now(c, e) + 1e-9 * (double)c->last[s];
        if (best < 0 || key < best_key) best = s, best_key = key;
    }
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
