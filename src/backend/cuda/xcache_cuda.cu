// The device expert cache (ops.h qf_xcache): before a MoE op, one block resolves the step's chosen
// experts against the layer's slots by the integer policy of experts/cache_policy.c, then a grid
// copies the admitted misses from pinned host memory into their slots. Both are kernels in the
// step's stream (and its graph): a hit costs no host round trip, a miss costs its bytes over the
// link, read by the SMs straight from the mapped host memory.
#include "backend/cuda/cuda_int.cuh"

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

// Thread 0: the misses in order take free slots, then victims in rank order when admitted.
__device__ void xc_assign(xc_shared &s, const qf_xcache &x, xc_state &g, uint32_t now) {
    uint32_t used = g.hdr[1];
    int nv = 0, nf = 0;
    unsigned long long misses = 0, declined = 0;
    for (int i = 0; i < s.n_order; i++) {
        int e = s.order[i], slot = -1;
        if (s.slot_of[e] >= 0) continue;
        misses++;
        if (used < (uint32_t)x.n_slots) {
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
            continue;
        }
        s.expert_in[slot] = e, s.slot_of[e] = slot, s.last[slot] = now;
        g.fill_e[nf] = (uint32_t)e, g.fill_s[nf] = (uint32_t)slot, nf++;
        for (int m = 0; m < 3; m++) x.tab[m * x.n_experts + e] = x.slots + (size_t)slot * x.slot_bytes + x.off[m];
    }
    g.hdr[1] = used, g.hdr[2] = (uint32_t)nf;
    g.ctr[QF_XC_MISSES] += misses, g.ctr[QF_XC_DECLINED] += declined;
    g.ctr[QF_XC_HITS] += (unsigned long long)(s.n_order) - misses;
}

// One block: the step's routed ids (ids, n of them; or, with rl, rows routed here from their
// logits) resolved as qf_slot_cache_access does, then the step's tick.
__global__ void __launch_bounds__(512) k_xc_resolve(qf_xcache x, const int *ids, int n, const float *rl, int rl_stride, int rows, int K, xc_drop drop) {
    __shared__ xc_shared s;
    __shared__ float lv[XC_MAX_E];
    xc_state g = xc_map(x);
    int E = x.n_experts, S = x.n_slots, tid = threadIdx.x;
    uint32_t now = g.hdr[0];
    for (int e = tid; e < E; e += blockDim.x)
        s.slot_of[e] = (int)g.slot1_of[e] - 1, s.count[e] = g.count[e], s.count_at[e] = g.count_at[e];
    for (int i = tid; i < S; i += blockDim.x) s.expert_in[i] = (int)g.expert1_in[i] - 1, s.last[i] = g.last[i];
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
    if (tid == 0) xc_assign(s, x, g, now), g.hdr[0] = now + 1;
    __syncthreads();
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

// The cache resolved for this step's rows and the admitted misses filled, before the MoE op reads
// the table: ids (n) when the caller routed already, else rows of router logits at rl.
void xcache_resolve(ctx *c, const qf_xcache *x, const int *ids, int n, const float *rl, int rl_stride, int rows, int K, const xc_drop &drop) {
    if (x->n_experts > XC_MAX_E || x->n_slots > x->n_experts || (rl && rows * K > XC_MAX_IDS) || x->policy == QF_POLICY_MIN || K > 64)
        return dev_fail(c, "expert cache: %d experts, %d slots, %d rows of %d or policy %d is more than its kernels take", x->n_experts, x->n_slots,
                        rows, K, x->policy);
    launch(c, "k_xc_resolve", 0, k_xc_resolve, dim3(1), dim3(512), 0u, *x, ids, n, rl, rl_stride, rows, K, drop);
    int blocks = 4 * (c->sms > 0 ? c->sms : 1);
    launch(c, "k_xc_fill", 0, k_xc_fill, dim3(blocks), dim3(256), 0u, *x);
}

} // namespace qfc
