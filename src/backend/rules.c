#include "backend/rules.h"

#include <math.h>
#include <stddef.h>

#include "base/numeric.h"
#include "base/quant.h"

float qf_mat_weight(const qf_mat *w, int64_t r, int64_t c) {
    int64_t i = r * w->cols + c;
    if (qf_is_quant(w->dtype)) return qf_q_weight(w->dtype, w->data, w->scales, w->cols, r, c);
    switch (w->dtype) {
    case QF_DT_BF16: return qf_bf16_to_f32(((const uint16_t *)w->data)[i]);
    case QF_DT_F16: return qf_f16_to_f32(((const uint16_t *)w->data)[i]);
    default: return ((const float *)w->data)[i];
    }
}

void qf_ref_route(const float *l, int E, int K, int *ti, float *tw) {
    float mx = l[0], sum = 0.0f, top_sum = 0.0f;
    for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
    for (int e = 0; e < E; e++) sum += expf(l[e] - mx);
    for (int k = 0; k < K; k++) { /* k passes: K is small */
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= ti[j] == e;
            if (!taken && (best < 0 || l[e] > l[best])) best = e;
        }
        ti[k] = best;
        tw[k] = expf(l[best] - mx) / sum;
        top_sum += tw[k];
    }
    for (int k = 0; k < K; k++) tw[k] /= top_sum;
}

int qf_ref_route_drop(float *tw, int K, float tau, int min_k) {
    int k = 0;
    while (k < K && (k < min_k || tw[k] >= tau)) k++;
    if (k == K) return K; /* nothing dropped: the weights stay exactly as routed */
    float sum = 0.0f;
    for (int j = 0; j < k; j++) sum += tw[j];
    for (int j = 0; j < K; j++) tw[j] = j < k ? tw[j] / sum : 0.0f;
    return k;
}

void qf_ref_page_summary(const float *keys, int n, int stride, int hd, float *kmin, float *kmax) {
    for (int c = 0; c < hd; c++) kmin[c] = INFINITY, kmax[c] = -INFINITY;
    for (int t = 0; t < n; t++)
        for (int c = 0; c < hd; c++) {
            float k = keys[(size_t)t * stride + c];
            kmin[c] = k < kmin[c] ? k : kmin[c];
            kmax[c] = k > kmax[c] ? k : kmax[c];
        }
}

float qf_ref_page_bound(const float *q, const float *kmin, const float *kmax, int hd) {
    float b = 0.0f;
    for (int c = 0; c < hd; c++) {
        float lo = q[c] * kmin[c], hi = q[c] * kmax[c];
        b += lo > hi ? lo : hi;
    }
    return b;
}

float qf_ref_page_score(const float *q, int nh, int q_hstride, int nkv, const float *kmin, const float *kmax, int hd) {
    float best = -INFINITY;
    for (int h = 0; h < nh; h++) {
        int g = h / (nh / nkv);
        float b = qf_ref_page_bound(q + (size_t)h * q_hstride, kmin + (size_t)g * hd, kmax + (size_t)g * hd, hd);
        best = b > best ? b : best;
    }
    return best;
}

int qf_ref_page_select(const float *score, int n_pages, int budget, int32_t *out) {
    if (budget >= n_pages || n_pages <= 2) {
        for (int p = 0; p < n_pages; p++) out[p] = p;
        return n_pages;
    }
    if (budget < 2) budget = 2;
    int n = 0;
    for (int p = 1; p < n_pages - 1; p++) { /* a middle page is in when fewer than budget - 2 others come before it */
        int ahead = 0;
        for (int o = 1; o < n_pages - 1 && ahead < budget - 2; o++)
            ahead += o != p && (score[o] > score[p] || (score[o] == score[p] && o < p)); /* the higher score first, then the lower page */
        if (ahead < budget - 2) out[1 + n++] = p;
    }
    out[0] = 0;
    out[1 + n] = n_pages - 1;
    return n + 2;
}
