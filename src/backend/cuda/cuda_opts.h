/* The CUDA backend's tuning options: one struct, one table of name, default and a line of doc.
 * Users set them with `--cuda-opt name=value` (repeatable; `--cuda-opt help` lists them); for
 * diagnosis the environment variable QFLASH_CUDA_OPTS="name=value,..." is applied after the
 * defaults (flags win). Every default is the measured winner (docs/performance.md); the other
 * values select kernels kept as the references or fallbacks that tests compare. */
#ifndef QF_BACKEND_CUDA_OPTS_H
#define QF_BACKEND_CUDA_OPTS_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Numerics of the many-row products (prompt chunks): activations as two bf16 parts on the tensor
 * cores (the default; logits within ~1.5e-3 of the references), fp32 activations and no tensor
 * cores (within ~1.3e-4, as the CPU), or one bf16 part (faster prompts, logits off by up to ~1). */
enum { QF_PREC_BF16X2 = 0, QF_PREC_FP32, QF_PREC_BF16 };

/* The lab options' defaults (cuda_opts.c): the winners, constants of the kernels' code outside a
 * lab build (-DQFLASH_LAB=ON defines QF_CUDA_LAB), where the options may select the variants. */
#ifdef QF_CUDA_LAB
#define QF_CUDA_LAB_BUILD 1
#else
#define QF_CUDA_LAB_BUILD 0
#endif
#define QF_LAB_DEF_pdl 1
#define QF_LAB_DEF_early 1
#define QF_LAB_DEF_pw1 1
#define QF_LAB_DEF_gdn_lpc 4
#define QF_LAB_DEF_gdn_gn 1
#define QF_LAB_DEF_moe1 1
#define QF_LAB_DEF_moe_pf 1
#define QF_LAB_DEF_route 3
#define QF_LAB_DEF_att1 1
#define QF_LAB_DEF_att_gate 1
#define QF_LAB_DEF_comb 1
#define QF_LAB_DEF_mg 1
#define QF_LAB_DEF_mg_cp 1
#define QF_LAB_DEF_mg_p64 1
#define QF_LAB_DEF_att_tile 1
#define QF_LAB_DEF_att_tc 1
#define QF_LAB_DEF_gdn_chunk 1
#define QF_LAB_DEF_gdn_seq 0
#define QF_LAB_DEF_gdn_plpc 4
#define QF_LAB_DEF_gdn_cp 1

typedef struct qf_cuda_opts {
    int precision;
    int graphs, pdl, early, pw1, bulk, bulk_blocks;
    int gdn_lpc, gdn_gn, moe1, moe_pf, route, att1, att_gate, comb;
    int mg, mg_min, mg_cp, mg_p64, att_tile, att_tc, dec_tc;
    int gdn_chunk, gdn_chunk_min, gdn_seq, gdn_plpc, gdn_cp;
    int profile, steptime, link_gbps;
} qf_cuda_opts;

void qf_cuda_opts_default(qf_cuda_opts *o);
/* "name=value": QF_EINVAL naming the option or the value when either is wrong. */
int qf_cuda_opts_set(qf_cuda_opts *o, const char *assignment);
/* Whether "name=value" names a lab option (set only in a lab build). */
int qf_cuda_opt_is_lab(const char *assignment);
/* Applies QFLASH_CUDA_OPTS (comma-separated assignments) when set. */
int qf_cuda_opts_from_env(qf_cuda_opts *o);
/* The precision names: "bf16x2", "fp32", "bf16"; -1 for anything else. */
int qf_cuda_precision_parse(const char *name);
const char *qf_cuda_precision_name(int precision);
/* Every option with its default and doc (help), or with its value in o (o != NULL). */
void qf_cuda_opts_print(FILE *f, const qf_cuda_opts *o);

#ifdef __cplusplus
}
#endif

#endif
