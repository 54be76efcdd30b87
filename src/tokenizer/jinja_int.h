/* Shared by jinja.c (lexer, parser) and jinja_run.c (evaluation): the syntax tree. */
#ifndef QF_TOKENIZER_JINJA_INT_H
#define QF_TOKENIZER_JINJA_INT_H

#include <stddef.h>

#include "tokenizer/jinja.h"

enum {
    /* statements */
    N_TEXT, N_OUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_MACRO, N_BREAK, N_CONTINUE, N_BLOCK,
    /* expressions */
    E_LIT, E_NAME, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NOT, E_NEG, E_BIN, E_AND, E_OR, E_COND, E_LIST, E_DICT
};
enum { OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FDIV, OP_MOD, OP_CAT, OP_EQ, OP_NE, OP_LT, OP_GT, OP_LE, OP_GE, OP_IN, OP_NOTIN };

typedef struct jnode jnode;
struct jnode {
    int type, line, op, neg; /* neg: `is not` */
    char *name;              /* a name, attribute, filter, test, set target, macro */
    char *attr;              /* set ns.attr: the attribute */
    char *text;              /* N_TEXT */
    size_t len;
    json_t *lit;             /* E_LIT (owned by the template) */
    jnode *a, *b, *c;        /* operands; N_IF / N_FOR: a the condition / iterable, b a for's filter */
    jnode **args;            /* call / filter / test arguments, list items, dict keys and values in turn, macro defaults */
    char **kw;               /* per argument: its keyword, or NULL */
    int nargs;
    jnode **body, **orelse;  /* N_IF: else (an elif is an N_IF alone in it); N_FOR: else */
    int nbody, norelse;
    char **targets;          /* N_FOR: one or two names; N_MACRO: parameters */
    int ntargets;
};

struct qf_jinja {
    jnode **body;
    int nbody;
    void **mem; /* every allocation, freed with the template */
    int nmem, capmem;
    json_t **lits;
    int nlits, caplits;
    char *src; /* the template's own copy of its text: N_TEXT nodes point into it */
};

#endif
