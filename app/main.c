/* qflash: the command-line front end. Subcommands live in cmd_*.c; this file only dispatches. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static void usage(void) {
    fprintf(stderr,
            "usage: qflash <command> [options]\n"
            "  run        -m DIR -p TEXT [-n N] [--draft N] [--temp T] [--top-k K] [--top-p P] [--min-p P] [--seed S] [-t THREADS]\n"
            "             raw completion of TEXT; the generated text goes to stdout\n"
            "  chat       -m DIR [--no-think] [--system TEXT] [sampling flags]  interactive chat\n"
            "  verify     [-m] DIR [--manifest FILE] [--no-hash]  check a model directory\n"
            "  perplexity -m DIR -f FILE [--window 512] [--windows K]\n"
            "  serve      -m DIR [--host H] [--port P] [--max-batch N] [--ctx N] [--api-key K] ...\n"
            "             OpenAI-compatible HTTP server with continuous batching (serve --help)\n"
            "  bench      (-m DIR | --synthetic qwen3.6-35b-a3b [--layers N]) [--prompt-len P] [--gen-len G]\n"
            "             [--concurrency 1,16] [--runs R] [--levels 0,0.3,0.6] [--only experts|trunk|kv] [--json FILE] (bench --help)\n"
            "  route-replay TRACE.safetensors [--slots 8,16,64] [--half-life 64]\n"
            "             expert-cache policies replayed over a recorded routing trace (hit rates)\n"
            "  route-record -m DIR -f TEXT -o TRACE.safetensors [-n TOKENS]  a model's routing on a text\n"
            "  fidelity   -m DIR -f TEXT [--sparsity-level 0,0.3,0.45,0.6,0.7] [--only experts|trunk|kv]  what each sparsity\n"
            "             level costs against dense: perplexity, KL, top-1 agreement, tokens to a stop, decode speed\n"
            "  calibrate  -m DIR -f TEXT [-n TOKENS]  trunk sparsity thresholds into DIR/config_flash.json\n"
            "  synth-export --synthetic qwen3.6-35b-a3b [--layers N] -o DIR  generated weights as a model directory\n"
            "  quantize   -m DIR -o OUT [--experts int4|int8|fp8] [--trunk bf16|int8]  a quantised copy of a model\n"
            "             directory (experts int4 by default; the trunk as stored), with SHA256SUMS\n"
            "sampling flags: --temp --top-k --top-p --min-p --repeat-penalty --presence-penalty\n"
            "                --frequency-penalty --seed (defaults from generation_config.json)\n"
            "device flags (run, chat, perplexity, serve, bench):\n"
            "  --device cpu|cuda[:N]              where the model runs (default cpu)\n"
            "  --precision bf16x2|fp32|bf16       GPU prompt-product numerics (default bf16x2)\n"
            "  --gpu-mem SIZE                     the GPU budget (22G, 12G): trunk, workspace, states and KV on the\n"
            "                                     device, the routed experts streamed from pinned host memory\n"
            "                                     through an expert buffer of what is left (the plan is printed)\n"
            "  --expert-cache SIZE                the expert buffer itself (512M, 22G): on the GPU with --device\n"
            "                                     cuda, else a RAM pool the CPU reads the checkpoint into as needed\n"
            "                                     (else config_flash.json's streaming_buffer_size, else all resident)\n"
            "  --expert-policy lru|dlfu|dlfu-admit  the expert buffer's policy (default dlfu-admit)\n"
            "  --sparsity-level L                 0 (exact, the default) to 1 on generated tokens: low-weight routed\n"
            "                                     experts dropped, small trunk inputs skipped (with calibrated\n"
            "                                     thresholds), KV pages chosen from 8K tokens on (else\n"
            "                                     config_flash.json's sparsity_level / sparsity_schedule)\n"
            "  --cuda-opt NAME=VALUE              a CUDA backend option, repeatable; these, with defaults:\n");
    qf_cuda_opts_print(stderr, NULL);
}

int main(int argc, char **argv) {
    if (cli_backend_init() != 0) return 2;
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
        printf("qflash %s\n", QF_VERSION);
        return 0;
    }
    const char *cmd = argv[1];
    /* serve and bench print their own detailed help; the others' usage is a line above */
    if (argc > 2 && (!strcmp(argv[2], "-h") || !strcmp(argv[2], "--help")) && strcmp(cmd, "serve") && strcmp(cmd, "bench")) {
        usage();
        return 0;
    }
    if (!strcmp(cmd, "run")) return cmd_run(argc - 1, argv + 1);
    if (!strcmp(cmd, "chat")) return cmd_chat(argc - 1, argv + 1);
    if (!strcmp(cmd, "verify")) return cmd_verify(argc - 1, argv + 1);
    if (!strcmp(cmd, "perplexity")) return cmd_perplexity(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve")) return cmd_serve(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench")) return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "route-replay")) return cmd_route_replay(argc - 1, argv + 1);
    if (!strcmp(cmd, "route-record")) return cmd_route_record(argc - 1, argv + 1);
    if (!strcmp(cmd, "synth-export")) return cmd_synth_export(argc - 1, argv + 1);
    if (!strcmp(cmd, "fidelity")) return cmd_fidelity(argc - 1, argv + 1);
    if (!strcmp(cmd, "calibrate")) return cmd_calibrate(argc - 1, argv + 1);
    if (!strcmp(cmd, "quantize")) return cmd_quantize(argc - 1, argv + 1);
    fprintf(stderr, "error: unknown command '%s'\n", cmd);
    usage();
    return 2;
}
