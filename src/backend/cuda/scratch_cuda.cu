// The ops' scratch sized once for the largest shapes a forward asks (ops.h qf_scratch_shape): each
// buffer's bound is its op's arithmetic (the *_scratch functions beside the ops), so the load plans
// device memory without running a step to see what the ops take, and memory stays flat after it.
#include "backend/cuda/cuda_int.cuh"

namespace qfc {

// cuBLAS's workspace, ours: otherwise its pool is allocated on the first product (32 MiB on sm_90).
#define BLAS_WS_BYTES ((size_t)32 << 20)

struct bound {
    void **p;
    size_t *cap, bytes;
};

static int bounds(ctx *c, const qf_scratch_shape *s, bound *b) {
    size_t attn = attn_scratch(c, s), tok = (size_t)(s->tokens > s->rows ? s->tokens : s->rows);
    tok = (tok > 2 * QF_DEC_ROWS ? tok : 2 * QF_DEC_ROWS) * sizeof(int32_t); // a recorded step's ids: the token's and its drafts'
    bound all[] = {{&c->attn, &c->attn_cap, attn},
                   {&c->ps, &c->ps_cap, page_pick_scratch(s)},
                   {&c->dtc, &c->dtc_cap, dec_tc_scratch(c, s)},
                   {&c->moe, &c->moe_cap, moe_scratch(s)},
                   {&c->mg_buf, &c->mg_cap, moe_grouped_scratch(c, s)},
                   {&c->sp, &c->sp_cap, sparse_scratch(c, s)},
                   {&c->gdnc, &c->gdnc_cap, gdn_chunk_scratch(c, s)},
                   {&c->xb, &c->xb_cap, matmul_scratch(s)},
                   {&c->tok, &c->tok_cap, tok}};
    int n = (int)(sizeof all / sizeof *all);
    for (int i = 0; i < n; i++) b[i] = all[i];
    return n;
}

size_t cu_scratch_bytes(qf_backend *be, const qf_scratch_shape *s) {
    bound b[16];
    size_t sum = BLAS_WS_BYTES;
    for (int i = 0, n = bounds(C(be), s, b); i < n; i++) sum += b[i].bytes;
    return sum;
}

// Each buffer at its bound exactly (a larger one from before is kept); recorded steps pointed at
// the old buffers, so they are dropped.
int cu_scratch_reserve(qf_backend *be, const qf_scratch_shape *s) {
    ctx *c = C(be);
    bound b[16];
    cudaDeviceSynchronize();
    g_drop_all(c);
    int n = bounds(c, s, b);
    size_t ids = 0; // the pinned staging of the ids, as many as their scratch
    for (int i = 0; i < n; i++) {
        if (b[i].p == &c->tok) ids = b[i].bytes / sizeof(int32_t);
        if (*b[i].cap >= b[i].bytes) continue;
        cudaFree(*b[i].p);
        *b[i].p = NULL, *b[i].cap = 0;
        if (cudaMalloc(b[i].p, b[i].bytes) != cudaSuccess) return qf_fail(QF_ENOMEM, "out of device memory for the ops' scratch (%zu bytes)", b[i].bytes);
        *b[i].cap = b[i].bytes;
    }
    if (c->gs.pin_tok_cap < ids && !pin_tok_alloc(c, ids)) return qf_fail(QF_ENOMEM, "out of pinned host memory for the token ids' staging");
    if (!c->blas_ws) {
        if (cudaMalloc(&c->blas_ws, BLAS_WS_BYTES) != cudaSuccess) return qf_fail(QF_ENOMEM, "out of device memory for cuBLAS's workspace");
        if (cublasSetWorkspace(c->blas, c->blas_ws, BLAS_WS_BYTES) != CUBLAS_STATUS_SUCCESS) return qf_fail(QF_EDEVICE, "cuBLAS did not take its workspace");
    }
    c->reserved = 1, c->grown = 0;
    note_peak(c);
    return QF_OK;
}

int cu_scratch_grown(qf_backend *be) { return C(be)->grown; }

} // namespace qfc
