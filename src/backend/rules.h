/* The rules every backend and the model follow alike, each a plain reference: reading a weight,
 * the MoE routing and sparsity's expert and KV-page rules. A backend's own kernels are tested against these; the
 * model applies them where it runs the host side of a step. */
#ifndef QF_BACKEND_RULES_H
#define QF_BACKEND_RULES_H

#include <stdint.h>

#include "backend/ops.h"

/* Element (r, c) of a weight in host memory, whatever its format: how every reference reads weights. */
float qf_mat_weight(const qf_mat *w, int64_t r, int64_t c);

/* The reference routing of one row of E router logits: softmax over all E, the top K (ties to the
 * lower index), their weights renormalised to sum 1 (fp32). ti, tw: K entries, best first. Every
 * backend's routing is checked against it. */
void qf_ref_route(const float *logits, int E, int K, int *ti, float *tw);
/* Sparsity's expert rule on one row of qf_ref_route's weights (tw, best first): the first
 * max(min_k, #{w >= tau}) are kept and renormalised to sum 1; returns how many. */
int qf_ref_route_drop(float *tw, int K, float tau, int min_k);

/* Sparsity's KV-page rule (Quest): a page's keys summarised per channel by their min and max
 * (kmin, kmax: [hd] each, over its first n keys of hd floats, rows stride apart) ... */
void qf_ref_page_summary(const float *keys, int n, int stride, int hd, float *kmin, float *kmax);
/* ... bound q's score on every key of the page from above: sum over channels of the larger of
 * q_c kmin_c and q_c kmax_c; for a token's nh query heads (head h at q + h * q_hstride, reading kv
 * head h / (nh / nkv); kmin, kmax: [nkv][hd]) the page's score is the largest of its heads'
 * bounds. A token attends to at most budget of n_pages pages: the first and the last (the newest
 * keys) always, then those of the highest scores (ties to the lower page); out gets them in
 * ascending order, the count is returned. */
float qf_ref_page_bound(const float *q, const float *kmin, const float *kmax, int hd);
float qf_ref_page_score(const float *q, int nh, int q_hstride, int nkv, const float *kmin, const float *kmax, int hd);
int qf_ref_page_select(const float *score, int n_pages, int budget, int32_t *out);

#endif
