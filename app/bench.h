/* qflash bench: what one run of the benchmark measured, and its writers (table, JSON, SVG). */
#ifndef QF_APP_BENCH_H
#define QF_APP_BENCH_H

#include <stddef.h>
#include <stdint.h>

typedef struct bench_stat {
    double median, min, max;
} bench_stat;

/* One concurrency setting: medians over the runs, spread as min..max. */
typedef struct bench_cfg {
    int concurrency, prompt_len, gen_len, runs;
    bench_stat prefill_ms, prefill_tok_s, ttft_ms, decode_s, decode_tok_s_total, decode_tok_s_stream;
    double itl_mean_ms, itl_p50_ms, itl_p99_ms; /* over every step of every run */
    double *itl_ms;                             /* every step, for the histogram */
    int n_itl;
    int decode_steps;                           /* per stream per run: gen_len - 1 */
    double run_prefill_ms[64], run_ttft_ms[64], run_decode_s[64], run_itl_sum_ms[64]; /* each run, in order */
    int experts_estimated; /* experts_per_step from uniform routing, not counted */
    double experts_per_step, bytes_per_step, bytes_per_token, roofline_tok_s, roofline_pct;
    int expert_cache;           /* the experts go through a cache: the two below are counted */
    double expert_hit_rate;     /* decode steps' expert uses found in the cache */
    double streamed_per_token;  /* bytes of experts loaded per decoded token */
    double streaming_loads;     /* experts loaded in the decode steps of every run */
    double host_computed;       /* of the misses, computed on the host (hybrid execution), every run */
    double inactive_experts, inactive_trunk, inactive_kv; /* sparsity: routed experts dropped, trunk inputs zeroed, KV pages skipped (decode steps) */
    int sparse;                              /* a sparsity level above 0 was on */
    float level;                             /* the level (layer 1's) */
    uint64_t ids_digest; /* FNV-1a of the last run's decoded ids, every stream every step: equal across
                          * builds and settings whose kernels sum in the same order (an exactness check
                          * at shapes with no reference) */
} bench_cfg;

typedef struct bench_mem {
    double t;          /* seconds since start */
    double rss_bytes;
    const char *phase;
} bench_mem;

typedef struct bench_result {
    char cpu[128], source[512], model_type[96], ops[32], device[300];
    double peak_device_bytes; /* 0: no device */
    int scratch_grown;        /* scratch buffers the device's ops grew past the load's reserve (0: the bound held) */
    int cores, threads, layers, experts, experts_used;
    int prefill_chunk; /* a prompt's tokens per forward call */
    double load_s, weight_bytes, bw_gbs, copy_gbs; /* bw_gbs: the roofline's (read probe, or --bw) */
    int bw_measured; /* 1: the probe, 0: --bw */
    bench_cfg *cfgs;
    int n_cfgs;
    bench_mem *mem;
    int n_mem;
    double peak_rss_bytes;
} bench_result;

void bench_print(const bench_result *r);
int bench_write_json(const bench_result *r, const char *path);
int bench_write_svg(const bench_result *r, const char *path);

#endif
