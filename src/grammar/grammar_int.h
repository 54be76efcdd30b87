/* The built grammar's layout, shared by the builder (core.c) and the matcher (match.c). */
#ifndef QF_GRAMMAR_INT_H
#define QF_GRAMMAR_INT_H

#include <stdatomic.h>

#include "grammar/grammar.h"

struct qf_grammar {
    atomic_int refs;
    int n_rules, n_alts, n_sets, root;
    int *rule_a0, *rule_na; /* alternatives of rule r: rule_a0[r] .. + rule_na[r] */
    int *alt_e0, *alt_n;    /* elements of alternative a */
    int *alt_loop;          /* a = [set, call of its own rule]: a byte loop */
    int *alt_chain;         /* a = [set S, call of N] where N goes on with S: how many S bytes in a row (0: none) */
    int32_t *elems;         /* >= 0: a byte set; < 0: rule -(e + 1) */
    qf_cset *sets;
    char **specials;
    int n_specials;
};

#endif
