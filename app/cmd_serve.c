/* qflash serve: flags to server options. QFLASH_MODEL, QFLASH_HOST, QFLASH_PORT and QFLASH_API_KEY
 * give defaults from the environment (so a key need not appear in the process list); flags win. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "server/server.h"

void cmd_serve_help(FILE *f) {
    fprintf(f,
            "usage: qflash serve -m DIR [--host 127.0.0.1] [--port 8080] [--api-key KEY] [--model-name NAME]\n"
            "                    [--served-model-name NAME,...] [--metrics-auth] [--chat-template FILE]\n"
            "                    [--default-chat-template-kwargs JSON]\n"
            "                    [--max-batch 16] [--ctx 4096] [--kv-pages N | --kv-mem MIB] [--page-tokens 16]\n"
            "                    [--prefill-chunk 256] [--prefix-cache-mem MIB] [--max-queue 256] [--max-body MIB] [--shutdown-timeout S]\n"
            "                    [--max-conns 512] [--header-timeout 60] [--body-timeout 120] [--idle-timeout 75]\n"
            "                    [-t THREADS] [--synthetic PRESET] [--dp N] [--draft N] [--verbose] [device flags]\n"
            "--dp: N replicas of the model in this process behind the one endpoint (GPU i each with --device cuda, else the\n"
            "      threads shared out); a request goes to the one with the fewest running and waiting.\n"
            "--chat-template: a Jinja file used instead of the model's own template.\n"
            "--default-chat-template-kwargs: a JSON object of template variables for every request, e.g.\n"
            "      '{\"enable_thinking\": false}' (a request's chat_template_kwargs win).\n"
            "--served-model-name: the names a request's 'model' may give (the first is the id /v1/models lists; default: the\n"
            "      id alone, --model-name or the directory's name); any other name is answered 404 model_not_found.\n"
            "--metrics-auth: /metrics asks for the API key too (by default it is public, as vLLM's is).\n"
            "--draft: MTP speculative decoding with N drafts a step (the model's MTP head) for every greedy request without\n"
            "      logprobs or a grammar, all verified in the step's one forward; the output is the same as without (on a\n"
            "      GPU such a request's steps take the plain, unrecorded path: slower there so far).\n"
            "--prefix-cache-mem: snapshots for prefix reuse across requests, MiB (default 1024 on the CPU, 0 = off on a GPU, where a\n"
            "      reused turn equals a cold prefill to rounding only; 0 turns it off). Under --gpu-mem their DeltaNet copies wait in\n"
            "      pinned host memory (the plan line shows it), so device memory stays as planned.\n"
            "--synthetic: generated weights of a real checkpoint's shapes (qwen3.6-35b-a3b) with DIR's tokenizer (load tests).\n"
            "Defaults from the environment: QFLASH_MODEL, QFLASH_HOST, QFLASH_PORT, QFLASH_API_KEY (flags win).\n");
}

static const char *env_or(const char *name, const char *dflt) {
    const char *v = getenv(name);
    return v && *v ? v : dflt;
}

static int parse_serve(int argc, char **argv, qf_server_opts *o, qf_backend_opts *bo, double *kv_mib, double *body_mib, double *prefix_mib) {
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, "-m", "--model")) o->model_dir = cli_value(&a);
        else if (cli_is(&a, NULL, "--synthetic")) {
            static qf_synth_opts so;
            so.preset = cli_value(&a);
            o->engine.synth = &so;
        }
        else if (cli_is(&a, NULL, "--host")) o->host = cli_value(&a);
        else if (cli_is(&a, NULL, "--port")) o->port = cli_int(&a, 0, 65535);
        else if (cli_is(&a, NULL, "--api-key")) o->api_key = cli_value(&a);
        else if (cli_is(&a, NULL, "--model-name")) o->model_name = cli_value(&a);
        else if (cli_is(&a, NULL, "--served-model-name")) o->served_names = cli_value(&a);
        else if (cli_is(&a, NULL, "--metrics-auth")) o->metrics_auth = 1;
        else if (cli_is(&a, NULL, "--chat-template")) o->chat_template = cli_value(&a);
        else if (cli_is(&a, NULL, "--default-chat-template-kwargs")) o->template_kwargs = cli_value(&a);
        else if (cli_is(&a, NULL, "--max-batch")) o->sched.max_batch = cli_int(&a, 1, 1024);
        else if (cli_is(&a, NULL, "--draft")) o->engine.draft = cli_int(&a, 0, 8);
        else if (cli_is(&a, NULL, "--dp")) o->dp = cli_int(&a, 1, QF_SRV_MAX_DP);
        else if (cli_is(&a, "-c", "--ctx")) o->sched.ctx = cli_int(&a, 16, 1 << 24);
        else if (cli_is(&a, NULL, "--kv-pages")) o->sched.kv_pages = cli_int(&a, 1, 1 << 30);
        else if (cli_is(&a, NULL, "--kv-mem")) *kv_mib = cli_num(&a, 1, 1 << 30);
        else if (cli_is(&a, NULL, "--page-tokens")) o->sched.page_tokens = cli_int(&a, 1, 4096);
        else if (cli_is(&a, NULL, "--prefill-chunk")) o->sched.prefill_chunk = cli_int(&a, 1, 1 << 16);
        else if (cli_is(&a, NULL, "--prefix-cache-mem")) *prefix_mib = cli_num(&a, 0, 1 << 24);
        else if (cli_is(&a, NULL, "--max-queue")) o->sched.max_queue = cli_int(&a, 0, 1 << 20);
        else if (cli_is(&a, NULL, "--max-body")) *body_mib = cli_num(&a, 0.001, 4096);
        else if (cli_is(&a, NULL, "--max-conns")) o->max_conns = cli_int(&a, 1, 1 << 20);
        else if (cli_is(&a, NULL, "--header-timeout")) o->header_timeout = cli_num(&a, 0.1, 86400);
        else if (cli_is(&a, NULL, "--body-timeout")) o->body_timeout = cli_num(&a, 0.1, 86400);
        else if (cli_is(&a, NULL, "--idle-timeout")) o->idle_timeout = cli_num(&a, 0.1, 86400);
        else if (cli_is(&a, NULL, "--shutdown-timeout")) o->shutdown_timeout = cli_num(&a, 0, 86400);
        else if (cli_is(&a, "-t", "--threads")) o->engine.n_threads = cli_int(&a, 1, 1024);
        else if (cli_device_flag(&a, &o->engine, bo)) continue;
        else if (cli_is(&a, "-v", "--verbose")) o->verbose = o->sched.verbose = 1;
        else {
            fprintf(stderr, "error: unknown option '%s' for serve\n", argv[a.i]);
            a.bad = 1;
        }
    }
    if (!a.bad && !o->model_dir) {
        fprintf(stderr, "usage: qflash serve -m DIR [flags]   (qflash serve --help lists them)\n");
        a.bad = 1;
    }
    return a.bad ? 2 : 0;
}

int cmd_serve(int argc, char **argv, qf_backend_opts *bo) {
    qf_server_opts o;
    memset(&o, 0, sizeof o);
    cli_engine_init(&o.engine, bo);
    o.host = env_or("QFLASH_HOST", "127.0.0.1");
    o.port = atoi(env_or("QFLASH_PORT", "8080"));
    o.api_key = env_or("QFLASH_API_KEY", NULL);
    o.model_dir = env_or("QFLASH_MODEL", NULL);
    o.shutdown_timeout = 30;
    o.max_conns = 512;
    o.header_timeout = 60, o.body_timeout = 120, o.idle_timeout = 75; /* nginx's, and a body deadline */
    o.sched = (qf_sched_opts){.max_batch = 16, .ctx = 4096, .page_tokens = 16, .prefill_chunk = 256, .max_queue = 256, .log = stderr};
    double kv_mib = 0, body_mib = 8, prefix_mib = -1;
    if (parse_serve(argc, argv, &o, bo, &kv_mib, &body_mib, &prefix_mib)) return 2;
    o.max_body = (size_t)(body_mib * 1048576.0);
    o.engine.max_batch = o.sched.max_batch + o.sched.prefill_chunk; /* rows of one step */
    o.engine.progress = NULL;
    o.sched.kv_mib = kv_mib;
    int on_gpu = o.engine.device && strncmp(o.engine.device, "cuda", 4) == 0;
    if (prefix_mib < 0) prefix_mib = on_gpu ? 0 : 1024; /* on a GPU the decode and prompt kernels round differently: a reused turn is not a cold prefill's bits */
    o.sched.prefix_cache_bytes = (size_t)(prefix_mib * 1048576.0);
    o.engine.reserve_seqs = o.sched.max_batch;
    o.engine.reserve_tokens = o.sched.kv_pages > 0 ? o.sched.kv_pages * o.sched.page_tokens : o.sched.ctx * o.sched.max_batch;
    o.engine.reserve_kv_bytes = (size_t)(kv_mib * 1048576.0);
    o.engine.reserve_host_bytes = o.sched.prefix_cache_bytes; /* under --gpu-mem the snapshots wait in host memory */
    if (o.verbose && o.engine.device && strncmp(o.engine.device, "cuda", 4) == 0) qf_backend_opts_print(stderr, bo);
    int rc = qf_server_run(&o);
    if (rc != QF_OK) {
        fprintf(stderr, "error: %s\n", qf_last_error());
        return 1;
    }
    return 0;
}
