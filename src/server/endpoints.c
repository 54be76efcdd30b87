/* GET endpoints: /v1/models, /metrics (Prometheus text format), /ready, and the chat page at /. */
#include <event2/buffer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/server_int.h"

extern const char qf_webui_html[];
extern const size_t qf_webui_html_len;

static json_t *model_object(srv *s, const char *id) {
    return json_pack("{s:s,s:s,s:I,s:s,s:s,s:i}", "id", id, "object", "model", "created", (json_int_t)time(NULL), "owned_by", "qflash", "root",
                     s->model_name, "max_model_len", s->o->sched.ctx);
}

void ep_models(srv *s, struct evhttp_request *req) {
    srv_count(s, 200);
    srv_send_json(req, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", model_object(s, s->model_name)));
}

void ep_model(srv *s, struct evhttp_request *req, const char *escaped) {
    char *name = evhttp_uridecode(escaped, 0, NULL);
    if (name && srv_model_known(s, name)) {
        srv_count(s, 200);
        srv_send_json(req, 200, model_object(s, name));
    } else {
        srv_count(s, 404);
        srv_send_error_code(req, 404, "invalid_request_error", "model_not_found", "The model '%.200s' does not exist", name ? name : escaped);
    }
    free(name);
}

/* label: the series' labels without the braces ("" for none). */
static void histogram(struct evbuffer *b, const char *label, const char *name, const char *help, const uint64_t *h, const double *bounds,
                      uint64_t n, double sum) {
    const char *sep = *label ? "," : "", *open = *label ? "{" : "", *close = *label ? "}" : "";
    evbuffer_add_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < 15; i++) evbuffer_add_printf(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, label, sep, bounds[i], (unsigned long long)h[i]);
    evbuffer_add_printf(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n%s_sum%s%s%s %.6f\n%s_count%s%s%s %llu\n", name, label, sep, (unsigned long long)h[15], name,
                        open, label, close, sum, name, open, label, close, (unsigned long long)n);
}

static void metric(struct evbuffer *b, const char *label, const char *name, const char *type, const char *help, double v) {
    const char *open = *label ? "{" : "", *close = *label ? "}" : "";
    evbuffer_add_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s%s%s%s %.17g\n", name, help, name, type, name, open, label, close, v);
}

qf_sched *srv_pick(srv *s) {
    int best = 0, load = -1;
    for (int i = 0; i < s->n_dp; i++) {
        qf_sched_stats st;
        qf_sched_get_stats(s->sx[i], &st);
        if (load < 0 || st.running + st.waiting < load) best = i, load = st.running + st.waiting;
    }
    return s->sx[best];
}

void srv_stats(srv *s, qf_sched_stats *out) {
    memset(out, 0, sizeof *out);
    if (!atomic_load(&s->ready)) return; /* the replicas are the loader's until then */
    qf_sched_get_stats(s->sx[0], out);
    for (int i = 1; i < s->n_dp; i++) {
        qf_sched_stats t;
        qf_sched_get_stats(s->sx[i], &t);
        out->requests += t.requests, out->finished += t.finished, out->cancelled += t.cancelled, out->preempted += t.preempted;
        out->prompt_tokens += t.prompt_tokens, out->gen_tokens += t.gen_tokens, out->steps += t.steps;
        out->running += t.running, out->waiting += t.waiting, out->kv_pages_used += t.kv_pages_used, out->kv_pages_total += t.kv_pages_total;
        out->kv_pages_cached += t.kv_pages_cached;
        out->expert_hits += t.expert_hits, out->expert_misses += t.expert_misses, out->expert_bytes_loaded += t.expert_bytes_loaded;
        for (int b = 0; b < 16; b++) out->ttft_hist[b] += t.ttft_hist[b], out->itl_hist[b] += t.itl_hist[b];
        out->ttft_n += t.ttft_n, out->itl_n += t.itl_n, out->ttft_sum += t.ttft_sum, out->itl_sum += t.itl_sum;
        out->prefix_hits += t.prefix_hits, out->prefix_misses += t.prefix_misses, out->prefix_tokens += t.prefix_tokens;
        out->prefix_evicted += t.prefix_evicted, out->prefix_snapshots += t.prefix_snapshots, out->prefix_bytes += t.prefix_bytes;
        out->prefix_budget += t.prefix_budget, out->masks += t.masks, out->mask_seconds += t.mask_seconds;
        out->spec_steps += t.spec_steps, out->spec_drafted += t.spec_drafted, out->spec_accepted += t.spec_accepted;
        for (int b = 0; b < 16; b++) {
            out->e2e_hist[b] += t.e2e_hist[b], out->queue_hist[b] += t.queue_hist[b], out->prefill_hist[b] += t.prefill_hist[b];
            out->decode_hist[b] += t.decode_hist[b], out->ptok_hist[b] += t.ptok_hist[b], out->gtok_hist[b] += t.gtok_hist[b];
        }
        out->req_n += t.req_n, out->e2e_sum += t.e2e_sum, out->queue_sum += t.queue_sum, out->prefill_sum += t.prefill_sum;
        out->decode_sum += t.decode_sum, out->ptok_sum += t.ptok_sum, out->gtok_sum += t.gtok_sum;
        out->finished_stop += t.finished_stop, out->finished_length += t.finished_length, out->finished_error += t.finished_error;
    }
}

/* Each replica's load, when there are several (--dp). */
static void replica_lines(struct evbuffer *b, srv *s) {
    if (!atomic_load(&s->ready) || s->n_dp < 2) return;
    unsigned long long req[QF_SRV_MAX_DP];
    int running[QF_SRV_MAX_DP];
    for (int i = 0; i < s->n_dp; i++) {
        qf_sched_stats t;
        qf_sched_get_stats(s->sx[i], &t);
        req[i] = (unsigned long long)t.requests, running[i] = t.running;
    }
    evbuffer_add_printf(b, "# HELP qflash:replica_requests_total Generation requests a replica accepted.\n# TYPE qflash:replica_requests_total counter\n");
    for (int i = 0; i < s->n_dp; i++) evbuffer_add_printf(b, "qflash:replica_requests_total{replica=\"%d\"} %llu\n", i, req[i]);
    evbuffer_add_printf(b, "# HELP qflash:replica_num_requests_running Sequences holding a replica's slots.\n# TYPE qflash:replica_num_requests_running gauge\n");
    for (int i = 0; i < s->n_dp; i++) evbuffer_add_printf(b, "qflash:replica_num_requests_running{replica=\"%d\"} %d\n", i, running[i]);
}

/* The gauges and counters routers and autoscalers read, under vLLM's names (the gateway API
 * inference extension, vllm-router and llm-d scrape these): the same values as ours above. */
static void vllm_aliases(struct evbuffer *b, const qf_sched_stats *st, const char *model) {
    char m[300];
    snprintf(m, sizeof m, "model_name=\"%s\"", model);
    double kv = st->kv_pages_total > 0 ? (double)st->kv_pages_used / st->kv_pages_total : 0.0;
    metric(b, m, "vllm:num_requests_running", "gauge", "Alias of qflash:num_requests_running.", st->running);
    metric(b, m, "vllm:num_requests_waiting", "gauge", "Alias of qflash:num_requests_waiting.", st->waiting);
    metric(b, m, "vllm:kv_cache_usage_perc", "gauge", "KV cache pages in use by running sequences, 0..1.", kv);
    metric(b, m, "vllm:gpu_cache_usage_perc", "gauge", "Alias of vllm:kv_cache_usage_perc (vLLM's older name).", kv);
    metric(b, m, "vllm:prompt_tokens_total", "counter", "Alias of qflash:prompt_tokens_total.", (double)st->prompt_tokens);
    metric(b, m, "vllm:generation_tokens_total", "counter", "Alias of qflash:generation_tokens_total.", (double)st->gen_tokens);
    metric(b, m, "vllm:num_preemptions_total", "counter", "Alias of qflash:preemptions_total.", (double)st->preempted);
    metric(b, m, "vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", (double)(st->prefix_budget ? st->prompt_tokens : 0));
    metric(b, m, "vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", (double)st->prefix_tokens);
    metric(b, m, "vllm:spec_decode_num_drafts_total", "counter", "Alias of qflash:spec_decode_steps_total.", (double)st->spec_steps);
    metric(b, m, "vllm:spec_decode_num_draft_tokens_total", "counter", "Alias of qflash:spec_decode_draft_tokens_total.", (double)st->spec_drafted);
    metric(b, m, "vllm:spec_decode_num_accepted_tokens_total", "counter", "Alias of qflash:spec_decode_accepted_tokens_total.", (double)st->spec_accepted);
    evbuffer_add_printf(b, "# HELP vllm:request_success_total Finished requests by reason.\n# TYPE vllm:request_success_total counter\n");
    const char *why[3] = {"stop", "length", "abort"};
    uint64_t n[3] = {st->finished_stop, st->finished_length, st->finished_error + st->cancelled};
    for (int i = 0; i < 3; i++) evbuffer_add_printf(b, "vllm:request_success_total{%s,finished_reason=\"%s\"} %llu\n", m, why[i], (unsigned long long)n[i]);
    const double *tb = qf_sched_ttft_buckets, *kb = qf_sched_tok_buckets;
    histogram(b, m, "vllm:time_to_first_token_seconds", "Time to the first token.", st->ttft_hist, tb, st->ttft_n, st->ttft_sum);
    histogram(b, m, "vllm:inter_token_latency_seconds", "Time between tokens.", st->itl_hist, qf_sched_itl_buckets, st->itl_n, st->itl_sum);
    histogram(b, m, "vllm:time_per_output_token_seconds", "Alias of vllm:inter_token_latency_seconds (vLLM's older name).", st->itl_hist,
               qf_sched_itl_buckets, st->itl_n, st->itl_sum);
    histogram(b, m, "vllm:e2e_request_latency_seconds", "Submit to the last token.", st->e2e_hist, tb, st->req_n, st->e2e_sum);
    histogram(b, m, "vllm:request_queue_time_seconds", "Submit to a slot.", st->queue_hist, tb, st->req_n, st->queue_sum);
    histogram(b, m, "vllm:request_prefill_time_seconds", "A slot to the first token.", st->prefill_hist, tb, st->req_n, st->prefill_sum);
    histogram(b, m, "vllm:request_decode_time_seconds", "The first token to the last.", st->decode_hist, tb, st->req_n, st->decode_sum);
    histogram(b, m, "vllm:request_prompt_tokens", "Prompt tokens of a finished request.", st->ptok_hist, kb, st->req_n, st->ptok_sum);
    histogram(b, m, "vllm:request_generation_tokens", "Generated tokens of a finished request.", st->gtok_hist, kb, st->req_n, st->gtok_sum);
}

/* Readiness for a router or an orchestrator: 200 while this replica takes requests, 503 (with
 * the reason) while it loads, drains for shutdown or has a full queue. /health is liveness. */
void ep_ready(srv *s, struct evhttp_request *req) {
    qf_sched_stats st;
    const char *why = NULL;
    if (!atomic_load(&s->ready)) why = "loading";
    else if (s->draining) why = "draining";
    else {
        srv_stats(s, &st);
        if (st.waiting >= s->o->sched.max_queue * s->n_dp) why = "queue full";
    }
    if (why) {
        srv_count(s, 503);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", "1");
        srv_send_json(req, 503, json_pack("{s:s,s:s}", "status", "unavailable", "reason", why));
        return;
    }
    srv_count(s, 200);
    srv_send_json(req, 200, json_pack("{s:s,s:i,s:i}", "status", "ready", "running", st.running, "waiting", st.waiting));
}

void ep_metrics(srv *s, struct evhttp_request *req) {
    qf_sched_stats st;
    srv_stats(s, &st);
    struct evbuffer *b = evbuffer_new();
    if (!b) return;
    metric(b, "", "qflash:requests_total", "counter", "Generation requests accepted.", (double)st.requests);
    metric(b, "", "qflash:requests_finished_total", "counter", "Generation requests that ran to a stop or length.", (double)st.finished);
    metric(b, "", "qflash:requests_cancelled_total", "counter", "Generation requests cancelled (client gone or shutdown).", (double)st.cancelled);
    metric(b, "", "qflash:preemptions_total", "counter", "Sequences preempted for KV pages and recomputed.", (double)st.preempted);
    metric(b, "", "qflash:prompt_tokens_total", "counter", "Prompt tokens admitted.", (double)st.prompt_tokens);
    metric(b, "", "qflash:generation_tokens_total", "counter", "Tokens generated.", (double)st.gen_tokens);
    metric(b, "", "qflash:scheduler_steps_total", "counter", "Batched forward steps.", (double)st.steps);
    metric(b, "", "qflash:num_requests_running", "gauge", "Sequences holding a slot.", st.running);
    metric(b, "", "qflash:num_requests_waiting", "gauge", "Requests in the queue.", st.waiting);
    metric(b, "", "qflash:kv_cache_pages_used", "gauge", "KV cache pages the running sequences hold.", st.kv_pages_used);
    metric(b, "", "qflash:kv_cache_pages_cached", "gauge", "KV cache pages only prefix snapshots hold (given back when needed).", st.kv_pages_cached);
    metric(b, "", "qflash:kv_cache_pages_total", "gauge", "KV cache pages in the pool.", st.kv_pages_total);
    metric(b, "", "qflash:expert_cache_hits_total", "counter", "Routed experts found in the expert cache (all resident: every use).", (double)st.expert_hits);
    metric(b, "", "qflash:expert_cache_misses_total", "counter", "Routed experts loaded into the expert cache.", (double)st.expert_misses);
    metric(b, "", "qflash:expert_cache_bytes_loaded_total", "counter", "Bytes of routed experts loaded.", (double)st.expert_bytes_loaded);
    metric(b, "", "qflash:prefix_cache_hits_total", "counter", "Requests that started from a prefix snapshot.", (double)st.prefix_hits);
    metric(b, "", "qflash:prefix_cache_misses_total", "counter", "Requests that found no prefix snapshot.", (double)st.prefix_misses);
    metric(b, "", "qflash:prefix_cache_tokens_total", "counter", "Prompt tokens not prefilled: taken from prefix snapshots.", (double)st.prefix_tokens);
    metric(b, "", "qflash:prefix_cache_evictions_total", "counter", "Prefix snapshots dropped (budget or KV pages needed).", (double)st.prefix_evicted);
    metric(b, "", "qflash:prefix_cache_snapshots", "gauge", "Prefix snapshots held.", (double)st.prefix_snapshots);
    metric(b, "", "qflash:prefix_cache_bytes", "gauge", "Bytes the prefix snapshots hold (DeltaNet copies, KV pages, tokens).", (double)st.prefix_bytes);
    metric(b, "", "qflash:prefix_cache_budget_bytes", "gauge", "The prefix snapshots' budget (--prefix-cache-mem).", (double)st.prefix_budget);
    metric(b, "", "qflash:grammar_masks_total", "counter", "Token masks computed for constrained output (response_format, forced tool calls).", (double)st.masks);
    metric(b, "", "qflash:spec_decode_steps_total", "counter", "Sequence steps that verified MTP drafts (serve --draft).", (double)st.spec_steps);
    metric(b, "", "qflash:spec_decode_draft_tokens_total", "counter", "MTP draft tokens proposed.", (double)st.spec_drafted);
    metric(b, "", "qflash:spec_decode_accepted_tokens_total", "counter", "MTP draft tokens the model accepted (its own greedy picks).", (double)st.spec_accepted);
    metric(b, "", "qflash:grammar_mask_seconds_total", "counter", "Time spent computing those masks.", st.mask_seconds);
    histogram(b, "", "qflash:time_to_first_token_seconds", "Time from request to its first generated token.", st.ttft_hist,
              qf_sched_ttft_buckets, st.ttft_n, st.ttft_sum);
    histogram(b, "", "qflash:inter_token_latency_seconds", "Time between consecutive generated tokens of a request.", st.itl_hist,
              qf_sched_itl_buckets, st.itl_n, st.itl_sum);
    vllm_aliases(b, &st, s->model_name);
    replica_lines(b, s);
    static const char *codes[6] = {"2xx", "400", "401", "404", "405_413", "5xx"};
    evbuffer_add_printf(b, "# HELP qflash:http_responses_total HTTP responses by status.\n# TYPE qflash:http_responses_total counter\n");
    for (int i = 0; i < 6; i++) evbuffer_add_printf(b, "qflash:http_responses_total{code=\"%s\"} %llu\n", codes[i], (unsigned long long)s->http_requests[i]);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
    srv_count(s, 200);
    evhttp_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
}

void ep_webui(srv *s, struct evhttp_request *req) {
    struct evbuffer *b = evbuffer_new();
    if (!b) return;
    evbuffer_add_reference(b, qf_webui_html, qf_webui_html_len, NULL, NULL);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/html; charset=utf-8");
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Security-Policy", "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'");
    srv_count(s, 200);
    evhttp_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
}
