/* qflash bench's writers: the table with its methodology, the JSON, and the SVG plot. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/err.h"
#include "bench.h"

void bench_print(const bench_result *r) {
    printf("qflash bench: %s (%s), %d layers", r->source, r->model_type, r->layers);
    if (r->experts) printf(", %d experts (top-%d)", r->experts, r->experts_used);
    printf(", %.2f GB of weights\n", r->weight_bytes / 1e9);
    printf("machine: %s, %d cores; %d threads, ops %s", r->cpu, r->cores, r->threads, r->ops);
    if (r->peak_device_bytes > 0) printf("; device %s, peak device memory %.2f GiB", r->device, r->peak_device_bytes / 1073741824.0);
    if (r->scratch_grown) printf("; the ops grew %d scratch buffers past the load's reserve", r->scratch_grown);
    printf("\n");
    printf("methodology: 1 warm-up run (dropped), then %d runs per setting; median, spread min..max;\n"
           "  prompts prefilled one after another, in chunks of %d tokens; TTFT = start of the run to every stream's first token;\n"
           "  each decode step = one batched forward of one token per stream (ITL); greedy.\n",
           r->n_cfgs ? r->cfgs[0].runs : 0, r->prefill_chunk);
    if (r->bw_measured)
        printf("load: %.2f s   bandwidth: %.1f GB/s read (roofline), %.1f GB/s copy (read+write), 256 MiB probes   peak RSS: %.0f MiB\n",
               r->load_s, r->bw_gbs, r->copy_gbs, r->peak_rss_bytes / 1048576.0);
    else
        printf("load: %.2f s   bandwidth: %.1f GB/s (--bw)   peak RSS: %.0f MiB\n", r->load_s, r->bw_gbs, r->peak_rss_bytes / 1048576.0);
    if (r->n_cfgs && r->cfgs[0].expert_cache) printf("expert cache: loads and hit rate per configuration below\n");
    else printf("streaming loads: 0, expert cache hit rate: 0 (not active: no expert cache)\n");
    int any_sparse = 0;
    for (int i = 0; i < r->n_cfgs; i++) any_sparse |= r->cfgs[i].sparse;
    if (any_sparse) printf("sparsity: level and inactive blocks per configuration below\n\n");
    else printf("inactive-block ratio: 0 (not active: sparsity level 0)\n\n");
    printf("%5s %6s %5s | %10s %10s %9s | %8s %8s %8s | %10s %10s | %9s %9s %7s\n", "conc", "prompt", "gen", "prefill ms",
           "prefill/s", "TTFT ms", "ITL mean", "p50", "p99", "tok/s/strm", "tok/s all", "MB/token", "roofline", "% roof");
    for (int i = 0; i < r->n_cfgs; i++) {
        const bench_cfg *c = &r->cfgs[i];
        printf("%5d %6d %5d | %10.1f %10.1f %9.1f | %8.2f %8.2f %8.2f | %10.1f %10.1f | %9.2f %9.1f %6.1f%%\n", c->concurrency,
               c->prompt_len, c->gen_len, c->prefill_ms.median, c->prefill_tok_s.median, c->ttft_ms.median, c->itl_mean_ms,
               c->itl_p50_ms, c->itl_p99_ms, c->decode_tok_s_stream.median, c->decode_tok_s_total.median, c->bytes_per_token / 1e6,
               c->roofline_tok_s, c->roofline_pct);
        printf("%5s spread: prefill %.1f..%.1f ms, decode %.1f..%.1f tok/s total; %.1f experts per step%s\n", "", c->prefill_ms.min,
               c->prefill_ms.max, c->decode_tok_s_total.min, c->decode_tok_s_total.max, c->experts_per_step,
               c->experts_estimated ? " (estimated: uniform routing)" : "");
        if (c->expert_cache)
            printf("%5s expert cache: %.0f misses (%.0f of them computed on the host), %.1f%% of decode steps' expert uses hit, %.3f MB of experts moved "
                   "per token\n", "", c->streaming_loads, c->host_computed, 100.0 * c->expert_hit_rate, c->streamed_per_token / 1e6);
        if (c->sparse)
            printf("%5s sparsity level %.2f, inactive blocks: %.1f%% of routed experts dropped, %.1f%% of trunk projection inputs zeroed, %.1f%% of KV pages "
                   "skipped\n", "", c->level, 100.0 * c->inactive_experts, 100.0 * c->inactive_trunk, 100.0 * c->inactive_kv);
        printf("%5s decoded ids: %016llx (FNV-1a of the last run's ids)\n", "", (unsigned long long)c->ids_digest);
    }
}

static json_t *jstat(bench_stat s) { return json_pack("{s:f,s:f,s:f}", "median", s.median, "min", s.min, "max", s.max); }

static json_t *jcfg(const bench_cfg *c) {
    json_t *j = json_pack("{s:i,s:i,s:i,s:i,s:i}", "concurrency", c->concurrency, "prompt_len", c->prompt_len, "gen_len", c->gen_len,
                          "runs", c->runs, "decode_steps", c->decode_steps);
    json_object_set_new(j, "prefill_ms", jstat(c->prefill_ms));
    json_object_set_new(j, "prefill_tok_s", jstat(c->prefill_tok_s));
    json_object_set_new(j, "ttft_ms", jstat(c->ttft_ms));
    json_object_set_new(j, "decode_seconds", jstat(c->decode_s));
    json_object_set_new(j, "decode_tok_s_total", jstat(c->decode_tok_s_total));
    json_object_set_new(j, "decode_tok_s_per_stream", jstat(c->decode_tok_s_stream));
    json_object_set_new(j, "itl_ms", json_pack("{s:f,s:f,s:f,s:i}", "mean", c->itl_mean_ms, "p50", c->itl_p50_ms, "p99", c->itl_p99_ms,
                                               "samples", c->n_itl));
    json_object_set_new(j, "experts_per_step", json_real(c->experts_per_step));
    json_object_set_new(j, "experts_per_step_source", json_string(c->experts_estimated ? "estimated (uniform routing)" : "counted"));
    json_object_set_new(j, "bytes_per_step", json_real(c->bytes_per_step));
    json_object_set_new(j, "bytes_per_token", json_real(c->bytes_per_token));
    json_object_set_new(j, "roofline_tok_s", json_real(c->roofline_tok_s));
    json_object_set_new(j, "roofline_pct", json_real(c->roofline_pct));
    char dg[24];
    snprintf(dg, sizeof dg, "%016llx", (unsigned long long)c->ids_digest);
    json_object_set_new(j, "decoded_ids_fnv1a", json_string(dg));
    json_t *runs = json_array();
    for (int r = 0; r < c->runs; r++)
        json_array_append_new(runs, json_pack("{s:f,s:f,s:f,s:f}", "prefill_ms", c->run_prefill_ms[r], "ttft_ms", c->run_ttft_ms[r],
                                              "decode_seconds", c->run_decode_s[r], "itl_sum_ms", c->run_itl_sum_ms[r]));
    json_object_set_new(j, "run_details", runs);
    json_object_set_new(j, "streaming_loads", json_integer((json_int_t)c->streaming_loads));
    json_object_set_new(j, "host_computed", json_integer((json_int_t)c->host_computed));
    json_object_set_new(j, "expert_cache_hit_rate", json_real(c->expert_hit_rate));
    json_object_set_new(j, "streamed_bytes_per_token", json_real(c->streamed_per_token));
    json_object_set_new(j, "sparsity_level", json_real(c->level));
    json_object_set_new(j, "inactive_block_ratio", json_pack("{s:f,s:f,s:f}", "experts", c->inactive_experts, "trunk", c->inactive_trunk, "kv_pages", c->inactive_kv));
    json_t *na = json_array();
    if (!c->expert_cache) json_array_append_new(na, json_string("streaming_loads")), json_array_append_new(na, json_string("expert_cache_hit_rate"));
    if (!c->sparse) json_array_append_new(na, json_string("inactive_block_ratio"));
    json_object_set_new(j, "not_active", na);
    return j;
}

int bench_write_json(const bench_result *r, const char *path) {
    json_t *root = json_pack("{s:s,s:{s:s,s:i,s:i},s:{s:s,s:s,s:i,s:i,s:i,s:f}}", "device", r->peak_device_bytes > 0 ? "cuda" : "cpu", "machine", "cpu", r->cpu, "cores",
                             r->cores, "threads", r->threads, "model", "source", r->source, "model_type", r->model_type, "layers",
                             r->layers, "experts", r->experts, "experts_used", r->experts_used, "weight_bytes", r->weight_bytes);
    json_object_set_new(root, "methodology",
                        json_pack("{s:i,s:i,s:i,s:s,s:s,s:s}", "warmup_runs", 1, "runs", r->n_cfgs ? r->cfgs[0].runs : 0, "prefill_chunk", r->prefill_chunk, "statistic", "median",
                                  "spread", "min..max", "ttft", "start of the run to every stream's first token (prompts one after another)"));
    json_object_set_new(root, "load_seconds", json_real(r->load_s));
    json_t *bw = json_pack("{s:f,s:s}", "gb_s", r->bw_gbs, "source", r->bw_measured ? "probe: 256 MiB read" : "--bw");
    if (r->bw_measured) json_object_set_new(bw, "copy_gb_s", json_real(r->copy_gbs));
    json_object_set_new(root, "bandwidth", bw);
    json_object_set_new(root, "peak_rss_bytes", json_real(r->peak_rss_bytes));
    json_object_set_new(root, "peak_device_bytes", r->peak_device_bytes > 0 ? json_real(r->peak_device_bytes) : json_null());
    if (r->peak_device_bytes > 0) json_object_set_new(json_object_get(root, "machine"), "gpu", json_string(r->device));
    json_t *cfgs = json_array(), *mem = json_array();
    for (int i = 0; i < r->n_cfgs; i++) json_array_append_new(cfgs, jcfg(&r->cfgs[i]));
    for (int i = 0; i < r->n_mem; i++)
        json_array_append_new(mem, json_pack("{s:f,s:f,s:s}", "t", r->mem[i].t, "rss_bytes", r->mem[i].rss_bytes, "phase", r->mem[i].phase));
    json_object_set_new(root, "configs", cfgs);
    json_object_set_new(root, "memory_trace", mem);
    int rc = json_dump_file(root, path, JSON_INDENT(1)) == 0 ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
    json_decref(root);
    return rc;
}

/* ---- SVG: memory over time (left) and the ITL histogram of each setting (right) ---- */

static const char *COLORS[] = {"#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"};

static void axes(FILE *f, double x, double y, double w, double h, const char *title, const char *xl, const char *yl, double xmax, double ymax) {
    fprintf(f, "<rect x='%g' y='%g' width='%g' height='%g' fill='none' stroke='#999'/>\n", x, y, w, h);
    fprintf(f, "<text x='%g' y='%g' font-size='14' font-weight='bold'>%s</text>\n", x, y - 10, title);
    fprintf(f, "<text x='%g' y='%g' font-size='12' text-anchor='middle'>%s</text>\n", x + w / 2, y + h + 34, xl);
    fprintf(f, "<text x='%g' y='%g' font-size='12' text-anchor='middle' transform='rotate(-90 %g %g)'>%s</text>\n", x - 48, y + h / 2,
            x - 48, y + h / 2, yl);
    for (int i = 0; i <= 4; i++) {
        fprintf(f, "<text x='%g' y='%g' font-size='11' text-anchor='middle'>%.3g</text>\n", x + w * i / 4, y + h + 16, xmax * i / 4);
        fprintf(f, "<text x='%g' y='%g' font-size='11' text-anchor='end'>%.4g</text>\n", x - 4, y + h - h * i / 4 + 4, ymax * i / 4);
        fprintf(f, "<line x1='%g' y1='%g' x2='%g' y2='%g' stroke='#eee'/>\n", x, y + h - h * i / 4, x + w, y + h - h * i / 4);
    }
}

static void mem_panel(FILE *f, const bench_result *r) {
    double x = 70, y = 50, w = 420, h = 260, tmax = 1e-9, mmax = 1e-9;
    for (int i = 0; i < r->n_mem; i++) {
        tmax = fmax(tmax, r->mem[i].t);
        mmax = fmax(mmax, r->mem[i].rss_bytes / 1048576.0);
    }
    axes(f, x, y, w, h, "Resident memory (sampled every 100 ms)", "seconds", "MiB", tmax, mmax * 1.1);
    fprintf(f, "<polyline fill='none' stroke='%s' stroke-width='2' points='", COLORS[0]);
    for (int i = 0; i < r->n_mem; i++)
        fprintf(f, "%.1f,%.1f ", x + w * r->mem[i].t / tmax, y + h - h * (r->mem[i].rss_bytes / 1048576.0) / (mmax * 1.1));
    fprintf(f, "'/>\n");
    const char *last = NULL;
    for (int i = 0; i < r->n_mem; i++) /* phase changes as labelled ticks */
        if (!last || strcmp(last, r->mem[i].phase)) {
            last = r->mem[i].phase;
            double px = x + w * r->mem[i].t / tmax;
            fprintf(f, "<line x1='%.1f' y1='%g' x2='%.1f' y2='%g' stroke='#bbb' stroke-dasharray='3,3'/>\n", px, y, px, y + h);
            fprintf(f, "<text x='%.1f' y='%g' font-size='10' fill='#666' transform='rotate(90 %.1f %g)'>%s</text>\n", px + 3, y + 4, px + 3,
                    y + 4, last);
        }
}

static void itl_panel(FILE *f, const bench_result *r) {
    enum { BINS = 30 };
    double x = 590, y = 50, w = 420, h = 260, lo = 1e30, hi = 0;
    for (int c = 0; c < r->n_cfgs; c++)
        for (int i = 0; i < r->cfgs[c].n_itl; i++) lo = fmin(lo, r->cfgs[c].itl_ms[i]), hi = fmax(hi, r->cfgs[c].itl_ms[i]);
    if (hi <= lo) hi = lo + 1;
    double bw = (hi - lo) / BINS;
    int counts[6][BINS] = {{0}}, cmax = 1;
    for (int c = 0; c < r->n_cfgs && c < 6; c++)
        for (int i = 0; i < r->cfgs[c].n_itl; i++) {
            int b = (int)((r->cfgs[c].itl_ms[i] - lo) / bw);
            b = b >= BINS ? BINS - 1 : b;
            if (++counts[c][b] > cmax) cmax = counts[c][b];
        }
    axes(f, x, y, w, h, "Inter-token latency histogram", "ms per decode step", "steps", hi - lo, cmax);
    fprintf(f, "<text x='%g' y='%g' font-size='11'>from %.3g ms</text>\n", x, y + h + 48, lo);
    int n = r->n_cfgs < 6 ? r->n_cfgs : 6;
    for (int c = 0; c < n; c++) {
        double bar = w / BINS / n;
        for (int b = 0; b < BINS; b++)
            if (counts[c][b])
                fprintf(f, "<rect x='%.1f' y='%.1f' width='%.1f' height='%.1f' fill='%s'/>\n", x + w * b / BINS + c * bar,
                        y + h - h * counts[c][b] / cmax, bar, h * counts[c][b] / cmax, COLORS[c]);
        fprintf(f, "<rect x='%g' y='%g' width='10' height='10' fill='%s'/><text x='%g' y='%g' font-size='11'>concurrency %d: mean %.2f ms, p99 %.2f ms</text>\n",
                x + w - 230, y + 10 + 16 * c, COLORS[c], x + w - 215, y + 19 + 16 * c, r->cfgs[c].concurrency, r->cfgs[c].itl_mean_ms,
                r->cfgs[c].itl_p99_ms);
    }
}

int bench_write_svg(const bench_result *r, const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return qf_fail(QF_EIO, "cannot write %s", path);
    fprintf(f, "<svg xmlns='http://www.w3.org/2000/svg' width='1060' height='400' font-family='sans-serif'>\n");
    fprintf(f, "<rect width='100%%' height='100%%' fill='white'/>\n");
    fprintf(f, "<text x='20' y='22' font-size='13'>qflash bench: %s, %d layers; %s, %d threads</text>\n", r->source, r->layers, r->cpu, r->threads);
    mem_panel(f, r);
    itl_panel(f, r);
    fprintf(f, "</svg>\n");
    return fclose(f) == 0 ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
}
