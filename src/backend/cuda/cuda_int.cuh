// Internal to the CUDA backend: the context, kernel launching (eager, profiled or recorded into
// a graph) and the small device helpers every kernel file shares.
#ifndef QF_CUDA_INT_CUH
#define QF_CUDA_INT_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tuple>
#include <utility>

extern "C" {
#include "backend/cuda/cuda_opts.h"
#include "backend/ops.h"
#include "base/dtype.h"
#include "base/err.h"
#include "base/timer.h"
}


/* A lab option's value (cuda_opts.c): the context's in a lab build, else its default as a constant,
 * so that the branches to the variants it selects fold away and those kernels are not built. */
#if QF_CUDA_LAB_BUILD
#define QF_LAB(c, name) ((c)->name)
#else
#define QF_LAB(c, name) QF_LAB_DEF_##name
#endif

namespace qfc {

// Decode steps as CUDA graphs. A step with the same shape as the one before is recorded as a
// graph (each kernel a node, in launch order) and launched whole; later steps of that shape only
// update the nodes' arguments (positions, grid sizes) and launch it again, which removes the
// per-kernel launch gaps that dominate a batch-1 decode step of ~1000 small kernels. A node whose
// launch (grid, block, shared memory, argument bytes) is the same as recorded is not touched: at
// ~1 us of host time per update, re-setting ~300 unchanged nodes would delay every step.
enum { G_EAGER, G_RECORD, G_REPLAY };
#define G_MAX_NODES 16384
#define G_MAX_OUTS 256
#define G_ARG_BYTES ((size_t)8 << 20)
#define G_MAX_ARG 8192 // argument bytes of one kernel (a 64-row attention step's views: ~4.3 KB)

#define G_SLOTS 8 // recorded steps kept: the decode step of each batch size a server moves between

struct g_launch { dim3 g, b; unsigned smem, len; size_t off; void *dst; const void *src; size_t bytes; }; // len 0: not kept; dst, src, bytes: a copy node's

struct graph_rec { // one recorded step
    uint64_t key;            // 0: none
    unsigned long long used; // the step it last ran (the least recent one is recorded over)
    int n_rec;
    cudaGraph_t g;
    cudaGraphExec_t ex;
    cudaGraphNode_t nodes[G_MAX_NODES];
    const void *funcs[G_MAX_NODES]; // NULL for a copy node
    g_launch rec[G_MAX_NODES];
    unsigned char *argbuf; // the recorded argument bytes, G_ARG_BYTES
    size_t arg_used;
};

struct graph_state {
    int enabled, mode, broken, n;
    uint64_t last_key;
    unsigned long long tick;
    graph_rec rs[G_SLOTS];
    graph_rec *cur; // the step's recording (G_RECORD, G_REPLAY)
    struct out { void *dst; size_t off, bytes; } outs[G_MAX_OUTS];
    int n_outs;
    size_t out_used;
    char *pin_out;   // pinned staging for downloads (logits)
    int32_t *pin_tok; // pinned staging for token ids
    size_t pin_out_cap, pin_tok_cap, tok_off; // tok_off: the ids a recorded step staged so far
    int host_at, skip, join; // the last host node; the next node depends on the node before it (skip); and on it too (join)
};

// A host node's call (hybrid expert execution): the layer's cache, whose host_run it calls.
struct ctx;
struct host_call {
    ctx *c;
    const qf_xcache *x;
};
#define HOST_CALLS 256 // layers with host experts

// Option profile: every kernel timed with events (eager steps only), summed by kernel and
// printed when the backend is freed.
#define PROF_MAX 64
#define PROF_RING 4096
struct profile {
    int on, n_names, n_pend;
    const char *names[PROF_MAX];
    double ms[PROF_MAX];
    long calls[PROF_MAX];
    cudaEvent_t ev[PROF_RING][2];
    int pend_name[PROF_RING];
};

struct ctx {
    int device, fp32, bf16_single;
    int sms, smem_optin, smem_sm; // multiprocessors; shared memory a block may opt in to, and per SM
    int pdl;                      // graphs chain the kernels that allow it programmatically (sm_90+)
    int gdn_lpc;                  // lanes per value column in the DeltaNet decode kernel (option gdn_lpc: 2, 4, 8)
    int pw1;                      // one-row products of few weight rows take a warp per row (option pw1, default 1)
    int early;                    // decode kernels issue their first weight loads before waiting (option early, default 1)
    int moe1;                     // one-row MoE blocks in one kernel, gate/up and down a grid count apart (option moe1, default 1)
    unsigned *moe_cnt;            // grid counts, zero between launches: [0..1] the one-kernel MoE's
    unsigned long long *sp_ctr;   // ops.h sparse_counts' four counts, zeroed at start
    unsigned *sp_count;           // the sparse products' finished blocks per output slice, zero between launches (1024)
    int att1;                     // the decode attention in one kernel, keys loaded before its wait (option att1)
    int att_gate;                 // the decode attention applies the output gate, o_proj none (option att_gate)
    int comb;                     // the attention's combine loads every split at once (attn_combine_head PAR; option comb=0: off)
    unsigned *att_cnt;            // per (row, head) counts of the one-kernel attention's finished splits (k_attn_dec ONE), zero between launches
    int gdn_gn;                   // the DeltaNet step a value head per block, with out_proj's gated norm (default; option gdn_gn=0: off)
    int moe_pf;                   // the one-kernel MoE's expert table in shared memory (default; option moe_pf=0: off)
    int route;                    // the one-kernel MoE's routing: 2 route_pairs, 3 route_sort (the default)
    int bulk;                     // kinds of one-row products fed by bulk copies into per-warp rings (option bulk=mask, sm_90; default 8: in_proj/qkv)
    int bulk_blocks;              // their blocks per SM (option bulk_blocks: 1 or 2, default 2)
    int mg, mg_min_rows;          // the many-row MoE grouped by expert (moe_grouped; option mg=0: off) from this many rows (option mg_min)
    void *mg_buf;                 // its scratch
    size_t mg_cap;
    int mg_cp, mg_cp_attr;        // moe_grouped's products fed by cp.async stages (k_mg_cp; option mg_cp=0: the register form)
    int mg_p64;                   // k_mg_cp's passes of 64 slots when experts average more than 24 (option mg_p64=0: 32)
    int dec_tc;                   // decode products of this many rows and more on the tensor cores (tc_dense; option dec_tc)
    void *dtc;                    // their inputs' bf16 parts and split partial sums
    size_t dtc_cap;
    int att_tile, att_tile_attr;  // many-query attention as tiles of rows sharing a kv head (attn_tiled; option att_tile=0: off)
    int att_tc;                   // their products on the tensor cores, operands as bf16 hi + lo parts (option att_tc=0: fp32 FMAs)
    int gdn_seq;                  // the many-token DeltaNet as a block per head (k_gdn; option gdn_seq=1), not k_gdn_cols
    int gdn_plpc;                 // lanes a value column in k_gdn_cols (option gdn_plpc: 1, 2, 4 (default), 8)
    int gdn_cp;                   // k_gdn_cols stages its inputs by cp.async a round ahead (option gdn_cp=0: plain loads)
    int gdn_chunk, gdn_chunk_min; // the many-token DeltaNet in chunks of 64 (gdn_chunked; option gdn_chunk=0: off) from this many tokens
    int gdnc_attr;                // its kernels' shared-memory opt-in is set
    void *gdnc;                   // its scratch
    size_t gdnc_cap;
    int cc_major;                 // the device's compute capability, major
    profile prof;
    graph_state gs;
    cublasHandle_t blas;
    size_t total, peak;
    char name[256];
    void *tok, *xb, *moe, *attn, *sp, *ps, *draw;
    void *amax; // argmax partials and per-row counters (argmax_scratch_bytes, zeroed once)
    size_t tok_cap, xb_cap, moe_cap, attn_cap, sp_cap, ps_cap, draw_cap;
    char *draw_h; // host staging of the draws' descriptors and penalty lists (grown, never per call)
    size_t draw_h_cap;
    int reserved, grown;       // scratch reserved for the load's shapes; buffers grown past it since
    void *blas_ws;             // cuBLAS's workspace, ours (part of the reserve)
    struct occ_rec { const void *fn; size_t smem; int blocks; } occ[64]; // resident blocks per SM, asked once
    int n_occ;
    const void *carved[128]; // kernels already set to the largest shared-memory carveout
    int n_carved;
    // option steptime=1: replayed steps timed (GPU between events; host from the step's
    // begin to its launch; begin to results; the nodes whose parameters were set again, and the
    // host time that took), means printed when the backend is freed; and the steps of a graph's
    // size recorded, or run eager as the first of a new key
    struct steptime { int on; cudaEvent_t ev[2]; double t0, gpu_ms, host_us, wall_us, set_us; long n, sets, recorded, eager; } st;
    cudaStream_t copy_stream;   // staged host-to-device copies beside the ops (cu_stage)
    cudaEvent_t stage_ev[3];    // [0], [1]: each staging buffer's copies done; [2]: the ops queued before a stage
    cudaEvent_t tok_ev;         // the last eager copy of token ids out of gs.pin_tok (cu_embed)
    int tok_ev_set;
    // hybrid expert execution: the host nodes' calls, the eager path's stream and events (started,
    // done), and the host's time, calls and first failure (kept for the step's end)
    host_call hcalls[HOST_CALLS];
    int n_hcalls, host_pending;
    cudaStream_t host_stream;
    cudaEvent_t host_ev[2];
    double host_us;
    long host_calls;
    int host_rc;
    char host_err[320];
    double link_ns; // option link_gbps: the extra ns a byte over the link pays (0: the link as it is)
    // The first failure since the last step ended (a kernel that could not take its shape, a
    // launch or copy that failed, scratch that could not grow): the step reports it and fails.
    int err;
    char err_msg[256];
};

inline ctx *C(qf_backend *be) { return (ctx *)be->dev; }

// Records the step's first failure (printf-style message); later ones add nothing.
__attribute__((format(printf, 2, 3))) inline void dev_fail(ctx *c, const char *fmt, ...) {
    if (c->err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err_msg, sizeof c->err_msg, fmt, ap);
    va_end(ap);
    c->err = 1;
}

inline void check(ctx *c, cudaError_t e, const char *what) {
    if (e != cudaSuccess) dev_fail(c, "%s: %s", what, cudaGetErrorString(e));
}

// Adds a node after the last one (a chain: the step's kernels run in order).
// pdl: the kernel waits (griddepcontrol.wait) before it touches what earlier kernels wrote, so it
// may be launched while the kernel before it is still finishing (programmatic dependent launch):
// its blocks take their places and stream their first weights into L2 meanwhile.
// A replayed node's parameters set again: counted, with the host time since t0, under option steptime.
inline double set_begin(const ctx *c) { return c->st.on ? qf_now() : 0.0; }
inline void set_end(ctx *c, double t0) {
    if (c->st.on) c->st.set_us += 1e6 * (qf_now() - t0), c->st.sets++;
}

inline void g_add_kernel(ctx *c, const void *fn, dim3 g, dim3 b, unsigned smem, void **args, const void *blob, unsigned len, int pdl) {
    graph_state *s = &c->gs;
    graph_rec *q = s->cur;
    if (s->n >= G_MAX_NODES) {
        s->broken = 1;
        return;
    }
    cudaKernelNodeParams kp = {(void *)fn, g, b, smem, args, NULL};
    if (cudaGraphAddKernelNode(&q->nodes[s->n], q->g, NULL, 0, &kp) != cudaSuccess) s->broken = 1;
    int prev = s->n - 1 - s->skip; // past a host node: the node before it (the host runs beside what follows)
    if (prev >= 0) {
        cudaGraphEdgeData e;
        memset(&e, 0, sizeof e);
        if (pdl && c->pdl && !s->skip && q->funcs[prev]) e.from_port = cudaGraphKernelNodePortProgrammatic, e.type = cudaGraphDependencyTypeProgrammatic;
        if (cudaGraphAddDependencies(q->g, &q->nodes[prev], &q->nodes[s->n], &e, 1) != cudaSuccess) s->broken = 1;
    }
    if (s->join && cudaGraphAddDependencies(q->g, &q->nodes[s->host_at], &q->nodes[s->n], NULL, 1) != cudaSuccess) s->broken = 1;
    s->skip = 0, s->join = 0;
    g_launch *r = &q->rec[s->n];
    *r = {g, b, smem, 0, q->arg_used};
    if (q->argbuf && q->arg_used + len <= G_ARG_BYTES) memcpy(q->argbuf + q->arg_used, blob, len), q->arg_used += len, r->len = len;
    q->funcs[s->n++] = fn;
}

inline void g_set_kernel(ctx *c, const void *fn, dim3 g, dim3 b, unsigned smem, void **args, const void *blob, unsigned len) {
    graph_state *s = &c->gs;
    graph_rec *q = s->cur;
    if (s->n >= q->n_rec || q->funcs[s->n] != fn) {
        s->broken = 1; // the step took another path than the recorded one
        return;
    }
    g_launch *r = &q->rec[s->n];
    int same = r->len == len && len && r->smem == smem && r->g.x == g.x && r->g.y == g.y && r->g.z == g.z && r->b.x == b.x &&
               r->b.y == b.y && r->b.z == b.z && memcmp(q->argbuf + r->off, blob, len) == 0;
    if (!same) {
        cudaKernelNodeParams kp = {(void *)fn, g, b, smem, args, NULL};
        double t0 = set_begin(c);
        if (cudaGraphExecKernelNodeSetParams(q->ex, q->nodes[s->n], &kp) != cudaSuccess) s->broken = 1;
        set_end(c, t0);
        if (r->len == len && len) memcpy(q->argbuf + r->off, blob, len), r->g = g, r->b = b, r->smem = smem;
    }
    s->n++;
}

// A host function beside the kernels that follow (hybrid expert execution): in a recording a host
// node after the last node, which the next kernel skips; eager, on the host stream after the ops
// queued so far. g_join: the next kernel waits for it too. Host functions make no CUDA calls.
inline void g_host(ctx *c, cudaHostFn_t fn, void *data) {
    graph_state *s = &c->gs;
    graph_rec *q = s->cur;
    if (s->mode == G_RECORD) {
        cudaHostNodeParams hp = {fn, data};
        cudaGraphNode_t dep = s->n ? q->nodes[s->n - 1] : NULL;
        if (s->n >= G_MAX_NODES || cudaGraphAddHostNode(&q->nodes[s->n], q->g, s->n ? &dep : NULL, s->n ? 1 : 0, &hp) != cudaSuccess) {
            s->broken = 1;
            return;
        }
        q->rec[s->n] = {}, q->rec[s->n].src = data, q->funcs[s->n] = (const void *)fn;
        s->host_at = s->n++, s->skip = 1;
    } else if (s->mode == G_REPLAY) {
        g_launch *r = &q->rec[s->n];
        if (s->n >= q->n_rec || q->funcs[s->n] != (const void *)fn) s->broken = 1;
        else if (r->src != data) {
            cudaHostNodeParams hp = {fn, data};
            if (cudaGraphExecHostNodeSetParams(q->ex, q->nodes[s->n], &hp) != cudaSuccess) s->broken = 1;
            r->src = data;
        }
        s->n++;
    } else {
        check(c, cudaEventRecord(c->host_ev[0], 0), "host experts' start");
        check(c, cudaStreamWaitEvent(c->host_stream, c->host_ev[0], 0), "host experts' start");
        check(c, cudaLaunchHostFunc(c->host_stream, fn, data), "host experts");
        check(c, cudaEventRecord(c->host_ev[1], c->host_stream), "host experts' end");
        c->host_pending = 1;
    }
}
inline void g_join(ctx *c) {
    if (c->gs.mode == G_RECORD) c->gs.join = 1;
    else if (c->gs.mode == G_EAGER) check(c, cudaStreamWaitEvent(0, c->host_ev[1], 0), "host experts' join");
}

// The host node's call record for cache x (one per layer, kept while the backend lives).
inline host_call *host_call_of(ctx *c, const qf_xcache *x) {
    for (int i = 0; i < c->n_hcalls; i++)
        if (c->hcalls[i].x == x) return &c->hcalls[i];
    if (c->n_hcalls == HOST_CALLS) return NULL;
    c->hcalls[c->n_hcalls] = {c, x};
    return &c->hcalls[c->n_hcalls++];
}

inline void prof_flush(ctx *c) {
    profile *p = &c->prof;
    if (!p->n_pend) return;
    cudaEventSynchronize(p->ev[p->n_pend - 1][1]);
    for (int i = 0; i < p->n_pend; i++) {
        float ms = 0;
        cudaEventElapsedTime(&ms, p->ev[i][0], p->ev[i][1]);
        p->ms[p->pend_name[i]] += ms;
        p->calls[p->pend_name[i]]++;
    }
    p->n_pend = 0;
}

inline int prof_name(ctx *c, const char *name) {
    profile *p = &c->prof;
    for (int i = 0; i < p->n_names; i++)
        if (p->names[i] == name || strcmp(p->names[i], name) == 0) return i;
    if (p->n_names == PROF_MAX) return PROF_MAX - 1;
    p->names[p->n_names] = name;
    return p->n_names++;
}

// Every kernel asks for the same split of L1 and shared memory (the most shared memory): an SM
// holds blocks of two kernels at once only in one split, and programmatic launches put the next
// kernel's blocks beside the current one's.
inline void carve(ctx *c, const void *fn) {
    for (int i = 0; i < c->n_carved; i++)
        if (c->carved[i] == fn) return;
    cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, (int)cudaSharedmemCarveoutMaxShared);
    if (c->n_carved < (int)(sizeof c->carved / sizeof *c->carved)) c->carved[c->n_carved++] = fn;
}

template <typename... P, typename... A>
inline void launch(ctx *c, const char *name, int pdl, void (*k)(P...), dim3 g, dim3 b, unsigned smem, A &&...a) {
    if (c->gs.mode != G_REPLAY) carve(c, (const void *)k); // a replayed kernel was recorded, so carved, before
    std::tuple<P...> vals(std::forward<A>(a)...); // converted to the kernel's own parameter types
    void *args[sizeof...(P) + 1];
    std::apply([&](auto &...v) {
        int i = 0;
        ((args[i++] = (void *)&v), ...);
    }, vals);
    if (c->gs.mode != G_EAGER) {
        static_assert((0 + ... + sizeof(P)) <= G_MAX_ARG, "kernel arguments too large to keep");
        unsigned char blob[G_MAX_ARG + 1];
        unsigned len = 0;
        std::apply([&](auto &...v) { ((memcpy(blob + len, &v, sizeof v), len += (unsigned)sizeof v), ...); }, vals);
        if (c->gs.mode == G_RECORD) g_add_kernel(c, (const void *)k, g, b, smem, args, blob, len, pdl);
        else g_set_kernel(c, (const void *)k, g, b, smem, args, blob, len);
    } else if (!c->prof.on) check(c, cudaLaunchKernel((const void *)k, g, b, args, smem, 0), name);
    else {
        profile *p = &c->prof;
        if (p->n_pend == PROF_RING) prof_flush(c);
        p->pend_name[p->n_pend] = prof_name(c, name);
        cudaEventRecord(p->ev[p->n_pend][0], 0);
        cudaLaunchKernel((const void *)k, g, b, args, smem, 0);
        cudaEventRecord(p->ev[p->n_pend][1], 0);
        p->n_pend++;
    }
}

#define LAUNCH(c, k, g, b, ...) launch(c, #k, 0, k, dim3(g), dim3(b), 0u, __VA_ARGS__)
// the same with dynamic shared memory
#define LAUNCH_S(c, k, g, b, smem, ...) launch(c, #k, 0, k, dim3(g), dim3(b), (unsigned)(smem), __VA_ARGS__)
// kernels that call pdl_wait() before reading what earlier kernels wrote
#define LAUNCH_PDL(c, k, g, b, smem, ...) launch(c, #k, 1, k, dim3(g), dim3(b), (unsigned)(smem), __VA_ARGS__)

// Programmatic dependent launch (sm_90+; nothing on older chips, where graphs keep full edges):
// let the next kernel start launching now / wait until the kernel before has finished. Every
// kernel lets the next start only after its own wait: so code before a kernel's wait may read
// what the kernel two back wrote (it has finished), and at most two kernels share the SMs.
__device__ __forceinline__ void pdl_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A host-to-device or device-to-host copy inside a step (token ids in, logits out).
inline void g_copy(ctx *c, void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
    graph_state *s = &c->gs;
    graph_rec *q = s->cur;
    if (s->mode == G_RECORD) {
        cudaGraphNode_t dep = s->n ? q->nodes[s->n - 1] : NULL;
        if (s->n >= G_MAX_NODES || cudaGraphAddMemcpyNode1D(&q->nodes[s->n], q->g, s->n ? &dep : NULL, s->n ? 1 : 0, dst, src, n, kind) != cudaSuccess)
            s->broken = 1;
        else q->rec[s->n] = {}, q->rec[s->n].dst = dst, q->rec[s->n].src = src, q->rec[s->n].bytes = n, q->funcs[s->n++] = NULL;
    } else if (s->mode == G_REPLAY) {
        g_launch *r = &q->rec[s->n];
        if (s->n >= q->n_rec || q->funcs[s->n] != NULL) s->broken = 1;
        else if (r->dst != dst || r->src != src || r->bytes != n) { // the same copy as recorded is left as it is
            double t0 = set_begin(c);
            if (cudaGraphExecMemcpyNodeSetParams1D(q->ex, q->nodes[s->n], dst, src, n, kind) != cudaSuccess) s->broken = 1;
            r->dst = dst, r->src = src, r->bytes = n;
            set_end(c, t0);
        }
        s->n++;
    } else {
        cudaMemcpyAsync(dst, src, n, kind, 0);
    }
}

inline void note_peak(ctx *c) {
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess && tot - fr > c->peak) c->peak = tot - fr;
}

// The recorded steps dropped (their nodes point at a buffer about to go).
inline void g_drop_all(ctx *c) {
    for (int i = 0; i < G_SLOTS; i++) {
        graph_rec *q = &c->gs.rs[i];
        if (q->ex) cudaGraphExecDestroy(q->ex), q->ex = NULL;
        if (q->g) cudaGraphDestroy(q->g), q->g = NULL;
        q->key = 0;
    }
}

// Grows a scratch buffer (where none was reserved for the shapes: the first steps of a run).
// Recorded steps' nodes point at the old buffer: their graphs are dropped (idle while a step runs
// eager). Once reserved (cu_scratch_reserve) a growth is counted: the bound did not hold.
inline void *scratch(ctx *c, void **p, size_t *cap, size_t need) {
    if (need <= *cap) return *p;
    c->grown += c->reserved;
    if (c->gs.mode != G_EAGER) c->gs.broken = 1;
    else g_drop_all(c);
    if (*p) cudaFree(*p);
    size_t n = need + need / 2;
    if (cudaMalloc(p, n) != cudaSuccess) {
        *p = NULL;
        *cap = 0;
        return NULL;
    }
    *cap = n;
    return *p;
}

// The token ids' pinned staging replaced by one of n ids (0 on failure, the staging gone).
inline int pin_tok_alloc(ctx *c, size_t n) {
    cudaFreeHost(c->gs.pin_tok);
    c->gs.pin_tok = NULL;
    c->gs.pin_tok_cap = cudaMallocHost((void **)&c->gs.pin_tok, n * sizeof(int32_t)) == cudaSuccess ? n : 0;
    return c->gs.pin_tok != NULL;
}

// Room for a step's token ids: scratch on the device and pinned staging. The staging is a
// recorded step's copy source: grown, it drops the recordings as scratch() does (a copy node
// moved onto a new pinned buffer faults on replay) and counts past the reserve.
inline int tok_room(ctx *c, size_t n) {
    if (!scratch(c, &c->tok, &c->tok_cap, n * 4)) return 0;
    if (c->gs.pin_tok_cap < n) {
        c->grown += c->reserved;
        if (c->gs.mode != G_EAGER) c->gs.broken = 1;
        cudaDeviceSynchronize();
        if (c->gs.mode == G_EAGER) g_drop_all(c);
        return pin_tok_alloc(c, 2 * n); // twice the ask: growth past the reserve stays rare
    }
    return 1;
}

__device__ __forceinline__ float bf16f(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

__device__ __forceinline__ float ldw(const void *w, int dtype, int64_t i) {
    if (dtype == QF_DT_BF16) return bf16f(((const uint16_t *)w)[i]);
    if (dtype == QF_DT_F16) return __half2float(((const __half *)w)[i]);
    return ((const float *)w)[i];
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// y += 8 bf16 weights (one 16-byte load) times 8 floats of x (16-byte aligned).
__device__ __forceinline__ float dot8(uint4 w, const float *x) {
    float4 a = *(const float4 *)x, b = *(const float4 *)(x + 4);
    return bf16f(w.x & 0xffff) * a.x + bf16f(w.x >> 16) * a.y + bf16f(w.y & 0xffff) * a.z + bf16f(w.y >> 16) * a.w +
           bf16f(w.z & 0xffff) * b.x + bf16f(w.z >> 16) * b.y + bf16f(w.w & 0xffff) * b.z + bf16f(w.w >> 16) * b.w;
}

// cp.async of 16 bytes from global to shared memory (sm_80+), its groups and their wait.
__device__ __forceinline__ void cp16(void *dst, const void *src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
// The same for 4 bytes (through L1: .cg takes 16-byte copies only).
__device__ __forceinline__ void cp4(void *dst, const void *src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

inline unsigned blocks(int64_t n, int per) { return (unsigned)((n + per - 1) / per); }
inline size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

#define GEMV_MAX_N 16 // input rows the GEMV kernels take a pass (their FMAs a weight grow with the rows)

// ---- paged attention (decode splits the keys; the partials are combined by k_attn_combine) ----
#define ATT_WARPS 4
#define ATT_DPL 8 // dims per lane: head_dim up to 256
#define ATT_MAX_HEADS 4096 // (row, head) pairs the one-kernel attention counts

__device__ __forceinline__ const float *kv_row(const qf_kv_view &v, int j, int nkv, int hd, int h, int is_v) {
    size_t page = (size_t)v.pages[j / v.page_tokens];
    return v.base + page * v.page_stride + (is_v ? v.v_off : v.k_off) + ((size_t)(j % v.page_tokens) * nkv + h) * hd;
}

// A warp's start over a query head: the lane's dims lane + 32u of q into qr, o cleared.
__device__ __forceinline__ void attn_start(const float *q, int hd, float *qr, float *o) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < ATT_DPL; u++) {
        int d = lane + 32 * u;
        qr[u] = d < hd ? q[d] : 0.0f;
        o[u] = 0.0f;
    }
}

// A key's or value's row of hd floats into the lane's dims lane + 32u (0 past hd).
__device__ __forceinline__ void attn_row(const float *r, int hd, float *rr) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < ATT_DPL; u++) rr[u] = lane + 32 * u < hd ? r[lane + 32 * u] : 0.0f;
}

// One key (kr, vr: the lane's dims, as attn_row loads them) into a warp's running softmax (max m,
// sum l) and output o.
__device__ __forceinline__ void attn_key_r(const float *qr, const float *kr, const float *vr, int hd, float scale, float &m, float &l, float *o) {
    int lane = threadIdx.x & 31;
    float s = 0.0f;
#pragma unroll
    for (int u = 0; u < ATT_DPL; u++)
        if (lane + 32 * u < hd) s += qr[u] * kr[u];
    s = warp_sum(s) * scale;
    float mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
    l = l * corr + p;
#pragma unroll
    for (int u = 0; u < ATT_DPL; u++) o[u] = o[u] * corr + (lane + 32 * u < hd ? p * vr[u] : 0.0f);
    m = mn;
}

// One key row k and value row v into a warp's running softmax; lane holds dims lane + 32u.
__device__ __forceinline__ void attn_key(const float *qr, const float *k, const float *v, int hd, float scale, float &m, float &l, float *o) {
    float kr[ATT_DPL], vr[ATT_DPL];
    attn_row(k, hd, kr), attn_row(v, hd, vr);
    attn_key_r(qr, kr, vr, hd, scale, m, l, o);
}

// One head's output from its splits' partials (M, L, o[hd] each, at p): sum_s o_s e^(M_s - M) / L,
// times sigmoid(gate[d]) where gate is given (the attention layer's output gate, as o_proj's
// SIGMOID pre would apply it). The block's threads stride the dims; every thread of the block
// calls it. L2: the partials are read past L1 (in the one-kernel attention other blocks of the same
// kernel wrote them). PAR (the default; option comb=0: off, decode only): each split's M and L
// are loaded once by the block, in one round, and a dim's partials 8 splits at a time, where the
// plain loops paid a memory latency per split in each of three loops. Sums in the same order.
#define COMB_MAX_SPLITS 64
template <bool L2>
__device__ __forceinline__ float part_ld(const float *p) { return L2 ? __ldcg(p) : *p; }
template <bool L2, bool PAR = true>
__device__ __forceinline__ void attn_combine_head(const float *p, int splits, int hd, const float *gate, float *out) {
    __shared__ float sm[COMB_MAX_SPLITS], sl[COMB_MAX_SPLITS];
    bool par = PAR && splits <= COMB_MAX_SPLITS; // block-uniform
    if (par) {
        for (int s = threadIdx.x; s < splits; s += blockDim.x) sm[s] = part_ld<L2>(p + s * (hd + 2)), sl[s] = part_ld<L2>(p + s * (hd + 2) + 1);
        __syncthreads();
    }
    auto ms_of = [&](int s) { return par ? sm[s] : part_ld<L2>(p + s * (hd + 2)); };
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, ms_of(s));
    float L = 0.0f;
    for (int s = 0; s < splits; s++) {
        float ms = ms_of(s);
        if (ms != -INFINITY) L += (par ? sl[s] : part_ld<L2>(p + s * (hd + 2) + 1)) * expf(ms - M);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int s0 = 0; s0 < splits; s0 += 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = par && s0 + u < splits ? part_ld<L2>(p + (s0 + u) * (hd + 2) + 2 + d) : 0.0f;
#pragma unroll
            for (int u = 0; u < 8; u++) {
                int s = s0 + u;
                if (s >= splits) break;
                float ms = ms_of(s);
                if (ms != -INFINITY) acc += (par ? v[u] : part_ld<L2>(p + s * (hd + 2) + 2 + d)) * expf(ms - M);
            }
        }
        float v = acc / L;
        out[d] = gate ? v * sigmoid(gate[d]) : v;
    }
}

// The W warps' (m, l, o) merged into the block's unnormalised partial (M, L, o[hd]) at out.
template <int W>
__device__ void attn_write_part(float m, float l, const float *o, int hd, float *out) {
    __shared__ float sm[W], sl[W], so[W][ATT_DPL * 32];
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    if (lane == 0) sm[warp] = m, sl[warp] = l;
#pragma unroll
    for (int u = 0; u < ATT_DPL; u++) so[warp][lane + 32 * u] = o[u];
    __syncthreads();
    if (warp != 0) return;
    float M = -INFINITY, L = 0.0f;
    for (int w = 0; w < W; w++) M = fmaxf(M, sm[w]);
    for (int w = 0; w < W; w++) L += sm[w] == -INFINITY ? 0.0f : sl[w] * expf(sm[w] - M);
    if (lane == 0) out[0] = M, out[1] = L;
#pragma unroll
    for (int u = 0; u < ATT_DPL; u++) {
        int d = lane + 32 * u;
        if (d >= hd) continue;
        float acc = 0.0f;
        for (int w = 0; w < W; w++) acc += sm[w] == -INFINITY ? 0.0f : so[w][d] * expf(sm[w] - M);
        out[2 + d] = acc;
    }
}

// gate (may be NULL): the fused q|gate rows (row t at gate + t * gstride, head h's gate at + h * 2 * hd + hd).
__global__ void k_attn_combine(int splits, int hd, const float *part, float *out, const float *gate, int gstride, int nh);

// How many key splits (and keys per split) for `rows` (query, head) pairs over up to max_keys keys.
int attn_splits(int max_keys, int rows, int *chunk);

// Split partial sums' rows a prompt attention of T queries takes at most, at any context: the
// untiled kernel's splits and the tiles' (attn_tile_splits), so its scratch does not move as the
// context grows.
int attn_part_splits(ctx *c, int T, int nh, int nkv);
int attn_tile_splits(ctx *c, int T, int nh, int nkv);

// Each scratch buffer's bound for shapes up to s (ops.h qf_scratch_shape), next to the op that
// takes it; scratch_cuda.cu sums and reserves them.
size_t attn_scratch(ctx *c, const qf_scratch_shape *s);
size_t page_pick_scratch(const qf_scratch_shape *s);
size_t dec_tc_scratch(ctx *c, const qf_scratch_shape *s);
size_t moe_scratch(const qf_scratch_shape *s);
size_t moe_grouped_scratch(ctx *c, const qf_scratch_shape *s);
size_t sparse_scratch(ctx *c, const qf_scratch_shape *s);
size_t gdn_chunk_scratch(ctx *c, const qf_scratch_shape *s);
size_t matmul_scratch(const qf_scratch_shape *s);
size_t cu_scratch_bytes(qf_backend *be, const qf_scratch_shape *s);
int cu_scratch_reserve(qf_backend *be, const qf_scratch_shape *s);
int cu_scratch_grown(qf_backend *be);

// One MoE layer's device table of expert pointers ([3][E]: gate, up, down), the expert store's:
// NULL (the op fails) where the caller gave none.
inline const void **expert_table(const void *const *given) { return (const void **)given; }
// The MoE op's experts for many rows grouped by expert, on the tensor cores (moe_group_cuda.cu),
// given the routing (topi, topw: K per row), with the caller's y (N * K rows of H floats: each
// slot's down product) as scratch; 0: not taken (too few rows, not bf16, a shape it is not built
// for, or --precision fp32), the caller runs its GEMV path.
int moe_grouped(ctx *c, const qf_moe_args *a, const void **tab, const int *topi, const float *topw, float *y);
// The column splits tc_dense takes w in for n rows (enough blocks for every SM); 0: tc_dense does
// not take w (another dtype or shape, fp32 precision, option mg_cp=0).
int tc_splits(ctx *c, const qf_mat *w, int n);
// y[s][n][w.rows] = the part of w . x over split s of w's columns, on the tensor cores, for a decode
// step's n rows; x given as bf16 parts (xh; xl NULL with one part) of n + 64 rows of w.cols (the
// rows past n are read, not used).
void tc_dense(ctx *c, const qf_mat *w, const __nv_bfloat16 *xh, const __nv_bfloat16 *xl, int n, int splits, float *y);

// The attention op for a prompt's queries (8 or more) as tiles of query rows sharing a kv head
// (attn_tile_cuda.cu), partials in part (room for part_splits splits a row) combined into a->out;
// 0: not taken (few queries, a shape or alignment it is not built for, option att_tile=0).
int attn_tiled(ctx *c, const qf_attn_args *a, float *part, int part_splits);

// The gdn op in chunks of 64 tokens, the WY form of backend/cpu/gdn_chunked.c (gdn_chunk_cuda.cu);
// 0: not taken (fewer tokens than c->gdn_chunk_min, a shape it is not built for, switched off).
int gdn_chunked(ctx *c, const qf_gdn_args *a);

// The expert cache resolved for a MoE op's rows and its admitted misses filled (xcache_cuda.cu):
// ids (n) when the caller routed already, else `rows` rows of router logits at rl.
// Sparsity's expert rule for rows routed from their logits (ops.h qf_moe_dec drop_tau, min_k).
struct xc_drop {
    float tau[QF_DEC_ROWS];
    int min_k;
};
void xcache_resolve(ctx *c, const qf_xcache *x, const int *ids, int n, const float *rl, int rl_stride, int rows, int K, const xc_drop &drop, int host);
void xcache_fill(ctx *c, const qf_xcache *x);
int xcache_hybrid(const qf_xcache *x, const float *rl, int rows, int K, const xc_drop &drop);
void xcache_host_start(ctx *c, const qf_xcache *x, const float *xin, const float *norm_w, float eps, int H, const float *rl, int rl_stride, int rows, int K);
void xcache_host_join(ctx *c, const qf_xcache *x, float *y, int rows, int H);
void xcache_link(ctx *c, const qf_xcache *x);
void link_spin(ctx *c, size_t bytes, cudaStream_t s);

// The ops table (ops_cuda.cu) and its memory and step functions (ctx_cuda.cu).
extern const qf_ops k_cuda_ops;
void *cu_alloc(qf_backend *be, size_t bytes);
void cu_free(qf_backend *be, void *p);
void cu_upload(qf_backend *be, void *dst, const void *src, size_t n);
void cu_read_pinned(qf_backend *be, void *dst, const void *src, size_t n);
void cu_copy(qf_backend *be, void *dst, const void *src, size_t n);
void cu_download(qf_backend *be, void *dst, const void *src, size_t n);
void cu_zero(qf_backend *be, void *p, size_t n);
void cu_step_begin(qf_backend *be, uint64_t key, int rows);
int cu_step_end(qf_backend *be, int abandon);
int cu_sync(qf_backend *be);
int cu_pin(qf_backend *be, void *p, size_t bytes);
void cu_unpin(qf_backend *be, void *p);
void *cu_pin_alloc(qf_backend *be, size_t bytes);
void cu_pin_free(qf_backend *be, void *p);
void cu_mem_info(qf_backend *be, size_t *free_bytes, size_t *total_bytes);
void cu_stage(qf_backend *be, int buf, int n, void *const *dst, const void *const *src, const size_t *bytes);
void cu_stage_wait(qf_backend *be, int buf);

// Argmax partials and per-row counts (dec_gemv_cuda.cu), zeroed once.
size_t argmax_scratch_bytes(void);

} // namespace qfc

#endif
