// Attention of one new token per sequence over its paged KV cache.
#include "backend/cuda/dec_int.cuh"

namespace qfc {

// ---- attention, one new token per row ----

// One warp: rmsnorm(x) * w, then RoPE at pos over the first rot dims, into out (shared memory).
__device__ void norm_rope(const float *x, const float *w, int hd, int rot, int pos, const float *inv_freq, float eps, float *out) {
    int lane = threadIdx.x & 31, half = rot / 2;
    float ss = 0.0f;
    for (int d = lane; d < hd; d += 32) ss += x[d] * x[d];
    float inv = 1.0f / sqrtf(warp_sum(ss) / (float)hd + eps);
    for (int d = lane; d < hd; d += 32) out[d] = x[d] * inv * w[d];
    __syncwarp();
    for (int i = lane; i < half; i += 32) {
        float ang = (float)pos * inv_freq[i], cs = cosf(ang), sn = sinf(ang), a = out[i], b = out[i + half];
        out[i] = a * cs - b * sn;
        out[i + half] = b * cs + a * sn;
    }
    __syncwarp();
}

#define DATT_WARPS 8 // keys of a split shared by 8 warps: each walks few keys, one latency apiece

// After the wait for the qkv product: warp 0 normalises and rotates head h's query into qs; in the
// split that holds the new position warp 1 prepares the new key and value (kn, vn) of kv head kvh,
// and the kv group's first head stores them.
__device__ __forceinline__ void attn_new_token(const qf_attn_dec &a, const float *row, int h, int kvh, int pos, int at, int fresh, const qf_kv_view &kv,
                                               float *qs, float *kn, float *vn) {
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, hd = a.hd;
    if (warp == 0) norm_rope(row + (int64_t)h * 2 * hd, a.q_norm, hd, a.rot, pos, a.inv_freq, a.eps, qs);
    else if (warp == 1 && fresh) {
        norm_rope(row + a.k_off + kvh * hd, a.k_norm, hd, a.rot, pos, a.inv_freq, a.eps, kn);
        for (int d = lane; d < hd; d += 32) vn[d] = row[a.v_off + kvh * hd + d];
        if (h % (a.nh / a.nkv) == 0) {
            float *kd = (float *)kv_row(kv, at, a.nkv, hd, kvh, 0), *vd = (float *)kv_row(kv, at, a.nkv, hd, kvh, 1);
            for (int d = lane; d < hd; d += 32) kd[d] = kn[d], vd[d] = vn[d];
        }
    }
    __syncthreads();
}

// A warp's keys j, j + DATT_WARPS, .. below j1 into its running softmax (the new position's from kn, vn).
__device__ __forceinline__ void attn_keys(const qf_attn_dec &a, const qf_kv_view &kv, int kvh, int pos, const float *kn, const float *vn, int j, int j1,
                                          const float *qr, float &m, float &l, float *o) {
    for (; j < j1; j += DATT_WARPS) {
        const float *k = j == pos ? kn : kv_row(kv, j, a.nkv, a.hd, kvh, 0), *v = j == pos ? vn : kv_row(kv, j, a.nkv, a.hd, kvh, 1);
        attn_key(qr, k, v, a.hd, a.scale, m, l, o);
    }
}

// Block (row t * nh + head h, split): as k_attn_part, with the query's norm and RoPE done here;
// the split that holds the new position prepares the new key and value itself (and the first
// head of each kv group stores them), so no block reads a key another block is writing.
// KP > 0 (option att1, the default): each warp loads its first KP keys and values before its
// wait (written by earlier steps: every kernel two launches back has ended), so those keys cost no
// memory latency after it. ONE: the last block of a head's splits to finish (a count per head, back
// at zero after it) combines the partials itself, so no combine kernel and its boundary follow;
// gate: the output heads times their sigmoid gate. Keys are summed in the same order either way.
template <int KP, bool ONE, bool PAR = true>
__global__ void __launch_bounds__(DATT_WARPS * 32) k_attn_dec(qf_attn_dec a, int chunk, int splits, float *part, unsigned *cnt, int gate) {
    __shared__ float qs[ATT_DPL * 32], kn[ATT_DPL * 32], vn[ATT_DPL * 32];
    __shared__ int last;
    int th = blockIdx.x, sp = blockIdx.y, t = th / a.nh, h = th % a.nh, kvh = h / (a.nh / a.nkv);
    int warp = threadIdx.x / 32, hd = a.hd, rpos = a.pos[t], pos = a.n_keys[t] ? a.n_keys[t] - 1 : rpos; // rope at rpos; the new key at pos of the view
    int j0 = sp * chunk, j1 = min(pos + 1, j0 + chunk), fresh = j0 <= pos && pos < j1;
    qf_kv_view kv = a.kv[t];
    const float *row = a.qkv + (int64_t)t * a.stride;
    float kr[KP > 0 ? KP : 1][ATT_DPL], vr[KP > 0 ? KP : 1][ATT_DPL];
#pragma unroll
    for (int i = 0; i < KP; i++) {
        int j = j0 + warp + DATT_WARPS * i;
        if (j < j1 && j != pos) attn_row(kv_row(kv, j, a.nkv, hd, kvh, 0), hd, kr[i]), attn_row(kv_row(kv, j, a.nkv, hd, kvh, 1), hd, vr[i]);
    }
    pdl_wait();
    pdl_launch();
    attn_new_token(a, row, h, kvh, rpos, pos, fresh, kv, qs, kn, vn);
    float qr[ATT_DPL], o[ATT_DPL], m = -INFINITY, l = 0.0f;
    attn_start(qs, hd, qr, o);
#pragma unroll
    for (int i = 0; i < KP; i++) {
        int j = j0 + warp + DATT_WARPS * i;
        if (j < j1) {
            if (j == pos) attn_key(qr, kn, vn, hd, a.scale, m, l, o);
            else attn_key_r(qr, kr[i], vr[i], hd, a.scale, m, l, o);
        }
    }
    attn_keys(a, kv, kvh, pos, kn, vn, j0 + warp + DATT_WARPS * KP, j1, qr, m, l, o);
    float *hp = part + (int64_t)th * splits * (hd + 2);
    attn_write_part<DATT_WARPS>(m, l, o, hd, hp + (int64_t)sp * (hd + 2));
    if constexpr (ONE) {
        __threadfence(); // the partial, before the count says it is there
        __syncthreads();
        if (threadIdx.x == 0) {
            last = atomicAdd(cnt + th, 1u) == (unsigned)splits - 1;
            if (last) cnt[th] = 0; // every split has counted: zero for the next launch
        }
        __syncthreads();
        if (last) {
            __threadfence();
            attn_combine_head<true, PAR>(hp, splits, hd, gate ? row + (int64_t)h * 2 * hd + hd : NULL, a.out + (int64_t)th * hd);
        }
    }
}

static void attention_dec(ctx *c, const qf_attn_dec *a, int gate) {
    if (a->hd > ATT_DPL * 32 || a->nh % a->nkv) {
        return dev_fail(c, "head_dim %d > %d (or heads %d not a multiple of kv heads %d) is not supported", a->hd, ATT_DPL * 32, a->nh,
                a->nkv);
    }
    int max_keys = 0, rows = a->n * a->nh, chunk;
    for (int t = 0; t < a->n; t++) {
        int keys = a->n_keys[t] ? a->n_keys[t] : a->pos[t] + 1;
        max_keys = keys > max_keys ? keys : max_keys;
    }
    // enough blocks for every SM, and splits of at most ~256 keys (32 per warp) while 64 allow
    int sms = c->sms > 0 ? c->sms : 132, splits = (2 * sms + rows - 1) / rows, by_len = (max_keys + 255) / 256;
    splits = splits < by_len ? by_len : splits;
    splits = splits < 1 ? 1 : splits > 64 ? 64 : splits;
    chunk = (max_keys + splits - 1) / splits;
    if (chunk < 32) chunk = 32, splits = (max_keys + 31) / 32;
    float *part = (float *)scratch(c, &c->attn, &c->attn_cap, (size_t)rows * 64 * (a->hd + 2) * sizeof(float));
    if (!part) return;
    if (QF_LAB(c, att1) && c->att_cnt && rows <= ATT_MAX_HEADS) {
        void (*k)(qf_attn_dec, int, int, float *, unsigned *, int) = k_attn_dec<4, true>;
#if QF_CUDA_LAB_BUILD
        if (!QF_LAB(c, comb)) k = k_attn_dec<4, true, false>; /* the plain combine */
#endif
        launch(c, "k_attn_dec", 1, k, dim3(rows, splits), dim3(DATT_WARPS * 32), 0u, *a, chunk, splits, part, c->att_cnt, gate);
        return;
    }
    LAUNCH_PDL(c, (k_attn_dec<0, false>), dim3(rows, splits), DATT_WARPS * 32, 0, *a, chunk, splits, part, (unsigned *)NULL, 0);
    LAUNCH_PDL(c, k_attn_combine, rows, 128, 0, splits, a->hd, part, a->out, gate ? a->qkv : (const float *)NULL, a->stride, a->nh);
}

void dec_attention(qf_backend *be, const qf_attn_dec *a) { attention_dec(C(be), a, 0); }

// attention with the output gate applied (option att_gate); 0: not taken.
int dec_attn_gate(qf_backend *be, const qf_attn_dec *a) {
    ctx *c = C(be);
    if (!QF_LAB(c, att_gate)) return 0;
    attention_dec(c, a, 1);
    return 1;
}

// ---- sparsity's KV level: the pages a new token attends to (ops.h dec page_select) ----

#define PS_MAX_PAGES 8192 // pages a row's choice holds in shared memory (512K tokens at 64 a page)
#define PS_MAX_QD 4096    // query floats (heads x head_dim) staged

struct ps_rows {
    int n_pages[QF_DEC_ROWS], budget[QF_DEC_ROWS];
    int32_t *sel[QF_DEC_ROWS];
};

#define PS_WARPS 8 // pages a scoring block takes at once (a warp each)

// Block (pages blockIdx.x * PS_WARPS.., row t): the row's query heads normalised and rotated
// (norm_rope, as the attention; a few KB each block stages for itself), then a warp a page: its
// summary's channels in registers (all loads at once: one memory latency a page), the largest of
// its heads' Quest bounds into score[t][p]. The last page needs none.
__global__ void __launch_bounds__(PS_WARPS * 32) k_page_score(qf_attn_dec a, ps_rows r, float *score) {
    __shared__ float qs[PS_MAX_QD];
    int t = blockIdx.y, np = r.n_pages[t], hd = a.hd, warp = threadIdx.x / 32, lane = threadIdx.x & 31, p = blockIdx.x * PS_WARPS + warp;
    if (!r.budget[t] || blockIdx.x * PS_WARPS >= np - 1) return;
    const qf_kv_view kv = a.kv[t];
    float mn[2][ATT_DPL], mx[2][ATT_DPL]; // kv groups g0, g0 + 1 of the lane's channels lane + 32 i
    int g0 = -2; // no group loaded yet
    pdl_wait();
    pdl_launch();
    for (int h = warp; h < a.nh; h += PS_WARPS) norm_rope(a.qkv + (int64_t)t * a.stride + (int64_t)h * 2 * hd, a.q_norm, hd, a.rot, a.pos[t], a.inv_freq, a.eps, qs + h * hd);
    __syncthreads();
    if (p >= np - 1) return;
    const float *sum = kv.base + (size_t)kv.pages[p] * kv.page_stride + kv.s_off;
    float best = -INFINITY;
    for (int h = 0; h < a.nh; h++) {
        int g = h / (a.nh / a.nkv);
        if (g != g0 && g != g0 + 1) { // the next two kv groups' summaries, loaded together
            g0 = g;
#pragma unroll
            for (int k = 0; k < 2; k++)
#pragma unroll
                for (int i = 0; i < ATT_DPL; i++) {
                    int c = lane + 32 * i, gk = g0 + k;
                    bool in = c < hd && gk < a.nkv;
                    mn[k][i] = in ? sum[(size_t)gk * hd + c] : 0.0f, mx[k][i] = in ? sum[(size_t)(a.nkv + gk) * hd + c] : 0.0f;
                }
        }
        const float *q = qs + h * hd;
        float b = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_DPL; i++) {
            int c = lane + 32 * i;
            if (c < hd) b += g == g0 ? fmaxf(q[c] * mn[0][i], q[c] * mx[0][i]) : fmaxf(q[c] * mn[1][i], q[c] * mx[1][i]);
        }
        b = warp_sum(b);
        best = b > best ? b : best;
    }
    if (lane == 0) score[(int64_t)t * PS_MAX_PAGES + p] = best;
}

// Block (row t): each middle page ranked against the others (higher score first, then the lower
// page: the reference's order); the first, the last and the budget - 2 best written ascending as
// physical page ids.
__global__ void __launch_bounds__(1024) k_page_pick(qf_attn_dec a, ps_rows r, const float *scores) {
    extern __shared__ float score[];
    __shared__ int wsum[32], total;
    int t = blockIdx.x, np = r.n_pages[t], budget = r.budget[t];
    if (!budget) return;
    pdl_wait();
    pdl_launch();
    for (int p = threadIdx.x; p < np - 1; p += blockDim.x) score[p] = scores[(int64_t)t * PS_MAX_PAGES + p];
    __syncthreads();
    int per = (np + blockDim.x - 1) / blockDim.x, p0 = threadIdx.x * per, mine = 0;
    unsigned keep = 0; // bit i: page p0 + i is chosen (per <= 8)
    for (int i = 0; i < per && p0 + i < np; i++) {
        int p = p0 + i, in = p == 0 || p == np - 1;
        if (!in) {
            float v = score[p];
            int ahead = 0;
            for (int o = 1; o < np - 1 && ahead < budget - 2; o++) ahead += o != p && (score[o] > v || (score[o] == v && o < p));
            in = ahead < budget - 2;
        }
        keep |= (unsigned)in << i, mine += in;
    }
    int at = block_scan(mine, wsum, &total);
    for (int i = 0; i < per && p0 + i < np; i++)
        if (keep >> i & 1) r.sel[t][at++] = a.kv[t].pages[p0 + i];
}

size_t page_pick_scratch(const qf_scratch_shape *s) { return s->sparse_out ? (size_t)QF_DEC_ROWS * PS_MAX_PAGES * sizeof(float) : 0; }

void dec_page_select(qf_backend *be, const qf_attn_dec *a, const int *n_pages, const int *budget, int32_t *const *sel) {
    ctx *c = C(be);
    ps_rows r = {};
    int most = 1;
    for (int t = 0; t < a->n; t++) {
        r.n_pages[t] = n_pages[t], r.budget[t] = budget[t], r.sel[t] = sel[t];
        most = budget[t] && n_pages[t] > most ? n_pages[t] : most;
    }
    if (most > PS_MAX_PAGES || a->nh * a->hd > PS_MAX_QD || a->hd > 32 * ATT_DPL)
        return dev_fail(c, "page choice: %d pages (at most %d) or %d query floats (at most %d)", most, PS_MAX_PAGES, a->nh * a->hd, PS_MAX_QD);
    float *scores = (float *)scratch(c, &c->ps, &c->ps_cap, (size_t)QF_DEC_ROWS * PS_MAX_PAGES * sizeof(float));
    if (!scores) return dev_fail(c, "page choice: out of device memory");
    size_t smem = (size_t)PS_MAX_PAGES * sizeof(float); // one size: the opt-in is set once
    resident(c, (const void *)k_page_pick, 1024, smem);
    launch(c, "k_page_score", 1, k_page_score, dim3((most + PS_WARPS - 1) / PS_WARPS, a->n), dim3(PS_WARPS * 32), 0u, *a, r, scores);
    launch(c, "k_page_pick", 1, k_page_pick, dim3(a->n), dim3(1024), (unsigned)smem, *a, r, (const float *)scores);
}

} // namespace qfc
