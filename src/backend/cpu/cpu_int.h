/* Shared within backend/cpu: the reference ops, which the SIMD tables reuse for the ops they do
 * not accelerate. */
#ifndef QF_BACKEND_CPU_INT_H
#define QF_BACKEND_CPU_INT_H

#include "backend/ops.h"
#include "backend/rules.h"

void qf_ref_embed(qf_backend *be, const qf_mat *emb, const int32_t *ids, int n, float *y);
void qf_ref_rmsnorm(qf_backend *be, const float *x, int x_stride, const float *w, int n_rows, int dim,
                    float eps, float *y, int y_stride);
void qf_ref_rope(qf_backend *be, float *x, int stride, int head_stride, int T, int n_heads, int rot,
                 int pos0, const float *inv_freq);
void qf_ref_conv_silu(qf_backend *be, const float *x, int x_stride, int T, int C, int K, const float *w,
                      float *state, float *y);
void qf_ref_kv_summarize(qf_backend *be, const qf_kv_view *kv, int p0, int p1, int nkv, int hd);
void qf_ref_kv_store(qf_backend *be, const qf_kv_view *kv, const float *k, const float *v, int T, int pos0, int nkv, int hd);
void qf_ref_swiglu(qf_backend *be, const float *g, const float *u, int stride, int n, int d, float *y);
void qf_ref_sigmoid_mul(qf_backend *be, float *x, int x_stride, const float *g, int g_stride, int n, int d);
void qf_ref_gdn_gates(qf_backend *be, float *b, float *a, const float *dt_bias, const float *neg_A, int n, int nv);
void qf_ref_sigmoid_scale_add(qf_backend *be, float *y, const float *x, const float *g, int n, int d);
void qf_ref_axpy(qf_backend *be, float *y, const float *a, float s, int64_t n);
/* y = x * scale / sqrt(sum x^2 + 1e-6): the delta rule's q and k normalisation */
void qf_ref_l2norm(const float *x, int n, float scale, float *y);

static inline float qf_silu(float x) { return x / (1.0f + expf(-x)); }
static inline float qf_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

#endif
