/* The reference CPU ops: plain loops in the order of docs/model-spec.md, single-threaded, never
 * optimised. Every other backend is tested against these. */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_int.h"
#include "base/dtype.h"
#include "base/numeric.h"
#include "base/quant.h"
#include "backend/rules.h"

static void ref_matmul(qf_backend *be, const qf_mat *w, const float *x, int n, float *y) {
    (void)be;
    for (int t = 0; t < n; t++)
        for (int64_t o = 0; o < w->rows; o++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < w->cols; i++) acc += x[t * w->cols + i] * qf_mat_weight(w, o, i);
            y[t * w->rows + o] = acc;
        }
}

/* Per output, the sum over the inputs in order with the zero ones skipped: ref_matmul of the same
 * input, bit for bit (a zero adds +-0). */
static void ref_matmul_cols(qf_backend *be, const qf_mat *wt, const float *x, int n, float *y) {
    (void)be;
    for (int t = 0; t < n; t++)
        for (int64_t o = 0; o < wt->cols; o++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < wt->rows; i++)
                if (x[t * wt->rows + i] != 0.0f) acc += x[t * wt->rows + i] * qf_mat_weight(wt, i, o);
            y[t * wt->cols + o] = acc;
        }
}

void qf_ref_embed(qf_backend *be, const qf_mat *emb, const int32_t *ids, int n, float *y) {
    (void)be;
    for (int t = 0; t < n; t++)
        for (int64_t i = 0; i < emb->cols; i++) y[t * emb->cols + i] = qf_mat_weight(emb, ids[t], i);
}

void qf_ref_rmsnorm(qf_backend *be, const float *x, int x_stride, const float *w, int n_rows, int dim,
                    float eps, float *y, int y_stride) {
    (void)be;
    for (int r = 0; r < n_rows; r++) {
        const float *xr = x + (int64_t)r * x_stride;
        float *yr = y + (int64_t)r * y_stride;
        float ss = 0.0f;
        for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) yr[i] = xr[i] * inv * (w ? w[i] : 1.0f);
    }
}

void qf_ref_rope(qf_backend *be, float *x, int stride, int head_stride, int T, int n_heads, int rot,
                 int pos0, const float *inv_freq) {
    (void)be;
    int half = rot / 2;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (int64_t)t * stride + (int64_t)h * head_stride;
            for (int i = 0; i < half; i++) {
                float ang = (float)(pos0 + t) * inv_freq[i];
                float c = cosf(ang), s = sinf(ang);
                float a = v[i], b = v[i + half];
                v[i] = a * c - b * s;
                v[i + half] = b * c + a * s;
            }
        }
}

void qf_ref_conv_silu(qf_backend *be, const float *x, int x_stride, int T, int C, int K, const float *w,
                      float *state, float *y) {
    (void)be;
    for (int c = 0; c < C; c++) {
        for (int t = 0; t < T; t++) {
            float acc = 0.0f;
            for (int j = 0; j < K; j++) {
                int src = t - (K - 1) + j; /* token index; negative reaches into the state */
                float xv = src >= 0 ? x[(int64_t)src * x_stride + c] : state[(int64_t)(K - 1 + src) * C + c];
                acc += w[c * K + j] * xv;
            }
            y[(int64_t)t * C + c] = qf_silu(acc);
        }
        /* the new state is the last K-1 inputs, older ones from the old state when T < K-1 */
        float hist[16];
        int n_hist = K - 1;
        for (int j = 0; j < n_hist; j++) {
            int src = T - n_hist + j;
            hist[j] = src >= 0 ? x[(int64_t)src * x_stride + c] : state[(int64_t)(n_hist + src) * C + c];
        }
        for (int j = 0; j < n_hist; j++) state[(int64_t)j * C + c] = hist[j];
    }
}

void qf_ref_l2norm(const float *x, int n, float scale, float *y) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = scale / sqrtf(ss + 1e-6f);
    for (int i = 0; i < n; i++) y[i] = x[i] * inv;
}

/* The token-by-token gated delta rule of docs/model-spec.md §5.6. */
static void ref_gdn(qf_backend *be, const qf_gdn_args *a) {
    (void)be;
    float qn[512], kn[512], u[512];
    int ratio = a->nv / a->nk;
    float qscale = 1.0f / sqrtf((float)a->dk);
    for (int t = 0; t < a->T; t++)
        for (int h = 0; h < a->nv; h++) {
            int kh = h / ratio;
            qf_ref_l2norm(a->q + (int64_t)t * a->stride + kh * a->dk, a->dk, qscale, qn);
            qf_ref_l2norm(a->k + (int64_t)t * a->stride + kh * a->dk, a->dk, 1.0f, kn);
            const float *v = a->v + (int64_t)t * a->stride + h * a->dv;
            float *S = a->S + (int64_t)h * a->dk * a->dv;
            float decay = expf(a->g[t * a->nv + h]), beta = a->beta[t * a->nv + h];
            for (int i = 0; i < a->dk * a->dv; i++) S[i] *= decay;
            for (int j = 0; j < a->dv; j++) {
                u[j] = 0.0f;
                for (int i = 0; i < a->dk; i++) u[j] += S[i * a->dv + j] * kn[i];
            }
            for (int j = 0; j < a->dv; j++) u[j] = beta * (v[j] - u[j]);
            for (int i = 0; i < a->dk; i++)
                for (int j = 0; j < a->dv; j++) S[i * a->dv + j] += kn[i] * u[j];
            float *o = a->out + ((int64_t)t * a->nv + h) * a->dv;
            for (int j = 0; j < a->dv; j++) {
                o[j] = 0.0f;
                for (int i = 0; i < a->dk; i++) o[j] += S[i * a->dv + j] * qn[i];
            }
        }
}

/* Online softmax over keys, one query head at a time. */
static void ref_attention(qf_backend *be, const qf_attn_args *a) {
    (void)be;
    int group = a->nh / a->nkv;
    for (int t = 0; t < a->T; t++)
        for (int h = 0; h < a->nh; h++) {
            const float *q = a->q + (int64_t)t * a->q_stride + (int64_t)h * a->q_hstride;
            float *o = a->out + ((int64_t)t * a->nh + h) * a->hd;
            int kvh = h / group;
            float m = -INFINITY, l = 0.0f;
            for (int i = 0; i < a->hd; i++) o[i] = 0.0f;
            for (int j = 0; j <= a->pos0 + t; j++) {
                const float *k = qf_kv_row(&a->kv, j, a->nkv, a->hd, kvh, 0);
                const float *v = qf_kv_row(&a->kv, j, a->nkv, a->hd, kvh, 1);
                float s = 0.0f;
                for (int i = 0; i < a->hd; i++) s += q[i] * k[i];
                s *= a->scale;
                float m_new = s > m ? s : m;
                float corr = expf(m - m_new), p = expf(s - m_new);
                l = l * corr + p;
                for (int i = 0; i < a->hd; i++) o[i] = o[i] * corr + p * v[i];
                m = m_new;
            }
            for (int i = 0; i < a->hd; i++) o[i] /= l;
        }
}

void qf_ref_kv_store(qf_backend *be, const qf_kv_view *kv, const float *k, const float *v, int T, int pos0, int nkv, int hd) {
    (void)be;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < nkv; h++) {
            size_t src = ((size_t)t * nkv + h) * hd;
            memcpy(qf_kv_row(kv, pos0 + t, nkv, hd, h, 0), k + src, (size_t)hd * sizeof(float));
            memcpy(qf_kv_row(kv, pos0 + t, nkv, hd, h, 1), v + src, (size_t)hd * sizeof(float));
        }
}

void qf_ref_gdn_gates(qf_backend *be, float *b, float *a, const float *dt_bias, const float *neg_A, int n, int nv) {
    (void)be;
    for (int i = 0; i < n * nv; i++) {
        int h = i % nv;
        float u = a[i] + dt_bias[h];
        b[i] = 1.0f / (1.0f + expf(-b[i]));
        a[i] = neg_A[h] * (u > 20.0f ? u : log1pf(expf(u)));
    }
}

void qf_ref_sigmoid_scale_add(qf_backend *be, float *y, const float *x, const float *g, int n, int d) {
    (void)be;
    for (int r = 0; r < n; r++) {
        float s = 1.0f / (1.0f + expf(-g[r]));
        for (int i = 0; i < d; i++) y[(int64_t)r * d + i] += x[(int64_t)r * d + i] * s;
    }
}

void qf_ref_swiglu(qf_backend *be, const float *g, const float *u, int stride, int n, int d, float *y) {
    (void)be;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < d; i++) y[t * d + i] = qf_silu(g[t * stride + i]) * u[t * stride + i];
}

void qf_ref_sigmoid_mul(qf_backend *be, float *x, int x_stride, const float *g, int g_stride, int n, int d) {
    (void)be;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < d; i++) x[(int64_t)t * x_stride + i] *= qf_sigmoid(g[(int64_t)t * g_stride + i]);
}

void qf_ref_axpy(qf_backend *be, float *y, const float *a, float s, int64_t n) {
    (void)be;
    for (int64_t i = 0; i < n; i++) y[i] += a[i] * s;
}

/* Pages p0..p1-1 of the view, each kv head's keys summarised. */
void qf_ref_kv_summarize(qf_backend *be, const qf_kv_view *kv, int p0, int p1, int nkv, int hd) {
    (void)be;
    for (int p = p0; p < p1; p++) {
        float *page = kv->base + (size_t)kv->pages[p] * kv->page_stride;
        for (int h = 0; h < nkv; h++)
            qf_ref_page_summary(page + kv->k_off + (size_t)h * hd, kv->page_tokens, nkv * hd, hd, page + kv->s_off + (size_t)h * hd,
                                page + kv->s_off + (size_t)(nkv + h) * hd);
    }
}

const qf_ops qf_cpu_ops_ref = {
    .name = "cpu-ref",
    .matmul = ref_matmul,
    .matmul_cols = ref_matmul_cols,
    .embed = qf_ref_embed,
    .rmsnorm = qf_ref_rmsnorm,
    .rope = qf_ref_rope,
    .conv_silu = qf_ref_conv_silu,
    .gdn = ref_gdn,
    .attention = ref_attention,
    .kv_store = qf_ref_kv_store,
    .kv_summarize = qf_ref_kv_summarize,
    .swiglu = qf_ref_swiglu,
    .sigmoid_mul = qf_ref_sigmoid_mul,
    .axpy = qf_ref_axpy,
    .gdn_gates = qf_ref_gdn_gates,
    .sigmoid_scale_add = qf_ref_sigmoid_scale_add,
};
