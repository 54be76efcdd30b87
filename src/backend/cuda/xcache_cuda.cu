// The device expert cache (ops.h qf_xcache): before a MoE op, one block resolves the step's chosen
// experts against the layer's slots by the integer policy of experts/cache_policy.c, then a grid
// copies the admitted misses from pinned host memory into their slots. Both are kernels in the
// step's stream (and its graph): a hit costs no host round trip, a miss costs its bytes over the
// link, read by the SMs straight from the mapped host memory.
#include "backend/cuda/dec_int.cuh"

namespace qfc {

#define XC_MAX_E 512
#define XC_MAX_IDS 1024 // routed ids the block holds at once (decode: 64 rows of top-8, 16 of top-64)

struct xc_state {
    unsigned long long *ctr;
    uint32_t *hdr; // now, used, n_fill
    uint32_t *slot1_of, *expert1_in, *last, *count, *count_at, *fill_e, *fill_s;
};

__device__ xc_state xc_map(const qf_xcache &x) {
    xc_state s;
    uint32_t *w = (uint32_t *)x.state;
    int E = x.n_experts, S = x.n_slots;
    s.ctr = x.counters, s.hdr = w;
    s.slot1_of = w + QF_XC_HEAD_WORDS, s.expert1_in = s.slot1_of + E, s.last = s.expert1_in + S, s.count = s.last + S;
    s.count_at = s.count + E, s.fill_e = s.count_at + E, s.fill_s = s.fill_e + S;
    return s;
}

// Shared copies of the layer's state while the block works on it.
struct xc_shared {
    int slot_of[XC_MAX_E], expert_in[XC_MAX_E], order[XC_MAX_E], vict[XC_MAX_E], first[XC_MAX_E];
    uint32_t last[XC_MAX_E], count[XC_MAX_E], count_at[XC_MAX_E];
    int ids[XC_MAX_IDS];
    int host[XC_MAX_E]; // 1: the host computes this expert this step
    int n_order, n_vict, n_fill;
};

__device__ __forceinline__ uint32_t xc_count_now(const xc_shared &s, uint32_t now, int hl, int e) {
    uint32_t h = now / (uint32_t)hl - s.count_at[e] / (uint32_t)hl;
    return h >= 32 ? 0u : s.count[e] >> h;
}

// cache_policy.c's leaves_first for LRU and the frequency policies.
__device__ __forceinline__ bool xc_leaves_first(const xc_shared &s, const qf_xcache &x, uint32_t now, int a, int b) {
    if (x.policy != QF_POLICY_LRU) {
        uint32_t ca = xc_count_now(s, now, x.half_life, s.expert_in[a]), cb = xc_count_now(s, now, x.half_life, s.expert_in[b]);
        if (ca != cb) return ca < cb;
    }
    if (s.last[a] != s.last[b]) return s.last[a] < s.last[b];
    return a < b;
}

// Row r's top K of E logits into ids (rank order, ties to the lower index): each thread ranks its
// logits against all E. NaN logits rank nothing: their places keep ids 0..K-1, valid experts.
__device__ void xc_route_row(const float *rl, int E, int K, int *ids, float *lv) {
    int tid = threadIdx.x;
    if (tid < K) ids[tid] = tid;
    for (int i = tid; i < E; i += blockDim.x) lv[i] = rl[i];
    __syncthreads();
    for (int i = tid; i < E; i += blockDim.x) {
        float v = lv[i];
        int r = 0;
        for (int j = 0; j < E; j++) r += lv[j] > v || (lv[j] == v && j < i);
        if (r < K) ids[r] = i;
    }
    __syncthreads();
}

// Sparsity's expert rule on row r's ids (thread 0; the weights as the MoE kernels take them from
// the chosen logits): a dropped expert's place repeats the first id, so it is neither counted nor
// loaded. A borderline weight decided otherwise here than in the MoE kernel costs only a read from
// home: every table entry is valid.
__device__ void xc_drop_row(int *ids, const float *lv, int K, float tau, int min_k) {
    if (threadIdx.x != 0 || tau <= 0.0f) return;
    float p[64], sum = 0.0f;
    for (int k = 0; k < K; k++) sum += p[k] = expf(lv[ids[k]] - lv[ids[0]]);
    int kept = 0;
    while (kept < K && (kept < min_k || p[kept] / sum >= tau)) kept++;
    for (int k = kept; k < K; k++) ids[k] = ids[0];
}

// The step's ids in order of first appearance into s.order (distinct), counts bumped, hits marked.
__device__ void xc_hits(xc_shared &s, const qf_xcache &x, const int *ids, int n, uint32_t now) {
    int E = x.n_experts, tid = threadIdx.x;
    for (int e = tid; e < E; e += blockDim.x) s.first[e] = 0x7fffffff;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) atomicMin(&s.first[ids[i]], i);
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        if (s.first[e] == 0x7fffffff) continue;
        int r = 0; // its place among the distinct ids
        for (int f = 0; f < E; f++) r += s.first[f] < s.first[e];
        s.order[r] = e;
        uint32_t c = xc_count_now(s, now, x.half_life, e);
        s.count[e] = c > 0xffffffffu - QF_COUNT_ONE ? 0xffffffffu : c + QF_COUNT_ONE;
        s.count_at[e] = now;
        if (s.slot_of[e] >= 0) s.last[s.slot_of[e]] = now;
    }
    if (tid == 0) s.n_order = 0;
    __syncthreads();
    if (tid == 0)
        for (int e = 0; e < E; e++) s.n_order += s.first[e] != 0x7fffffff;
    __syncthreads();
}

// The slots not used this step, ranked by how soon they leave, into s.vict.
__device__ void xc_victims(xc_shared &s, const qf_xcache &x, uint32_t used, uint32_t now) {
    int tid = threadIdx.x;
    if (tid == 0) s.n_vict = 0;
    __syncthreads();
    for (int a = tid; a < (int)used; a += blockDim.x) {
        if (s.last[a] == now) continue;
        int r = 0;
        for (int b = 0; b < (int)used; b++) r += b != a && s.last[b] != now && xc_leaves_first(s, x, now, b, a);
        s.vict[r] = a;
        atomicAdd(&s.n_vict, 1);
    }
    __syncthreads();
}

// Thread 0, with hybrid on: the last step's host experts point home again (unless admitted
// since), whatever this step is; a hybrid step's host share of its misses is counted.
__device__ int xc_host_begin(xc_shared &s, const qf_xcache &x, int host) {
    int32_t *prev = x.host_words, E = x.n_experts, m0 = 0;
    if (!prev) return 0;
    for (int i = 0; i < prev[0]; i++) {
        int e = prev[1 + i];
        if (s.slot_of[e] < 0)
            for (int m = 0; m < 3; m++) x.tab[m * E + e] = x.home[m * E + e];
    }
    prev[0] = 0;
    if (!host) return 0;
    for (int i = 0; i < s.n_order; i++) m0 += s.slot_of[s.order[i]] < 0;
    int hmax = (int)ceilf(x.host_share * (float)m0 - x.host_fixed);
    return hmax < 0 ? 0 : hmax < QF_XC_HOST_MAX ? hmax : QF_XC_HOST_MAX;
}

// A declined miss to the host: its table entries at the zeros, remembered for the next step.
__device__ void xc_to_host(xc_shared &s, const qf_xcache &x, int e) {
    int32_t *prev = x.host_words;
    s.host[e] = 1;
    x.job->host_ids[prev[0]] = e, prev[1 + prev[0]++] = e;
    for (int m = 0; m < 3; m++) x.tab[m * x.n_experts + e] = x.zero + x.off[m];
}

// Thread 0: the misses in order take free slots, then victims in rank order when admitted; with
// host, up to its share of the declined go to the host.
__device__ void xc_assign(xc_shared &s, const qf_xcache &x, xc_state &g, uint32_t now, int host) {
    uint32_t used = g.hdr[1];
    int nv = 0, nf = 0, hmax = xc_host_begin(s, x, host), admit_none = hmax && x.host_share >= 1.0f; // share 1: the host takes every miss it has room for
    unsigned long long misses = 0, declined = 0;
    for (int i = 0; i < s.n_order; i++) {
        int e = s.order[i], slot = -1;
        if (s.slot_of[e] >= 0) continue;
        misses++;
        if (admit_none) { // declined below, to the host
        } else if (used < (uint32_t)x.n_slots) {
            slot = (int)used++;
        } else if (nv < s.n_vict) {
            int v = s.vict[nv], old = s.expert_in[v];
            bool admit = x.policy != QF_POLICY_DLFU_AD || xc_count_now(s, now, x.half_life, e) > xc_count_now(s, now, x.half_life, old);
            if (admit) {
                slot = v, nv++;
                s.slot_of[old] = -1;
                for (int m = 0; m < 3; m++) x.tab[m * x.n_experts + old] = x.home[m * x.n_experts + old];
            }
        }
        if (slot < 0) {
            declined++;
            if (hmax && x.host_words[0] < hmax) xc_to_host(s, x, e);
            continue;
        }
        s.expert_in[slot] = e, s.slot_of[e] = slot, s.last[slot] = now;
        g.fill_e[nf] = (uint32_t)e, g.fill_s[nf] = (uint32_t)slot, nf++;
        for (int m = 0; m < 3; m++) x.tab[m * x.n_experts + e] = x.slots + (size_t)slot * x.slot_bytes + x.off[m];
    }
    int hosted = hmax ? x.host_words[0] : 0;
    if (host) x.job->n_host = hosted;
    g.hdr[1] = used, g.hdr[2] = (uint32_t)nf, g.hdr[3] = (uint32_t)(misses - (unsigned long long)hosted); // experts over the link this step
    g.ctr[QF_XC_MISSES] += misses, g.ctr[QF_XC_DECLINED] += declined;
    g.ctr[QF_XC_HITS] += (unsigned long long)(s.n_order) - misses;
}

// One block: the step's routed ids (ids, n of them; or, with rl, rows routed here from their
// logits) resolved as qf_slot_cache_access does, then the step's tick.
__global__ void __launch_bounds__(512) k_xc_resolve(qf_xcache x, const int *ids, int n, const float *rl, int rl_stride, int rows, int K, xc_drop drop,
                                                    int host) {
    __shared__ xc_shared s;
    __shared__ float lv[XC_MAX_E];
    xc_state g = xc_map(x);
    int E = x.n_experts, S = x.n_slots, tid = threadIdx.x;
    uint32_t now = g.hdr[0];
    for (int e = tid; e < E; e += blockDim.x)
        s.slot_of[e] = (int)g.slot1_of[e] - 1, s.count[e] = g.count[e], s.count_at[e] = g.count_at[e];
    for (int i = tid; i < S; i += blockDim.x) s.expert_in[i] = (int)g.expert1_in[i] - 1, s.last[i] = g.last[i];
    for (int e = tid; e < E; e += blockDim.x) s.host[e] = 0;
    if (rl) { // decode: the rows' ids are routed here (the MoE kernel routes again, the same way)
        for (int r = 0; r < rows; r++) {
            xc_route_row(rl + (int64_t)r * rl_stride, E, K, s.ids + r * K, lv);
            xc_drop_row(s.ids + r * K, lv, K, drop.tau[r], drop.min_k);
            __syncthreads();
        }
        ids = s.ids, n = rows * K;
    }
    __syncthreads();
    xc_hits(s, x, ids, n, now);
    xc_victims(s, x, g.hdr[1], now);
    if (tid == 0) xc_assign(s, x, g, now, host), g.hdr[0] = now + 1;
    __syncthreads();
    int32_t *chosen = x.host_words + 1 + QF_XC_HOST_MAX;
    for (int i = tid; host && i < n; i += blockDim.x) { // the job's choices; the chosen ids for k_xc_host_job's weights
        int r = i / K, k = i - r * K;
        chosen[r * QF_XC_K + k] = ids[i];
        x.job->ids[i] = s.host[ids[i]] ? ids[i] : -1;
    }
    for (int e = tid; e < E; e += blockDim.x)
        g.slot1_of[e] = (uint32_t)(s.slot_of[e] + 1), g.count[e] = s.count[e], g.count_at[e] = s.count_at[e];
    for (int i = tid; i < S; i += blockDim.x) g.expert1_in[i] = (uint32_t)(s.expert_in[i] + 1), g.last[i] = s.last[i];
}

// The admitted misses copied from home into their slots, 16 bytes a thread, four loads in flight
// before their stores: the link's latency is hidden by the whole grid's outstanding reads.
__global__ void __launch_bounds__(256) k_xc_fill(qf_xcache x) {
    xc_state g = xc_map(x);
    int nf = (int)g.hdr[2], E = x.n_experts;
    int64_t per = (int64_t)(x.slot_bytes / 16), total = (int64_t)nf * per, step = (int64_t)gridDim.x * blockDim.x;
    int64_t o1 = (int64_t)(x.off[1] / 16), o2 = (int64_t)(x.off[2] / 16);
    for (int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i0 < total; i0 += 4 * step) {
        uint4 v[4];
        uint4 *dst[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int64_t i = i0 + u * step;
            dst[u] = NULL;
            if (i >= total) continue;
            int64_t f = i / per, w = i - f * per;
            int m = w < o1 ? 0 : w < o2 ? 1 : 2;
            int64_t within = w - (m == 0 ? 0 : m == 1 ? o1 : o2);
            if (within * 16 >= (int64_t)x.bytes[m]) continue; // alignment padding
            int e = (int)g.fill_e[f];
            v[u] = ((const uint4 *)x.home[m * E + e])[within];
            dst[u] = (uint4 *)(x.slots + (size_t)g.fill_s[f] * x.slot_bytes) + w;
        }
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (dst[u]) *dst[u] = v[u];
    }
}

// Block r (a hybrid step's row): the MoE's normed input into the job (x * 1/rms * norm weight;
// the device's own sums scale at the end: the host's input is the same to rounding) and the row's
// routing weights, exp(l - l0) over its chosen logits normalised, as the MoE kernels take them.
__global__ void __launch_bounds__(256) k_xc_host_job(qf_xcache x, const float *xin, const float *norm_w, float eps, int H, const float *rl,
                                                     int rl_stride, int K) {
    __shared__ float red[32];
    int r = blockIdx.x, tid = threadIdx.x;
    const float *xr = xin + (int64_t)r * H;
    float ss = 0.0f;
    for (int i = tid; i < H; i += blockDim.x) ss += xr[i] * xr[i];
    float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)H + eps);
    float *xn = x.job->xn + (int64_t)r * H;
    for (int i = tid; i < H; i += blockDim.x) xn[i] = xr[i] * inv * norm_w[i];
    if (tid == 0) {
        const int32_t *ch = x.host_words + 1 + QF_XC_HOST_MAX + r * QF_XC_K;
        const float *l = rl + (int64_t)r * rl_stride;
        float p[QF_XC_K], sum = 0.0f;
        for (int k = 0; k < K; k++) sum += p[k] = expf(l[ch[k]] - l[ch[0]]);
        for (int k = 0; k < K; k++) x.job->w[r * K + k] = p[k] / sum;
        if (r == 0) x.job->n = gridDim.x, x.job->top_k = K, x.job->status = -1;
    }
}

// y[r] += the host's sums, once the host node has run (rows without a host choice add zeros).
__global__ void k_xc_host_add(qf_xcache x, float *y, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && x.job->status == 0) y[i] += x.job->y[i];
}

// The host node's call: the store's host_run, its failure kept for the step's end.
static void CUDART_CB xc_host_call(void *p) {
    host_call *h = (host_call *)p;
    const qf_xcache *x = h->x;
    double t0 = qf_now();
    int rc = x->host_run(x->host_ctx, x->layer, x->job);
    x->job->status = rc;
    h->c->host_us += 1e6 * (qf_now() - t0), h->c->host_calls++;
    if (rc != QF_OK && !h->c->host_rc) snprintf(h->c->host_err, sizeof h->c->host_err, "layer %d's experts on the host: %s", x->layer, qf_last_error()), h->c->host_rc = rc;
}

// Whether a MoE op of rows takes the hybrid path: a decode step routed here without a drop.
int xcache_hybrid(const qf_xcache *x, const float *rl, int rows, int K, const xc_drop &drop) {
    if (!x || !x->job || !x->host_run || !rl || rows > QF_XC_ROWS || K > QF_XC_K) return 0;
    for (int t = 0; t < rows; t++)
        if (drop.tau[t] > 0.0f) return 0;
    return 1;
}

// The host's share started (after the resolve): the job's inputs, then the host node beside the kernels that follow.
void xcache_host_start(ctx *c, const qf_xcache *x, const float *xin, const float *norm_w, float eps, int H, const float *rl, int rl_stride, int rows, int K) {
    launch(c, "k_xc_host_job", 0, k_xc_host_job, dim3(rows), dim3(256), 0u, *x, xin, norm_w, eps, H, rl, rl_stride, K);
    host_call *h = host_call_of(c, x);
    if (!h) return dev_fail(c, "expert cache: more than %d layers with host experts", HOST_CALLS);
    g_host(c, xc_host_call, h);
}

// After the device's MoE kernels: the host's sums added once it is done.
void xcache_host_join(ctx *c, const qf_xcache *x, float *y, int rows, int H) {
    g_join(c);
    int64_t n = (int64_t)rows * H;
    launch(c, "k_xc_host_add", 0, k_xc_host_add, dim3((unsigned)((n + 255) / 256)), dim3(256), 0u, *x, y, n);
}

// n16 16-byte words of pinned host memory into device memory, four loads in flight a thread (as
// k_xc_fill reads), the tail bytes by thread 0.
__global__ void __launch_bounds__(256) k_read_pinned(uint4 *dst, const uint4 *src, int64_t n16, char *dtail, const char *stail, int tail) {
    int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i0 < n16; i0 += 4 * step) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i0 + u * step < n16) v[u] = src[i0 + u * step];
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i0 + u * step < n16) dst[i0 + u * step] = v[u];
    }
    if (blockIdx.x == 0 && threadIdx.x == 0)
        for (int i = 0; i < tail; i++) dtail[i] = stail[i];
}

void cu_read_pinned(qf_backend *be, void *dst, const void *src, size_t n) {
    ctx *c = C(be);
    if (((uintptr_t)dst | (uintptr_t)src) & 15) return dev_fail(c, "read_pinned: addresses not 16-byte aligned");
    int64_t n16 = (int64_t)(n / 16);
    int tail = (int)(n - (size_t)n16 * 16), blocks = 4 * (c->sms > 0 ? c->sms : 1);
    launch(c, "k_read_pinned", 0, k_read_pinned, dim3(blocks), dim3(256), 0u, (uint4 *)dst, (const uint4 *)src, n16, (char *)dst + n16 * 16,
           (const char *)src + n16 * 16, tail);
}

// Option link_gbps: thread 0 waits ns on the device's clock.
__device__ void spin_ns(uint64_t ns) {
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}
__global__ void k_link_spin(uint64_t ns) {
    if (threadIdx.x == 0) spin_ns(ns);
}
// The step's experts over the link (the resolve counted them) pay the capped link's extra time.
__global__ void k_xc_link(qf_xcache x, double ns_per_byte) {
    if (threadIdx.x == 0) spin_ns((uint64_t)((double)((const uint32_t *)x.state)[3] * (double)x.slot_bytes * ns_per_byte));
}

void xcache_link(ctx *c, const qf_xcache *x) {
    if (c->link_ns > 0.0) launch(c, "k_xc_link", 0, k_xc_link, dim3(1), dim3(32), 0u, *x, c->link_ns);
}
void link_spin(ctx *c, size_t bytes, cudaStream_t s) {
    if (c->link_ns > 0.0 && bytes) k_link_spin<<<1, 32, 0, s>>>((uint64_t)((double)bytes * c->link_ns));
}

// The cache resolved for this step's rows and the admitted misses filled, before the MoE op reads
// the table: ids (n) when the caller routed already, else rows of router logits at rl. host: a
// hybrid step (xcache_hybrid).
void xcache_resolve(ctx *c, const qf_xcache *x, const int *ids, int n, const float *rl, int rl_stride, int rows, int K, const xc_drop &drop, int host) {
    if (x->n_experts > XC_MAX_E || x->n_slots > x->n_experts || (rl && rows * K > XC_MAX_IDS) || x->policy == QF_POLICY_MIN || K > 64)
        return dev_fail(c, "expert cache: %d experts, %d slots, %d rows of %d or policy %d is more than its kernels take", x->n_experts, x->n_slots,
                        rows, K, x->policy);
    launch(c, "k_xc_resolve", 0, k_xc_resolve, dim3(1), dim3(512), 0u, *x, ids, n, rl, rl_stride, rows, K, drop, host);
}

// The admitted misses into their slots (after the resolve; a hybrid step's host node first, so
// the host computes while the link fills).
void xcache_fill(ctx *c, const qf_xcache *x) {
    int blocks = 4 * (c->sms > 0 ? c->sms : 1);
    launch(c, "k_xc_fill", 0, k_xc_fill, dim3(blocks), dim3(256), 0u, *x);
}

} // namespace qfc
