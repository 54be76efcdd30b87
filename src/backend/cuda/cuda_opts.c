#include "backend/cuda/cuda_opts.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

typedef struct opt_def {
    const char *name;
    size_t off;
    int def, lo, hi, lab;
    const char *doc;
} opt_def;

/* A tuning or diagnosis option, and a lab option: one that selects a kernel variant which lost its
 * measurement (docs/performance.md), or turns a winning kernel off for a bisection. A lab option
 * is set only in a lab build (-DQFLASH_LAB=ON); elsewhere its default is a constant of the
 * kernels' code (QF_LAB in cuda_int.cuh), so the variants it selects are not in the binary. */
#define OPT(n, d, l, h, doc) {#n, offsetof(qf_cuda_opts, n), d, l, h, 0, doc}
#define LAB(n, l, h, doc) {#n, offsetof(qf_cuda_opts, n), QF_LAB_DEF_##n, l, h, 1, doc}
static const opt_def k_opts[] = {
    OPT(graphs, 1, 0, 1, "decode steps of up to 64 rows (other steps up to 16) recorded once and replayed as CUDA graphs"),
    LAB(pdl, 0, 1, "a graph's kernels chained by programmatic dependent launch (sm_90)"),
    LAB(early, 0, 1, "decode kernels ask for their first weights before waiting for the kernel before"),
    LAB(pw1, 0, 1, "one-row products of few weight rows take a warp per row (0: two rows a warp)"),
    OPT(bulk, 8, 0, 15, "one-row products fed by bulk copies (sm_90), a mask: 1 out_proj, 2 lm_head, 4 ffn_in, 8 in_proj"),
    OPT(bulk_blocks, 2, 1, 2, "blocks per SM of the bulk-copy products"),
    LAB(gdn_lpc, 2, 8, "lanes per value column in the one-token DeltaNet step (2, 4 or 8)"),
    LAB(gdn_gn, 0, 1, "the one-token DeltaNet step applies out_proj's gated norm to its output"),
    LAB(moe1, 0, 1, "a one-row MoE block as one kernel (0: gate/up and down kernels)"),
    LAB(moe_pf, 0, 1, "the one-kernel MoE copies its expert table to shared memory first"),
    LAB(route, 2, 3, "one-row MoE routing: 3 sorting networks (E <= 256, top-k <= 8), 2 all-pairs ranking"),
    LAB(att1, 0, 1, "decode attention in one kernel, the last split of a head combining (0: two kernels)"),
    LAB(att_gate, 0, 1, "decode attention applies the output gate (0: o_proj does)"),
    LAB(comb, 0, 1, "decode attention loads every split's partial sums in one round"),
    LAB(mg, 0, 1, "many-row MoE grouped by expert on the tensor cores (0: a product per row and expert)"),
    OPT(mg_min, -1, -1, 1 << 20, "rows from which the MoE is grouped by expert (-1: 96; 192 in a lab build with mg_cp=0)"),
    LAB(mg_cp, 0, 1, "the grouped MoE's weights staged by cp.async (0: loaded into registers)"),
    LAB(mg_p64, 0, 1, "the grouped MoE takes 64 rows a pass once experts average more than 24 (0: 32)"),
    OPT(dec_tc, 5, 1, 1 << 20, "decode steps of this many rows and more take their products on the tensor cores (fewer: the GEMV kernels)"),
    LAB(att_tile, 0, 1, "prompt attention as tiles of 64 queries sharing a kv head (0: a block per query and head)"),
    LAB(att_tc, 0, 1, "the tiles' products on the tensor cores as bf16 hi + lo parts (0: fp32 FMAs)"),
    LAB(gdn_chunk, 0, 1, "a prompt's DeltaNet in chunks of 64 tokens, the WY form (0: token by token)"),
    OPT(gdn_chunk_min, 32, 1, 1 << 20, "tokens from which the chunked DeltaNet runs"),
    LAB(gdn_seq, 0, 1, "token-by-token DeltaNet as a block per head (1) instead of lanes per state column"),
    LAB(gdn_plpc, 1, 8, "lanes per state column of the token-by-token DeltaNet (1, 2, 4 or 8)"),
    LAB(gdn_cp, 0, 1, "the token-by-token DeltaNet stages its inputs by cp.async a round ahead"),
    OPT(profile, 0, 0, 1, "diagnosis: every kernel timed (graphs off), the sums printed at exit"),
    OPT(steptime, 0, 0, 1, "diagnosis: replayed steps timed, GPU and host means printed at exit"),
    OPT(link_gbps, 0, 0, 1000, "measurement: the host link capped at this many GB/s (25: PCIe 4.0 x16); experts moved pay the slower link's time (0: off)"),
};
#define N_OPTS (sizeof k_opts / sizeof *k_opts)

static int *field(qf_cuda_opts *o, const opt_def *d) { return (int *)((char *)o + d->off); }

void qf_cuda_opts_default(qf_cuda_opts *o) {
    memset(o, 0, sizeof *o);
    o->precision = QF_PREC_BF16X2;
    for (size_t i = 0; i < N_OPTS; i++) *field(o, &k_opts[i]) = k_opts[i].def;
}

int qf_cuda_opts_set(qf_cuda_opts *o, const char *as) {
    const char *eq = strchr(as, '=');
    size_t n = eq ? (size_t)(eq - as) : strlen(as);
    for (size_t i = 0; i < N_OPTS; i++) {
        const opt_def *d = &k_opts[i];
        if (strlen(d->name) != n || strncmp(d->name, as, n) != 0) continue;
        if (d->lab && !QF_CUDA_LAB_BUILD)
            return qf_fail(QF_EINVAL, "CUDA option '%s' selects a lab variant: it is set only in a lab build (-DQFLASH_LAB=ON)", d->name);
        char *end = NULL;
        long v = eq ? strtol(eq + 1, &end, 0) : 0;
        if (!eq || end == eq + 1 || *end || v < d->lo || v > d->hi)
            return qf_fail(QF_EINVAL, "CUDA option '%s' takes an integer %d..%d, not '%s'", d->name, d->lo, d->hi, eq ? eq + 1 : "");
        *field(o, d) = (int)v;
        return QF_OK;
    }
    return qf_fail(QF_EINVAL, "unknown CUDA option '%.*s' (--cuda-opt help lists them)", (int)n, as);
}

int qf_cuda_opt_is_lab(const char *as) {
    size_t n = strcspn(as, "=");
    for (size_t i = 0; i < N_OPTS; i++)
        if (strlen(k_opts[i].name) == n && strncmp(k_opts[i].name, as, n) == 0) return k_opts[i].lab;
    return 0;
}

int qf_cuda_opts_from_env(qf_cuda_opts *o) {
    const char *env = getenv("QFLASH_CUDA_OPTS");
    if (!env || !*env) return QF_OK;
    char buf[1024];
    if (strlen(env) >= sizeof buf) return qf_fail(QF_EINVAL, "QFLASH_CUDA_OPTS is longer than %zu bytes", sizeof buf - 1);
    strcpy(buf, env);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int rc = qf_cuda_opts_set(o, t);
        if (rc != QF_OK) return qf_fail(rc, "QFLASH_CUDA_OPTS: %s", qf_last_error());
    }
    return QF_OK;
}

static const char *const k_prec[] = {"bf16x2", "fp32", "bf16"};

int qf_cuda_precision_parse(const char *name) {
    for (int i = 0; i < 3; i++)
        if (strcmp(name, k_prec[i]) == 0) return i;
    return -1;
}

const char *qf_cuda_precision_name(int p) { return p >= 0 && p < 3 ? k_prec[p] : "?"; }

void qf_cuda_opts_print(FILE *f, const qf_cuda_opts *o) {
    if (o) fprintf(f, "cuda options: precision=%s", qf_cuda_precision_name(o->precision));
    for (size_t i = 0; i < N_OPTS; i++) {
        const opt_def *d = &k_opts[i];
        if (d->lab && !QF_CUDA_LAB_BUILD) continue;
        if (o) fprintf(f, " %s=%d", d->name, *field((qf_cuda_opts *)o, d));
        else fprintf(f, "  %-14s default %-3d %s\n", d->name, d->def, d->doc);
    }
    if (o) fputc('\n', f);
}
