#include "experts/plan.h"

#include <string.h>

#include "base/err.h"
#include "experts/cache_policy.h"

#define MIB 1048576.0
#define GIB 1073741824.0

static int refuse_small(const qf_plan_in *in, const qf_plan *p, size_t fixed, size_t per_layer, int least) {
    return qf_fail(QF_EINVAL,
                   "%s leaves %.0f MiB for the expert buffer: %d slots a layer, at least %d (2 x top-%d) are needed: %.0f MiB of buffer, "
                   "a budget of at least %.2f GiB (context %.0f, trunk %.0f, workspace and scratch %.0f, states and KV %.0f, sparsity's "
                   "transposed weights %.0f, margin %.0f MiB)",
                   in->cache_bytes ? "--expert-cache" : "the GPU budget", (double)p->buffer / MIB, p->slots, least, in->top_k,
                   (double)(per_layer * (size_t)least) / MIB, (double)(fixed + per_layer * (size_t)least) / GIB, (double)p->context / MIB,
                   (double)p->trunk / MIB, (double)p->workspace / MIB, (double)p->reserve / MIB, (double)p->sparse / MIB, (double)p->margin / MIB);
}

/* The buffer: the flag's size, else what the budget leaves; then two staging layers when they
 * leave the decode slots three tokens' experts (a layered prompt without them reads every expert
 * over the link once a chunk and pass: tens of seconds for 8K tokens, against ~1.5 s staged), and
 * the slots a layer from the rest. */
static void split_buffer(const qf_plan_in *in, qf_plan *p, size_t fixed) {
    size_t per_layer = p->slot_bytes * (size_t)p->n_layers, stage = 2 * p->slot_bytes * (size_t)p->n_experts;
    p->buffer = in->cache_bytes ? in->cache_bytes : p->budget > fixed ? p->budget - fixed : 0;
    p->stage = p->buffer >= stage + per_layer * (size_t)(3 * in->top_k) ? stage : 0;
    p->slots = (int)((p->buffer - p->stage) / per_layer);
    if (p->slots > p->n_experts) p->slots = p->n_experts, p->buffer = per_layer * (size_t)p->n_experts + p->stage;
}

int qf_plan_make(const qf_plan_in *in, qf_plan *p) {
    memset(p, 0, sizeof *p);
    if (in->slot_bytes == 0 || in->n_layers < 1 || in->n_experts < 1 || in->top_k < 1)
        return qf_fail(QF_EINVAL, "an expert plan needs the experts' shapes (slot %zu bytes, %d layers, %d experts, top-%d)", in->slot_bytes, in->n_layers,
                       in->n_experts, in->top_k);
    *p = (qf_plan){.active = 1, .budget = in->budget, .device_total = in->device_total, .context = in->context, .trunk = in->trunk,
                   .workspace = in->workspace, .reserve = in->reserve, .margin = QF_PLAN_MARGIN, .sparse = in->sparse, .slot_bytes = in->slot_bytes,
                   .n_experts = in->n_experts, .n_layers = in->n_layers, .policy = in->policy};
    p->host_experts = p->slot_bytes * (size_t)p->n_experts * (size_t)p->n_layers;
    p->host_reserve = in->host_reserve;
    if (in->host_ram > 0 && (double)(p->host_experts + p->host_reserve) > 0.9 * in->host_ram)
        return qf_fail(QF_EINVAL, "the routed experts take %.1f GiB of host memory to stream from, prefix snapshots up to %.1f GiB; this machine has %.1f GiB of RAM",
                       (double)p->host_experts / GIB, (double)p->host_reserve / GIB, in->host_ram / GIB);
    if (p->budget > in->device_total)
        return qf_fail(QF_EINVAL, "--gpu-mem %.1f GiB is more than the device's %.1f GiB", (double)p->budget / GIB, (double)in->device_total / GIB);
    size_t fixed = p->context + p->trunk + p->workspace + p->reserve + p->sparse + p->margin;
    split_buffer(in, p, fixed);
    /* a token's experts and as many again: below that every step evicts what the next one needs */
    int least = 2 * in->top_k;
    if (p->slots < least) return refuse_small(in, p, fixed, p->slot_bytes * (size_t)p->n_layers, least);
    size_t need = p->buffer + p->reserve + p->sparse + p->margin;
    if (need > in->device_free)
        return qf_fail(QF_EINVAL, "the expert buffer (%.0f MiB) with states, KV and scratch needs %.0f MiB; the device has %.0f MiB free", (double)p->buffer / MIB,
                       (double)need / MIB, (double)in->device_free / MIB);
    return QF_OK;
}

void qf_plan_print(FILE *f, const qf_plan *p) {
    if (!p->active) return;
    fprintf(f, "expert streaming plan (MiB): context %.0f, trunk %.0f, workspace and scratch %.0f, states and KV %.0f (reserved), "
               "margin %.0f, expert buffer %.0f",
            (double)p->context / MIB, (double)p->trunk / MIB, (double)p->workspace / MIB, (double)p->reserve / MIB, (double)p->margin / MIB,
            (double)p->buffer / MIB);
    if (p->sparse) fprintf(f, ", sparsity's transposed weights %.0f", (double)p->sparse / MIB);
    if (p->budget) fprintf(f, " of a budget of %.0f", (double)p->budget / MIB);
    fprintf(f, "\n  %d of %d experts a layer in device slots (%.1f%% resident, %s), the rest read from %.1f GiB of pinned host memory; ",
            p->slots, p->n_experts, 100.0 * p->slots / p->n_experts, qf_policy_name(p->policy), (double)p->host_experts / GIB);
    if (p->stage) fprintf(f, "prompt chunks stage whole layers (2 x %.0f MiB of the buffer); ", (double)p->stage / 2 / MIB);
    if (p->host_reserve) fprintf(f, "prefix snapshots' DeltaNet copies in up to %.0f MiB of pinned host memory; ", (double)p->host_reserve / MIB);
    if (p->host_threads)
        fprintf(f, "\n  hybrid: %d host threads compute up to %.0f%% of a decode step's misses less %.2f (an expert %.3f ms on the host after %.3f ms a call, "
                   "%.3f ms over the link); ",
                p->host_threads, 100.0 * p->host_share, p->host_fixed, p->host_ms, p->host_fixed_ms, p->link_ms);
    size_t planned = p->context + p->trunk + p->workspace + p->buffer;
    fprintf(f, "device memory in use after warm-up %.0f MiB of %.0f (planned so far %.0f)\n", (double)p->used_after_warmup / MIB, (double)p->device_total / MIB,
            (double)planned / MIB);
}
