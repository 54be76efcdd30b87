// The CUDA backend's host side: the context (init, options, free), device memory, and the
// bracket of a step (recorded, replayed or eager, and the failure it reports).
#include "backend/cuda/ops_cuda.h"
#include "backend/cuda/cuda_int.cuh"
#include "base/timer.h"

namespace qfc {

// ---- memory ----

void *cu_alloc(qf_backend *be, size_t bytes) {
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return NULL;
    cudaMemset(p, 0, bytes);
    note_peak(C(be));
    return p;
}

void cu_free(qf_backend *be, void *p) {
    ctx *c = C(be);
    cudaFree(p);
}

void cu_upload(qf_backend *be, void *dst, const void *src, size_t n) {
    ctx *c = C(be);
    check(c, cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "upload");
    for (double until = c->link_ns > 0.0 ? qf_now() + 1e-9 * (double)n * c->link_ns : 0.0; qf_now() < until;) {
    } // option link_gbps: a slower link's time
}

// Option link_gbps: the extra ns a byte pays for the link capped at gbps, from the link's own
// rate (64 MiB copied from pinned memory, best of 3); 0 when the link is slower already.
static double link_extra_ns(int gbps) {
    size_t n = (size_t)64 << 20;
    void *h = NULL, *d = NULL;
    double best = 1e30;
    if (cudaMallocHost(&h, n) == cudaSuccess && cudaMalloc(&d, n) == cudaSuccess)
        for (int i = 0; i < 3; i++) {
            double t0 = qf_now();
            if (cudaMemcpy(d, h, n, cudaMemcpyHostToDevice) != cudaSuccess) break;
            best = fmin(best, qf_now() - t0);
        }
    cudaFreeHost(h), cudaFree(d), cudaGetLastError();
    double native = best < 1e29 ? 1e-9 * (double)n / best : 1e30; // GB/s
    return native > gbps ? 1.0 / gbps - 1.0 / native : 0.0;       // ns a byte: 1 GB/s is a byte a ns
}

void cu_download(qf_backend *be, void *dst, const void *src, size_t n) {
    ctx *c = C(be);
    graph_state *s = &c->gs;
    if (s->mode == G_EAGER) {
        check(c, cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "download");
        return;
    }
    // inside a graph step: into pinned staging, handed to dst once the graph has run
    if (s->out_used + n > s->pin_out_cap || s->n_outs == G_MAX_OUTS) {
        s->broken = 1;
        return;
    }
    s->outs[s->n_outs++] = {dst, s->out_used, n};
    g_copy(c, s->pin_out + s->out_used, src, n, cudaMemcpyDeviceToHost);
    s->out_used += (n + 255) & ~(size_t)255;
}

static double now_us(void) { return qf_now() * 1e6; }

// The step's first failure as the caller's error (and the launch errors CUDA holds); cleared, so
// the next step starts clean unless the device itself is lost (then it fails again).
static int take_error(ctx *c) {
    check(c, cudaPeekAtLastError(), "kernel launch");
    if (c->host_rc) dev_fail(c, "%s", c->host_err), c->host_rc = 0;
    if (!c->err) return QF_OK;
    c->err = 0;
    cudaGetLastError();
    return qf_fail(QF_EDEVICE, "CUDA device: %s", c->err_msg);
}

// The step's shape decides: graphs for up to QF_DEC_ROWS rows and a key (0: a step not to be
// recorded). A key recorded before replays (the arguments that changed are set again); a new key
// seen twice in a row is recorded over the least recently run recording.
static graph_rec *g_find(graph_state *s, uint64_t key) {
    for (int i = 0; i < G_SLOTS; i++)
        if (s->rs[i].key == key && s->rs[i].ex) return &s->rs[i];
    return NULL;
}
static graph_rec *g_victim(graph_state *s) {
    graph_rec *v = &s->rs[0];
    for (int i = 1; i < G_SLOTS; i++)
        if (s->rs[i].used < v->used) v = &s->rs[i];
    return v;
}

void cu_step_begin(qf_backend *be, uint64_t key, int rows) {
    ctx *c = C(be);
    graph_state *s = &c->gs;
    s->n = 0, s->n_outs = 0, s->out_used = 0, s->broken = 0, s->cur = NULL, s->tok_off = 0, s->mode = G_EAGER;
    if (c->st.on) c->st.t0 = now_us();
    int eligible = s->enabled && rows <= QF_DEC_ROWS && key != 0 && tok_room(c, (size_t)rows); // a recorded step's ids have a place each
    if (!eligible) {
        s->mode = G_EAGER;
        s->last_key = 0;
        return;
    }
    graph_rec *q = g_find(s, key);
    if (q) s->mode = G_REPLAY;
    else if (key == s->last_key) {
        c->st.recorded++;
        q = g_victim(s);
        if (q->ex) cudaGraphExecDestroy(q->ex), q->ex = NULL;
        if (q->g) cudaGraphDestroy(q->g), q->g = NULL;
        s->mode = cudaGraphCreate(&q->g, 0) == cudaSuccess ? G_RECORD : G_EAGER;
        q->arg_used = 0;
        q->key = key;
    } else s->mode = G_EAGER, c->st.eager++;
    if (q) q->used = ++s->tick;
    s->cur = s->mode == G_EAGER ? NULL : q;
    s->last_key = key;
}

int cu_step_end(qf_backend *be, int abandon) {
    ctx *c = C(be);
    graph_state *s = &c->gs;
    graph_rec *q = s->cur;
    int mode = s->mode;
    s->mode = G_EAGER;
    if (mode == G_EAGER && c->host_pending) check(c, cudaStreamSynchronize(0), "step with host experts"), c->host_pending = 0; // their result decides the step
    if (mode == G_EAGER) return take_error(c);
    if (abandon) { // the caller failed the step part-way: nothing of it runs, a partial recording is not kept
        if (mode == G_RECORD) q->key = 0;
        return take_error(c);
    }
    if (!s->broken && mode == G_RECORD) {
        q->n_rec = s->n;
        if (cudaGraphInstantiate(&q->ex, q->g, 0) != cudaSuccess) q->ex = NULL, s->broken = 1;
    }
    if (!s->broken && mode == G_REPLAY && s->n != q->n_rec) s->broken = 1;
    if (s->broken) { // never launched: this step's work is lost, so the step fails and graphs stop
        if (q->ex) cudaGraphExecDestroy(q->ex), q->ex = NULL;
        s->enabled = 0;
        c->err = 0;
        return qf_fail(QF_EDEVICE, "CUDA graph step diverged from its recording (graphs are now off)");
    }
    if (c->err) { // a kernel of the step could not be recorded: the step is not run
        if (q->ex) cudaGraphExecDestroy(q->ex), q->ex = NULL;
        q->key = 0;
        return take_error(c);
    }
    int timed = c->st.on && mode == G_REPLAY;
    double t_launch = timed ? now_us() : 0.0;
    if (timed) cudaEventRecord(c->st.ev[0], 0);
    check(c, cudaGraphLaunch(q->ex, 0), "graph launch");
    if (timed) cudaEventRecord(c->st.ev[1], 0);
    check(c, cudaStreamSynchronize(0), "graph step");
    for (int i = 0; i < s->n_outs; i++) memcpy(s->outs[i].dst, s->pin_out + s->outs[i].off, s->outs[i].bytes);
    if (timed) {
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, c->st.ev[0], c->st.ev[1]);
        c->st.gpu_ms += ms, c->st.host_us += t_launch - c->st.t0, c->st.wall_us += now_us() - c->st.t0, c->st.n++;
    }
    return take_error(c);
}

int cu_sync(qf_backend *be) {
    ctx *c = C(be);
    check(c, cudaDeviceSynchronize(), "synchronize");
    note_peak(c);
    return take_error(c);
}

// Host memory the kernels read in place (the expert cache's home): pinned and mapped; with unified
// addressing the device sees it at the host address, which the tables hold.
int cu_pin(qf_backend *be, void *p, size_t bytes) {
    (void)be;
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e != cudaSuccess) { // a read-only file mapping takes only a read-only registration
        cudaGetLastError();
        e = cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable | cudaHostRegisterReadOnly);
    }
    void *d = NULL;
    if (e == cudaSuccess && (cudaHostGetDevicePointer(&d, p, 0) != cudaSuccess || d != p)) {
        cudaHostUnregister(p);
        return qf_fail(QF_EDEVICE, "pinned host memory is not at the same address on the device (no unified addressing)");
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        return qf_fail(QF_EDEVICE, "cannot pin %.1f MiB of host memory for the device: %s", (double)bytes / 1048576.0, cudaGetErrorString(e));
    }
    return QF_OK;
}

void cu_unpin(qf_backend *be, void *p) {
    (void)be;
    cudaHostUnregister(p);
}

void *cu_pin_alloc(qf_backend *be, size_t bytes) {
    (void)be;
    void *p = NULL;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) return cudaGetLastError(), (void *)NULL;
    return p;
}

void cu_pin_free(qf_backend *be, void *p) {
    (void)be;
    if (p) cudaFreeHost(p);
}

void cu_mem_info(qf_backend *be, size_t *free_bytes, size_t *total_bytes) {
    (void)be;
    *free_bytes = *total_bytes = 0;
    cudaMemGetInfo(free_bytes, total_bytes);
}

// Staged copies run on the copy stream beside the ops (stream 0): after every op queued so far
// (stage_ev[2] marks them), and the ops wait for a buffer's copies only where they read it.
void cu_stage(qf_backend *be, int buf, int n, void *const *dst, const void *const *src, const size_t *bytes) {
    ctx *c = C(be);
    if (!c->copy_stream || !c->stage_ev[0] || !c->stage_ev[1] || !c->stage_ev[2] || buf < 0 || buf > 1)
        return dev_fail(c, "stage: no copy stream (or buffer %d is not 0 or 1)", buf);
    check(c, cudaEventRecord(c->stage_ev[2], 0), "stage: mark the ops");
    check(c, cudaStreamWaitEvent(c->copy_stream, c->stage_ev[2], 0), "stage: order after the ops");
    size_t all = 0;
    for (int i = 0; i < n; i++) check(c, cudaMemcpyAsync(dst[i], src[i], bytes[i], cudaMemcpyHostToDevice, c->copy_stream), "stage: copy"), all += bytes[i];
    link_spin(c, all, c->copy_stream);
    check(c, cudaEventRecord(c->stage_ev[buf], c->copy_stream), "stage: mark the copies");
}

void cu_stage_wait(qf_backend *be, int buf) {
    ctx *c = C(be);
    if (buf < 0 || buf > 1 || !c->stage_ev[buf]) return dev_fail(c, "stage_wait: buffer %d is not 0 or 1", buf);
    check(c, cudaStreamWaitEvent(0, c->stage_ev[buf], 0), "stage: wait for the copies");
}

void cu_zero(qf_backend *be, void *p, size_t n) {
    ctx *c = C(be);
    cudaMemsetAsync(p, 0, n, 0);
}

void cu_copy(qf_backend *be, void *dst, const void *src, size_t n) {
    ctx *c = C(be);
    check(c, cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, 0), "device copy");
}

} // namespace qfc

using namespace qfc;

extern "C" int qf_cuda_available(void) { return 1; }

// The options into the context, with what the device allows (programmatic launch and bulk
// copies need sm_90).
static void apply_opts(ctx *c, const qf_cuda_opts *o) {
    c->fp32 = o->precision == QF_PREC_FP32, c->bf16_single = o->precision == QF_PREC_BF16;
    c->pdl = c->cc_major >= 9 && o->pdl;
    c->early = o->early, c->pw1 = o->pw1, c->moe1 = o->moe1, c->moe_pf = o->moe_pf, c->route = o->route;
    c->gdn_lpc = o->gdn_lpc == 2 || o->gdn_lpc == 8 ? o->gdn_lpc : 4, c->gdn_gn = o->gdn_gn;
    c->bulk = c->cc_major >= 9 ? o->bulk : 0, c->bulk_blocks = o->bulk_blocks;
    c->att1 = o->att1, c->att_gate = o->att_gate, c->comb = o->comb;
    c->mg = o->mg, c->mg_cp = o->mg_cp, c->mg_p64 = o->mg_p64, c->dec_tc = o->dec_tc;
    // Below these rows the GEMV path is faster at the real shape (docs/performance.md).
    c->mg_min_rows = o->mg_min >= 0 ? o->mg_min : c->mg_cp ? 96 : 192;
    c->att_tile = o->att_tile, c->att_tc = o->att_tc;
    c->gdn_seq = o->gdn_seq, c->gdn_cp = o->gdn_cp, c->gdn_chunk = o->gdn_chunk, c->gdn_chunk_min = o->gdn_chunk_min;
    c->gdn_plpc = o->gdn_plpc == 1 || o->gdn_plpc == 2 || o->gdn_plpc == 8 ? o->gdn_plpc : 4;
    c->prof.on = o->profile;
    c->gs.enabled = o->graphs && !c->prof.on;
    c->st.on = o->steptime && cudaEventCreate(&c->st.ev[0]) == cudaSuccess && cudaEventCreate(&c->st.ev[1]) == cudaSuccess;
    for (int i = 0; c->prof.on && i < PROF_RING; i++) cudaEventCreate(&c->prof.ev[i][0]), cudaEventCreate(&c->prof.ev[i][1]);
}

extern "C" int qf_cuda_backend_init(qf_backend *be, int device, const qf_cuda_opts *opts) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) return qf_fail(QF_EUNSUPPORTED, "no CUDA device: %s", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    if (device < 0 || device >= n) return qf_fail(QF_EINVAL, "CUDA device %d does not exist (%d found)", device, n);
    if (cudaSetDevice(device) != cudaSuccess) return qf_fail(QF_EDEVICE, "CUDA device %d cannot be used", device);
    qf_cuda_opts def;
    qf_cuda_opts_default(&def);
    ctx *c = (ctx *)calloc(1, sizeof(ctx));
    if (!c) return qf_fail(QF_ENOMEM, "out of memory");
    c->device = device;
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
        snprintf(c->name, sizeof c->name, "%s", prop.name);
        c->cc_major = prop.major;
        c->sms = prop.multiProcessorCount, c->smem_optin = (int)prop.sharedMemPerBlockOptin, c->smem_sm = (int)prop.sharedMemPerMultiprocessor;
    }
    if (cublasCreate(&c->blas) != CUBLAS_STATUS_SUCCESS) {
        free(c);
        return qf_fail(QF_EUNSUPPORTED, "cuBLAS did not start");
    }
    cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH);
    apply_opts(c, opts ? opts : &def);
    if (cudaMalloc(&c->moe_cnt, 64) != cudaSuccess || cudaMemset(c->moe_cnt, 0, 64) != cudaSuccess) c->moe_cnt = NULL;
    if (cudaMalloc(&c->sp_ctr, 32) != cudaSuccess || cudaMemset(c->sp_ctr, 0, 32) != cudaSuccess) c->sp_ctr = NULL;
    if (cudaMalloc(&c->sp_count, 4096) != cudaSuccess || cudaMemset(c->sp_count, 0, 4096) != cudaSuccess) c->sp_count = NULL;
    if (cudaMalloc(&c->att_cnt, ATT_MAX_HEADS * 4) != cudaSuccess || cudaMemset(c->att_cnt, 0, ATT_MAX_HEADS * 4) != cudaSuccess) c->att_cnt = NULL;
    if (cudaMalloc(&c->amax, argmax_scratch_bytes()) != cudaSuccess || cudaMemset(c->amax, 0, argmax_scratch_bytes()) != cudaSuccess) c->amax = NULL;
    for (int i = 0; i < G_SLOTS; i++) c->gs.rs[i].argbuf = (unsigned char *)malloc(G_ARG_BYTES); // NULL: every replayed node is re-set
    c->gs.pin_out_cap = (size_t)64 << 20;
    if (cudaMallocHost((void **)&c->gs.pin_out, c->gs.pin_out_cap) != cudaSuccess) c->gs.pin_out = NULL, c->gs.pin_out_cap = 0;
    if (cudaStreamCreateWithFlags(&c->copy_stream, cudaStreamNonBlocking) != cudaSuccess) c->copy_stream = NULL;
    for (int i = 0; i < 3; i++)
        if (cudaEventCreateWithFlags(&c->stage_ev[i], cudaEventDisableTiming) != cudaSuccess) c->stage_ev[i] = NULL;
    if (cudaEventCreateWithFlags(&c->tok_ev, cudaEventDisableTiming) != cudaSuccess) c->tok_ev = NULL;
    if (cudaStreamCreateWithFlags(&c->host_stream, cudaStreamNonBlocking) != cudaSuccess) c->host_stream = NULL;
    for (int i = 0; i < 2; i++)
        if (cudaEventCreateWithFlags(&c->host_ev[i], cudaEventDisableTiming) != cudaSuccess) c->host_ev[i] = NULL;
    const qf_cuda_opts *uo = opts ? opts : &def;
    c->link_ns = uo->link_gbps > 0 ? link_extra_ns(uo->link_gbps) : 0.0;
    note_peak(c);
    be->ops = &k_cuda_ops;
    be->dev = c;
    return QF_OK;
}

extern "C" void qf_cuda_backend_free(qf_backend *be) {
    ctx *c = C(be);
    if (!c) return;
    cudaDeviceSynchronize();
    if (c->prof.on) {
        prof_flush(c);
        double total = 0;
        for (int i = 0; i < c->prof.n_names; i++) total += c->prof.ms[i];
        fprintf(stderr, "qflash cuda profile (kernel time by kernel, eager):\n");
        for (int i = 0; i < c->prof.n_names; i++)
            fprintf(stderr, "  %-22s %9ld calls %10.2f ms %5.1f%% %8.2f us/call\n", c->prof.names[i], c->prof.calls[i], c->prof.ms[i],
                    100 * c->prof.ms[i] / (total > 0 ? total : 1), 1e3 * c->prof.ms[i] / (c->prof.calls[i] ? c->prof.calls[i] : 1));
        for (int i = 0; i < PROF_RING; i++) cudaEventDestroy(c->prof.ev[i][0]), cudaEventDestroy(c->prof.ev[i][1]);
    }
    if (c->st.on) {
        long n = c->st.n ? c->st.n : 1;
        fprintf(stderr, "qflash cuda: %ld replayed steps: GPU %.1f us, host before launch %.1f us (%.1f nodes set again in %.1f us), begin to results %.1f us (means)\n",
                c->st.n, 1e3 * c->st.gpu_ms / n, c->st.host_us / n, (double)c->st.sets / n, c->st.set_us / n, c->st.wall_us / n);
        fprintf(stderr, "qflash cuda: %ld steps recorded, %ld run eager waiting for a key to repeat\n", c->st.recorded, c->st.eager);
        cudaEventDestroy(c->st.ev[0]), cudaEventDestroy(c->st.ev[1]);
    }
    free(c->draw_h), cudaFree(c->tok), cudaFree(c->xb), cudaFree(c->moe), cudaFree(c->draw), cudaFree(c->sp), cudaFree(c->ps), cudaFree(c->mg_buf), cudaFree(c->dtc), cudaFree(c->attn), cudaFree(c->gdnc), cudaFree(c->amax), cudaFree(c->moe_cnt), cudaFree(c->sp_ctr), cudaFree(c->sp_count), cudaFree(c->att_cnt), cudaFree(c->blas_ws);
    g_drop_all(c);
    cudaFreeHost(c->gs.pin_out), cudaFreeHost(c->gs.pin_tok);
    for (int i = 0; i < G_SLOTS; i++) free(c->gs.rs[i].argbuf);
    for (int i = 0; i < 3; i++)
        if (c->stage_ev[i]) cudaEventDestroy(c->stage_ev[i]);
    if (c->tok_ev) cudaEventDestroy(c->tok_ev);
    if (c->copy_stream) cudaStreamDestroy(c->copy_stream);
    if (c->host_stream) cudaStreamDestroy(c->host_stream);
    for (int i = 0; i < 2; i++)
        if (c->host_ev[i]) cudaEventDestroy(c->host_ev[i]);
    if (c->host_calls && c->st.on)
        fprintf(stderr, "qflash cuda: %ld host expert calls, %.1f us each (means)\n", c->host_calls, c->host_us / (double)c->host_calls);
    cublasDestroy(c->blas);
    free(c);
    be->dev = NULL;
}

extern "C" size_t qf_cuda_peak_bytes(const qf_backend *be) { return be->dev ? ((ctx *)be->dev)->peak : 0; }

extern "C" const char *qf_cuda_device_name(const qf_backend *be) { return be->dev ? ((ctx *)be->dev)->name : ""; }


