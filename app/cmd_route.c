/* qflash route-replay: cache policies replayed over a recorded routing trace (safetensors with
 * expert_ids U8/I32 [layers][tokens][top_k]), one slot cache per layer as a store would keep, and
 * the hit rate over all routings printed per policy and slot count. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "base/dtype.h"
#include "experts/cache_policy.h"
#include "format/safetensors.h"

typedef struct trace {
    int L, T, K, E, G;
    int32_t *ids;   /* [L][T][K] */
    int32_t *guess; /* [L][T][G] prefetch candidates best first, -1 none (route-record's guess_ids); NULL: none */
} trace;

static int load_trace(const char *path, trace *tr) {
    qf_st_set st;
    int rc = qf_st_open(&st, path);
    if (rc != QF_OK) return rc;
    const qf_st_tensor *t = qf_st_find(&st, "expert_ids");
    if (!t || t->ndim != 3 || (t->dtype != QF_DT_U8 && t->dtype != QF_DT_I32)) {
        qf_st_close(&st);
        return qf_fail(QF_EFORMAT, "%s: no expert_ids tensor of U8 or I32 [layers][tokens][top_k]", path);
    }
    tr->L = (int)t->shape[0], tr->T = (int)t->shape[1], tr->K = (int)t->shape[2], tr->E = 0;
    size_t n = (size_t)tr->L * tr->T * tr->K;
    tr->ids = malloc(n * sizeof *tr->ids);
    for (size_t i = 0; tr->ids && i < n; i++) {
        tr->ids[i] = t->dtype == QF_DT_U8 ? ((const uint8_t *)t->data)[i] : ((const int32_t *)t->data)[i];
        tr->E = tr->ids[i] + 1 > tr->E ? tr->ids[i] + 1 : tr->E;
    }
    const qf_st_tensor *g = qf_st_find(&st, "guess_ids");
    if (g && g->ndim == 3 && g->dtype == QF_DT_I32 && g->shape[0] == tr->L && g->shape[1] == tr->T) {
        tr->G = (int)g->shape[2];
        tr->guess = malloc((size_t)tr->L * tr->T * tr->G * sizeof *tr->guess);
        if (tr->guess) memcpy(tr->guess, g->data, (size_t)tr->L * tr->T * tr->G * sizeof *tr->guess);
    }
    qf_st_close(&st);
    return tr->ids ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
}

/* nxt[t][k]: the next token after t that routes layer L to the same expert (UINT64_MAX: none). */
static void next_uses(const trace *tr, int L, uint64_t *nxt, uint64_t *first) {
    for (int e = 0; e < tr->E; e++) first[e] = UINT64_MAX;
    for (int t = tr->T - 1; t >= 0; t--) { /* backwards: first[e] ends as its first use */
        const int32_t *row = tr->ids + ((size_t)L * tr->T + t) * tr->K;
        for (int k = 0; k < tr->K; k++) nxt[(size_t)t * tr->K + k] = first[row[k]];
        for (int k = 0; k < tr->K; k++) first[row[k]] = (uint64_t)t;
    }
}

/* Hit rate of one policy and slot count over every layer of the trace; with prefetch > 0 the first
 * prefetch guesses of each (layer, token) are loaded before its routings (*loads: how many, a
 * token and layer). */
static double replay(const trace *tr, int policy, int slots, int half_life, int prefetch, double *loads) {
    uint64_t hits = 0, total = 0, fetched = 0;
    uint64_t *nxt = malloc((size_t)tr->T * tr->K * sizeof *nxt), *next_use = malloc((size_t)tr->E * sizeof *next_use);
    for (int L = 0; nxt && next_use && L < tr->L; L++) {
        qf_slot_cache c;
        if (qf_slot_cache_init(&c, policy, tr->E, slots, half_life) != QF_OK) break;
        next_uses(tr, L, nxt, next_use);
        for (int t = 0; t < tr->T; t++) {
            const int32_t *row = tr->ids + ((size_t)L * tr->T + t) * tr->K;
            for (int k = 0; k < tr->K; k++) next_use[row[k]] = nxt[(size_t)t * tr->K + k];
            const int32_t *guess = tr->guess ? tr->guess + ((size_t)L * tr->T + t) * tr->G : NULL;
            for (int g = 0; guess && g < prefetch && g < tr->G; g++)
                if (guess[g] >= 0 && guess[g] < tr->E) fetched += (uint64_t)qf_slot_cache_prefetch(&c, guess[g], next_use);
            qf_slot_cache_access(&c, row, tr->K, next_use, NULL, NULL); /* as the device expert cache does */
            qf_slot_cache_tick(&c);
        }
        hits += c.hits, total += c.hits + c.misses;
        qf_slot_cache_free(&c);
    }
    free(nxt), free(next_use);
    if (loads) *loads = (double)fetched / ((double)tr->L * tr->T);
    return total ? (double)hits / (double)total : 0.0;
}

/* How many of the routed experts are among the first n guesses (layers with guesses). */
static double recall(const trace *tr, int n) {
    uint64_t found = 0, total = 0;
    for (int L = 0; tr->guess && L < tr->L; L++)
        for (int t = 0; t < tr->T; t++) {
            const int32_t *row = tr->ids + ((size_t)L * tr->T + t) * tr->K, *g = tr->guess + ((size_t)L * tr->T + t) * tr->G;
            if (g[0] < 0) continue;
            for (int k = 0; k < tr->K; k++) {
                total++;
                for (int j = 0; j < n && j < tr->G; j++) found += g[j] == row[k];
            }
        }
    return total ? (double)found / (double)total : 0.0;
}

static int parse_list(const char *s, int *out, int cap) {
    int n = 0;
    for (const char *p = s; *p && n < cap;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 1 << 20) return -1;
        out[n++] = (int)v;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

int cmd_route_replay(int argc, char **argv, qf_backend_opts *bo) {
    (void)bo; /* runs no model */
    const char *path = NULL;
    int slots[32], n_slots = 0;
    int half_life = 64;
    int prefetch = 0;
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, NULL, "--slots")) {
            const char *v = cli_value(&a);
            if (v && (n_slots = parse_list(v, slots, 32)) <= 0) fprintf(stderr, "error: --slots takes counts like 8,16,64\n"), a.bad = 1;
        } else if (cli_is(&a, NULL, "--prefetch")) {
            prefetch = cli_int(&a, 1, 64);
        } else if (cli_is(&a, NULL, "--half-life")) {
            half_life = (int)cli_num(&a, 1, 1e9);
        } else if (argv[a.i][0] != '-' && !path) {
            path = argv[a.i];
        } else {
            fprintf(stderr, "error: unknown option '%s' for route-replay\n", argv[a.i]);
            a.bad = 1;
        }
    }
    if (a.bad || !path) {
        fprintf(stderr, "usage: qflash route-replay TRACE.safetensors [--slots 8,16,32,64,96,128] [--half-life 64] [--prefetch N]\n");
        return 2;
    }
    trace tr = {0};
    if (load_trace(path, &tr) != QF_OK) {
        free(tr.ids), free(tr.guess);
        fprintf(stderr, "error: %s\n", qf_last_error());
        return 1;
    }
    if (!n_slots) {
        int def[] = {8, 16, 32, 64, 96, 128};
        for (int i = 0; i < 6; i++)
            if (def[i] <= tr.E) slots[n_slots++] = def[i];
    }
    printf("%s: %d layers, %d tokens, top-%d of %d experts; hit rate over all routings (per-layer caches; dlfu half-life %d tokens)\n",
           path, tr.L, tr.T, tr.K, tr.E, half_life);
    printf("%6s %9s", "slots", "residency");
    for (int p = 0; p < QF_N_POLICIES; p++) printf(" %11s", qf_policy_name(p));
    printf("\n");
    for (int i = 0; i < n_slots; i++) {
        printf("%6d %8.1f%%", slots[i], 100.0 * slots[i] / tr.E);
        for (int p = 0; p < QF_N_POLICIES; p++) printf(" %10.1f%%", 100.0 * replay(&tr, p, slots[i], half_life, 0, NULL));
        printf("\n");
    }
    if (prefetch && !tr.guess) fprintf(stderr, "route-replay: the trace has no guess_ids (route-record writes them): no prefetch\n");
    if (prefetch && tr.guess) {
        printf("with the next layer's router on this layer's MoE input prefetching its first %d guesses (recall of the routed experts %.1f%%):\n",
               prefetch, 100.0 * recall(&tr, prefetch));
        for (int i = 0; i < n_slots; i++) {
            printf("%6d %8.1f%%", slots[i], 100.0 * slots[i] / tr.E);
            for (int p = 0; p < QF_N_POLICIES; p++) {
                double loads;
                printf(" %10.1f%%", 100.0 * replay(&tr, p, slots[i], half_life, prefetch, &loads));
                if (p == QF_POLICY_DLFU_AD) printf(" (%.2f prefetched)", loads);
            }
            printf("\n");
        }
    }
    free(tr.ids), free(tr.guess);
    return 0;
}
