/* The forward scratch: one float block carved into named regions (offsets in floats), plus ints
 * for routing. Sized once for max_rows tokens; nothing is allocated while tokens run. */
#ifndef QF_MODEL_WORKSPACE_H
#define QF_MODEL_WORKSPACE_H

#include <stddef.h>

#include "model/model.h"

struct qf_workspace {
    qf_backend *dev; /* where f lives (NULL: host) */
    int max_rows, max_logit_rows, hidden;
    float *f;
    size_t f_bytes;
    float *px;     /* (px_tokens, hidden): a long prompt's hidden states, layer by layer (may be NULL) */
    int px_tokens;
    /* on the host, with px: a layer's MoE over the whole prompt at once (forward_layered), its
     * inputs and outputs (px_tokens, hidden), choices (px_tokens, top_k) and groups by expert */
    float *pxn, *pmo, *ptopw, *pasw;
    int *ptopi, *pasr, *pcounts;
    int top_k, n_experts;
    size_t x_off, xn_off, tmp_off, big_off, conv_off, kb_off, vb_off, z_off, bb_off, aa_off, core_off;
    size_t rl_off, topw_off, asw_off, ex_in_off, ex_g_off, ex_u_off, ex_h_off, ex_out_off, moe_off, shs_off;
    size_t lrows_off, lg_off, att_off;
    size_t dec_off, drl_off, amax_off; /* decode steps through the fused ops: products, ffn_in rows, picks */
    int *ints;
    int *topi;     /* (rows, k) chosen experts */
    int *asr;      /* (rows * k) rows grouped by expert */
    int *counts;   /* (n_experts + 1) group starts */
    int *lrow_src; /* (rows) rows whose logits are wanted */
    qf_hidden_hook hook;
    void *hook_ud;
    qf_route_hook route_hook;
    void *route_ud;
    qf_act_hook act_hook;
    void *act_ud;
    float *act_host;   /* on a device: the hook's host copy of a group's input (act_floats floats) */
    size_t act_floats;
    qf_sparsity_counts sparsity; /* what sparsity skipped, counted as steps run (host path) */
    qf_ep *ep;         /* expert parallel: this rank's share of every MoE layer's experts (host path; NULL: all here) */
};

#define WS(ws, name) ((ws)->f + (ws)->name##_off)
#define ATT_SCRATCH_ROWS 256 /* (query, head) pairs whose keys may be split 16 ways */

#endif
