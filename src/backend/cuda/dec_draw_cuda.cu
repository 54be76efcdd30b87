// The token draw on the device (ops.h qf_draw; the rule of runtime/sampler.c): a block of 1024
// threads per row applies the penalties in place, picks the best top-k (or QF_DRAW_MAX_K with
// top-k off) of logits / temperature by a radix select, sorts them, and walks them as the host
// sampler does, with the same uniform number; a row whose top-p or min-p keeps more than them is
// drawn over every kept token in id order. Called outside a step (after the step that made the
// logits), so the penalty lists are uploaded as they are, whatever their length.
#include "backend/cuda/dec_int.cuh"

namespace qfc {

#define DR_T 1024 // threads a row
#define DR_K QF_DRAW_MAX_K

struct ddesc {
    int on, top_k, n_pen, pen_off;
    float temp, top_p, min_p, rep;
    double u;
};

// float order as unsigned order (the larger float, the larger key); NaNs are not expected.
__device__ __forceinline__ uint32_t ord32(float v) {
    uint32_t b = __float_as_uint(v == 0.0f ? 0.0f : v); // -0 ranks as +0 (the host compares them equal)
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float unord32(uint32_t o) { return __uint_as_float(o & 0x80000000u ? o & 0x7fffffffu : ~o); }
// A candidate's key: the value, then the lower id first (the host sampler's order, best first).
__device__ __forceinline__ uint64_t dkey(uint32_t o, int i) { return (uint64_t)o << 32 | (uint64_t)(0xffffffffu - (uint32_t)i); }
__device__ __forceinline__ int dkey_id(uint64_t k) { return (int)(0xffffffffu - (uint32_t)k); }
__device__ __forceinline__ float dkey_val(uint64_t k) { return unord32((uint32_t)(k >> 32)); }

struct dshared {
    uint64_t key[DR_K];
    double w[DR_K];
    double part[DR_T / 32];
    unsigned hist[256];
    double mass[256];
    int iv[DR_T / 32];
    int sel_b, n_gt, found, mode, kept;
    unsigned sel_above;
    double dv, sum;
};

__device__ double block_dsum(double v, dshared &s) {
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) s.part[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int i = 0; i < DR_T / 32; i++) t += s.part[i];
    return t;
}

// Inclusive prefix sum over the block in thread order (part: a value a warp of shared memory);
// *total: the block's sum.
template <class T>
__device__ T block_scan(T v, T *part, T *total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    for (int o = 1; o < 32; o <<= 1) {
        T u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    __syncthreads();
    if (lane == 31) part[warp] = v;
    __syncthreads();
    T before = 0, all = 0;
    for (int i = 0; i < DR_T / 32; i++) {
        if (i < warp) before += part[i];
        all += part[i];
    }
    *total = all;
    return before + v;
}

// The smallest i over the block (INT_MAX: none).
__device__ int block_imin(int v, dshared &s) {
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) s.iv[warp] = v;
    __syncthreads();
    int m = 0x7fffffff;
    for (int i = 0; i < DR_T / 32; i++) m = min(m, s.iv[i]);
    return m;
}

// The first index of the largest (NaNs never win), as qf_argmax_f32.
__device__ int block_argmax(const float *x, int V, dshared &s) {
    uint64_t best = 0;
    for (int i = threadIdx.x; i < V; i += DR_T)
        if (x[i] == x[i]) best = max(best, dkey(ord32(x[i]), i));
    for (int o = 16; o > 0; o >>= 1) best = max(best, (uint64_t)__shfl_xor_sync(0xffffffffu, (unsigned long long)best, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) s.key[threadIdx.x / 32] = best;
    __syncthreads();
    for (int i = 0; i < DR_T / 32; i++) best = max(best, s.key[i]);
    return best ? dkey_id(best) : 0;
}

// The ord32 value T of the K-th largest of x / t, and how many equal to it the best K take.
__device__ uint32_t radix_kth(const float *x, float t, int V, int K, dshared &s, int *need) {
    uint32_t prefix = 0, mask = 0;
    int k = K;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += DR_T) s.hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += DR_T) {
            uint32_t o = ord32(x[i] / t);
            if ((o & mask) == prefix) atomicAdd(&s.hist[(o >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned acc = 0;
            int b = 255;
            for (; b > 0 && acc + s.hist[b] < (unsigned)k; b--) acc += s.hist[b];
            s.sel_b = b, s.sel_above = acc;
        }
        __syncthreads();
        prefix |= (uint32_t)s.sel_b << shift, mask |= 255u << shift, k -= (int)s.sel_above;
        __syncthreads();
    }
    *need = k;
    return prefix;
}

// s.key[0..K) = the best K of x / t, sorted best first.
__device__ void best_k(const float *x, float t, int V, int K, dshared &s) {
    int need;
    uint32_t T = radix_kth(x, t, V, K, s, &need);
    if (threadIdx.x == 0) s.n_gt = 0;
    __syncthreads();
    int taken = 0; // equal ones so far, in id order
    for (int base = 0; base < V; base += DR_T) {
        int i = base + threadIdx.x, total;
        uint32_t o = i < V ? ord32(x[i] / t) : 0u;
        int eq = i < V && o == T;
        if (i < V && o > T) s.key[atomicAdd(&s.n_gt, 1)] = dkey(o, i);
        int pos = block_scan(eq, s.iv, &total) - eq; // before this one
        if (eq && taken + pos < need) s.key[K - need + taken + pos] = dkey(o, i);
        taken += total;
    }
    for (int j = K + threadIdx.x; j < DR_K; j += DR_T) s.key[j] = 0;
    __syncthreads();
    for (int size = 2; size <= DR_K; size <<= 1) // bitonic sort, descending
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            for (int j = threadIdx.x; j < DR_K; j += DR_T) {
                int p = j ^ stride;
                if (p > j) {
                    bool desc = (j & size) == 0;
                    uint64_t a = s.key[j], b = s.key[p];
                    if (desc ? a < b : a > b) s.key[j] = b, s.key[p] = a;
                }
            }
            __syncthreads();
        }
}

// The host sampler's keep_count: how many of the K sorted candidates top-p and min-p keep; K + 1
// when they keep all and want more.
__device__ int keep_count(const ddesc &d, const double *w, int K, double sum) {
    double cum = 0.0;
    for (int i = 0; i < K; i++) {
        if (i > 0 && w[i] < d.min_p) return i;
        cum += w[i] / sum;
        if (cum >= d.top_p) return i + 1;
    }
    return K + 1;
}

__device__ int draw_sorted(const dshared &s, int kept, double u) {
    double total = 0.0, acc = 0.0;
    for (int i = 0; i < kept; i++) total += s.w[i];
    double uu = u * total;
    for (int i = 0; i < kept; i++) {
        acc += s.w[i];
        if (uu < acc) return dkey_id(s.key[i]);
    }
    return dkey_id(s.key[kept - 1]);
}

// A walk in id order over the tokens `in` takes, after acc0 of weight already passed: the first
// whose running sum exceeds uu, else the last it takes (-1: none).
template <class IN>
__device__ int walk_ids(const float *x, float t, int V, double mx, double acc0, double uu, IN in, dshared &s) {
    double acc = acc0;
    int last = -1;
    for (int base = 0; base < V; base += DR_T) {
        int i = base + threadIdx.x, take = 0;
        double e = 0.0, total;
        if (i < V) {
            float v = x[i] / t;
            take = in(v, i);
            if (take) e = exp((double)v - mx);
        }
        double a = acc + block_scan(e, s.part, &total);
        int hit = block_imin(take && uu < a ? i : 0x7fffffff, s);
        if (hit != 0x7fffffff) return hit;
        int lt = -block_imin(take ? -i : 0x7fffffff, s);
        if (lt != -0x7fffffff) last = lt;
        acc += total;
    }
    return last;
}

// A flat row (top-k off, top-p or min-p keeping more than DR_K): the threshold of top-p's mass by
// radix passes over the values' mass, min-p's as a value, then a walk in id order over the kept.
__device__ int draw_flat(const float *x, const ddesc &d, int V, double mx, double sum, dshared &s) {
    double target = (double)d.top_p * sum;
    uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += DR_T) s.mass[b] = 0.0;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += DR_T) {
            float v = x[i] / d.temp;
            uint32_t o = ord32(v);
            if ((o & mask) == prefix) atomicAdd(&s.mass[(o >> shift) & 255u], exp((double)v - mx));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double acc = 0.0;
            int b = 255;
            for (; b > 0 && acc + s.mass[b] < target; b--) acc += s.mass[b];
            s.sel_b = b, s.dv = acc;
        }
        __syncthreads();
        prefix |= (uint32_t)s.sel_b << shift, mask |= 255u << shift, target -= s.dv;
        __syncthreads();
    }
    uint32_t T = prefix;
    double floor_w = d.min_p;
    auto in = [&](float v, int i) { return ord32(v) >= T && (i == dkey_id(s.key[0]) || exp((double)v - mx) >= floor_w); };
    double total = 0.0;
    for (int i = threadIdx.x; i < V; i += DR_T) {
        float v = x[i] / d.temp;
        if (in(v, i)) total += exp((double)v - mx);
    }
    total = block_dsum(total, s);
    return walk_ids(x, d.temp, V, mx, 0.0, d.u * total, in, s);
}

__global__ void __launch_bounds__(DR_T, 1) k_draw(float *logits, int V, const ddesc *dd, const int32_t *pen_ids, const float *pen_sub, int32_t *out) {
    __shared__ dshared s;
    const ddesc d = dd[blockIdx.x];
    if (!d.on) return;
    float *x = logits + (int64_t)blockIdx.x * V;
    for (int i = threadIdx.x; i < d.n_pen; i += DR_T) {
        int t = pen_ids[d.pen_off + i];
        float v = x[t];
        if (d.rep != 1.0f) v = v > 0.0f ? v / d.rep : v * d.rep;
        x[t] = v - pen_sub[d.pen_off + i];
    }
    __syncthreads();
    if (d.temp == 0.0f) {
        int b = block_argmax(x, V, s);
        if (threadIdx.x == 0) out[blockIdx.x] = b;
        return;
    }
    int all = d.top_k <= 0 || d.top_k >= V, K = all ? min(DR_K, V) : d.top_k;
    best_k(x, d.temp, V, K, s);
    double mx = (double)dkey_val(s.key[0]);
    for (int j = threadIdx.x; j < K; j += DR_T) s.w[j] = exp((double)dkey_val(s.key[j]) - mx);
    double full = 0.0;
    if (all && K < V) {
        float mxf = (float)mx;
        for (int i = threadIdx.x; i < V; i += DR_T) full += (double)expf(x[i] / d.temp - mxf);
        full = block_dsum(full, s);
    }
    __syncthreads();
    if (threadIdx.x == 0) { // sequential, in the host sampler's order
        double sum = 0.0;
        for (int i = 0; i < K; i++) sum += s.w[i];
        if (all && K < V) sum = full;
        int kept = keep_count(d, s.w, K, sum), id = -1, mode = 0;
        if (kept <= K) id = draw_sorted(s, kept, d.u);
        else if (!all || K == V) id = draw_sorted(s, K, d.u);
        else if (d.top_p >= 1.0f && d.min_p <= 0.0f) { // every token: the sorted best first, then the rest in id order
            double uu = d.u * sum, acc = 0.0;
            for (int i = 0; i < min(K, QF_DRAW_SORTED) && id < 0; i++)
                if (uu < (acc += s.w[i])) id = dkey_id(s.key[i]);
            mode = id < 0 ? 1 : 0, s.dv = acc, s.sum = uu;
        } else mode = 2, s.sum = sum;
        s.mode = mode, s.found = id;
    }
    __syncthreads();
    int id = s.found;
    if (s.mode == 1) {
        int S = min(K, QF_DRAW_SORTED);
        uint64_t lo = s.key[S - 1];
        int w = walk_ids(x, d.temp, V, mx, s.dv, s.sum, [&](float v, int i) { return dkey(ord32(v), i) < lo; }, s);
        id = w >= 0 ? w : dkey_id(s.key[S - 1]);
    } else if (s.mode == 2) {
        id = draw_flat(x, d, V, mx, s.sum, s);
    }
    if (threadIdx.x == 0) out[blockIdx.x] = id;
}

void dec_draw(qf_backend *be, float *logits, int n, int cols, const qf_draw *d, int32_t *out) {
    ctx *c = C(be);
    size_t pens = 0;
    for (int r = 0; r < n; r++) {
        if (d[r].on && d[r].top_k > DR_K && d[r].top_k < cols) return dev_fail(c, "draw: top_k %d is above %d", d[r].top_k, DR_K);
        pens += d[r].on ? (size_t)d[r].n_pen : 0;
    }
    size_t db = ((size_t)n * sizeof(ddesc) + 255) & ~(size_t)255, ib = (pens * 4 + 255) & ~(size_t)255;
    size_t bytes = db + 2 * ib;
    if (bytes > c->draw_h_cap) {
        char *nh = (char *)realloc(c->draw_h, bytes + bytes / 2);
        if (nh) c->draw_h = nh, c->draw_h_cap = bytes + bytes / 2;
    }
    if (bytes > c->draw_cap) { // never read by a recorded step: grown without dropping the recordings (scratch's rule)
        cudaFree(c->draw);
        c->draw_cap = cudaMalloc(&c->draw, bytes + bytes / 2) == cudaSuccess ? bytes + bytes / 2 : 0;
        if (!c->draw_cap) c->draw = NULL;
    }
    char *h = bytes <= c->draw_h_cap ? c->draw_h : NULL, *g = bytes <= c->draw_cap ? (char *)c->draw : NULL;
    if (!h || !g) return dev_fail(c, "draw: out of memory for %zu penalised tokens", pens);
    ddesc *hd = (ddesc *)h;
    int32_t *hid = (int32_t *)(h + db);
    float *hsub = (float *)(h + db + ib);
    size_t at = 0;
    for (int r = 0; r < n; r++) {
        const qf_draw *q = &d[r];
        int on = q->on;
        hd[r] = {on, q->top_k, on ? q->n_pen : 0, (int)at, q->temperature, q->top_p, q->min_p, q->repetition, q->u};
        if (!on) continue;
        if (q->n_pen) memcpy(hid + at, q->pen_ids, (size_t)q->n_pen * 4), memcpy(hsub + at, q->pen_sub, (size_t)q->n_pen * 4);
        at += (size_t)q->n_pen;
    }
    check(c, cudaMemcpy(g, h, bytes, cudaMemcpyHostToDevice), "draw: upload");
    LAUNCH(c, k_draw, dim3(n), DR_T, logits, cols, (const ddesc *)g, (const int32_t *)(g + db), (const float *)(g + db + ib), out);
}

} // namespace qfc
