// QFLASH_CUDA_TRACE=1: one replayed decode step as a timeline. Thread 0 of every block of the
// decode kernels stamps the global timer (decode_cuda.cu tr()): the block's start, the return of
// its programmatic wait, its end, and the one-kernel MoE's phases. Kernels of one kind never
// overlap (two kinds alike are at least one kernel apart, and only neighbours overlap), so a
// kind's blocks are cut into launches by counting their starts against the grid.
#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_int.cuh"

namespace qfc {

namespace {

struct inst {
    unsigned tag, grid, starts;
    double first[TR_EVENTS], last[TR_EVENTS]; // us from the step's first stamp; < 0: none
};

const char *kind_name(unsigned tag) {
    switch (tag) {
    case 1: return "out/o_proj";
    case 2: return "lm_head";
    case 4: return "ffn_in";
    case 8: return "in_proj/qkv";
    case 16: return "deltanet";
    case 32: return "attention";
    case 64: return "moe";
    case 256: return "argmax";
    default: return "?";
    }
}

std::vector<inst> cut(std::vector<trec> &r) {
    std::sort(r.begin(), r.end(), [](const trec &a, const trec &b) { return a.t < b.t; });
    std::vector<inst> v;
    std::vector<int> open(65536, -1);
    double t0 = r.empty() ? 0.0 : (double)r[0].t;
    for (const trec &e : r) {
        int &o = open[e.tag];
        if (e.ev == TR_START && (o < 0 || v[o].starts == v[o].grid)) {
            inst n = {e.tag, e.grid, 0, {}, {}};
            std::fill(n.first, n.first + TR_EVENTS, -1.0), std::fill(n.last, n.last + TR_EVENTS, -1.0);
            v.push_back(n), o = (int)v.size() - 1;
        }
        if (o < 0 || e.ev >= TR_EVENTS) continue;
        inst &k = v[o];
        double t = ((double)e.t - t0) / 1e3;
        k.starts += e.ev == TR_START;
        if (k.first[e.ev] < 0) k.first[e.ev] = t;
        k.last[e.ev] = t;
    }
    return v;
}

} // namespace

// Each launch in start order: when its blocks started, their waits returned and they ended
// (first..last), and what it adds to the step: its last end minus the launch before's.
void trace_report(std::vector<trec> &r, FILE *f) {
    std::vector<inst> v = cut(r);
    fprintf(f, "qflash cuda trace: %zu stamps, %zu launches (us from the step's first stamp; 'adds' = last end - previous launch's last end)\n",
            r.size(), v.size());
    fprintf(f, "  %3s %-12s %5s %17s %17s %17s %7s  %s\n", "#", "kind", "grid", "start", "wait returned", "end", "adds",
            "phases (first..last): moe: logits read, ranked, routed, gate/up done, past the count; tail: step done, core counted, "
            "out_proj weights in, out_proj done, x counted, router rows counted, gate/up done, past the count");
    double sum[17] = {0}, wr[17] = {0}, post[17] = {0}; // by the tag's bit (16: none)
    int cnt[17] = {0};
    for (size_t i = 0; i < v.size(); i++) {
        inst &k = v[i];
        double prev = i ? v[i - 1].last[TR_END] : k.first[TR_START], adds = k.last[TR_END] - prev;
        fprintf(f, "  %3zu %-12s %5u %8.1f..%7.1f %8.1f..%7.1f %8.1f..%7.1f %7.1f", i, kind_name(k.tag), k.grid, k.first[TR_START], k.last[TR_START],
                k.first[TR_WAIT], k.last[TR_WAIT], k.first[TR_END], k.last[TR_END], adds);
        for (int ev = TR_LOGITS; ev < TR_EVENTS; ev++)
            if (k.first[ev] >= 0) fprintf(f, " %6.1f..%5.1f", k.first[ev], k.last[ev]);
        fprintf(f, "\n");
        int b = 0;
        while (b < 16 && !(k.tag >> b & 1)) b++;
        if (!i) continue;
        sum[b] += adds, wr[b] += k.last[TR_WAIT] - prev, post[b] += k.last[TR_END] - k.last[TR_WAIT], cnt[b]++;
    }
    fprintf(f, "  by kind (means): adds | wait returned after the previous launch's end | its last wait to its last end\n");
    for (int b = 0; b < 16; b++)
        if (cnt[b]) fprintf(f, "    %-12s x%-3d %7.2f | %7.2f | %7.2f\n", kind_name(1u << b), cnt[b], sum[b] / cnt[b], wr[b] / cnt[b], post[b] / cnt[b]);
}

} // namespace qfc
