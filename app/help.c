/* Every command's help: its own flags with their defaults, then the shared blocks (sampling, device)
 * of the commands that take them. A CPU build's help names no CUDA option. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

enum { SAMPLING = 1, DEVICE = 2 };

typedef struct cmd_help {
    const char *name, *summary, *usage;
    unsigned blocks;
    void (*own)(FILE *f); /* a command whose long help lives beside its flags */
} cmd_help;

static const cmd_help HELP[] = {
    {"run", "raw completion of a text; the generated text goes to stdout",
     "usage: qflash run -m DIR (-p TEXT | -f FILE) [flags]\n"
     "  -m, --model DIR        the model directory (config.json, safetensors, tokenizer.json)\n"
     "  -p, --prompt TEXT      the text to continue\n"
     "  -f, --file FILE        the text to continue, from a file\n"
     "  -n, --n-predict N      tokens to generate (default 128)\n"
     "  -c, --ctx N            context tokens (default: the prompt and N)\n"
     "  -t, --threads N        CPU threads (default: all cores)\n"
     "  --draft N              MTP speculative decoding, N drafts a step (default 0: off; needs the model's MTP head;\n"
     "                         greedy output is the same as without)\n",
     SAMPLING | DEVICE, NULL},
    {"chat", "interactive chat with the model's chat template",
     "usage: qflash chat -m DIR [flags]\n"
     "  -m, --model DIR        the model directory\n"
     "  --system TEXT          a system message\n"
     "  --no-think             thinking off (the template's enable_thinking false)\n"
     "  -n, --n-predict N      the most tokens a reply takes (default 1024)\n"
     "  -c, --ctx N            context tokens\n"
     "  -t, --threads N        CPU threads (default: all cores)\n"
     "  commands in the chat: /reset (a new conversation), /quit\n",
     SAMPLING | DEVICE, NULL},
    {"serve", "OpenAI-, Anthropic- and Responses-compatible HTTP server with continuous batching",
     NULL, DEVICE, cmd_serve_help},
    {"bench", "decode and prompt speed (and, with --levels, each sparsity level's)", NULL, DEVICE, cmd_bench_help},
    {"verify", "check a model directory (files, shapes, template, tokenizer, hashes)",
     "usage: qflash verify [-m] DIR [flags]\n"
     "  --manifest FILE        a sha256sum-style manifest the files' hashes must match (default: none; the hashes\n"
     "                         are computed and printed)\n"
     "  --no-hash              no hashes (structure only)\n",
     0, NULL},
    {"perplexity", "perplexity of the model on a text",
     "usage: qflash perplexity -m DIR -f FILE [flags]\n"
     "  -f, --file FILE        the text\n"
     "  --window N             tokens a window (default 512)\n"
     "  --windows K            windows to score (default: all the text holds)\n"
     "  -t, --threads N        CPU threads (default: all cores)\n",
     DEVICE, NULL},
    {"fidelity", "what each sparsity level costs against dense: perplexity, KL, top-1 agreement, tokens to a stop, speed",
     "usage: qflash fidelity -m DIR -f TEXT [flags]\n"
     "  --sparsity-level LIST  the levels (default 0,0.3,0.45,0.6,0.7)\n"
     "  --only experts|trunk|kv  one sparsity kind alone\n"
     "  --compare DIR          another copy of the model (e.g. quantised) scored against -m's, repeatable\n"
     "  --window N             tokens a window (default 512)   --windows K   windows to score\n"
     "  --prompts N            generation prompts (default 16)  --prompt-len N (default 32)  --max-gen N (default 256)\n"
     "  -t, --threads N        CPU threads (default: all cores)\n",
     DEVICE, NULL},
    {"route-replay", "expert-cache policies replayed over a recorded routing trace (hit rates)",
     "usage: qflash route-replay TRACE.safetensors [flags]\n"
     "  --slots LIST           slots a layer to try (default 8,16,32,64,96,128)\n"
     "  --half-life N          the decayed counts' half-life in tokens (default 64)\n"
     "  --prefetch N           next-layer guesses a token (default 0)\n",
     0, NULL},
    {"route-record", "a model's routing on a text, as a trace for route-replay",
     "usage: qflash route-record -m DIR -f TEXT -o TRACE.safetensors [-n TOKENS (default 16384)] [-t THREADS]\n", 0, NULL},
    {"calibrate", "trunk sparsity thresholds into DIR/config_flash.json",
     "usage: qflash calibrate -m DIR -f TEXT [-n TOKENS (default 16384)] [-t THREADS]\n", 0, NULL},
    {"synth-export", "generated weights of a real checkpoint's shapes as a model directory",
     "usage: qflash synth-export --synthetic qwen3.6-35b-a3b [--layers N] -o DIR\n", 0, NULL},
    {"quantize", "a quantised copy of a model directory, with SHA256SUMS",
     "usage: qflash quantize -m DIR -o OUT [flags]\n"
     "  --experts int4|int8|fp8  the routed experts' format (default int4)\n"
     "  --trunk bf16|int8      the trunk's format (default: as stored)\n"
     "  --shard-gb N           shard size in GB (default 4)\n"
     "  -t, --threads N        CPU threads (default: all cores)\n",
     0, NULL},
};

static const char SAMPLING_HELP[] =
    "sampling (defaults: the model's generation_config.json, else the value shown):\n"
    "  --temp T (0 = greedy)  --top-k K (0 = off)  --top-p P (1)  --min-p P (0)  --seed S (the time)\n"
    "  --repeat-penalty R (1 = off)  --presence-penalty P (0)  --frequency-penalty P (0)\n";

static void device_help(FILE *f) {
    int cuda = qf_backend_has_cuda();
    fprintf(f, "device and memory:\n");
    fprintf(f, cuda ? "  --device cpu|cuda[:N]  where the model runs (default cpu)\n" : "  --device cpu           where the model runs (this build has no CUDA backend)\n");
    if (cuda)
        fprintf(f, "  --precision bf16x2|fp32|bf16  GPU prompt-product numerics (default bf16x2)\n"
                   "  --gpu-mem SIZE         the GPU budget (22G, 12G): the routed experts stream from pinned host memory\n"
                   "                         through a device buffer of what the rest leaves (the plan is printed)\n"
                   "  --expert-threads N     with --gpu-mem: N host threads compute a share of each decode step's missed\n"
                   "                         experts from host memory beside the GPU (the share measured at load;\n"
                   "                         default: the cores less 4; 0: off)\n"
                   "  --cuda-opt NAME=VALUE  a CUDA backend option, repeatable (--cuda-opt help lists them)\n");
    fprintf(f, "  --expert-cache SIZE    the expert buffer itself (512M, 22G): %sa RAM pool the CPU reads the\n"
               "                         checkpoint into as needed (default: config_flash.json's, else all resident)\n",
            cuda ? "on the GPU with --device cuda, else " : "");
    fprintf(f, "  --expert-policy lru|dlfu|dlfu-admit  the expert buffer's policy (default dlfu-admit)\n"
               "  --expert-heat TRACE    the expert cache (the CPU's RAM cache, or a GPU's expert slots)\n"
               "                         starts with each layer's most used experts of a routing trace\n"
               "                         (qflash route-record's)\n"
               "  --expert-prefetch N    the CPU's RAM expert cache reads each token's N likeliest experts of the next\n"
               "                         layer ahead, while this layer runs (default 0: off)\n"

               "  --sparsity-level L     0 (exact, the default) to 1: low-weight experts dropped, small trunk inputs\n"
               "                         skipped, KV pages chosen from 8K tokens on (else config_flash.json's)\n");
}

static const cmd_help *find(const char *cmd) {
    for (size_t i = 0; i < sizeof HELP / sizeof HELP[0]; i++)
        if (!strcmp(HELP[i].name, cmd)) return &HELP[i];
    return NULL;
}

static void global_help(FILE *f) {
    fprintf(f, "usage: qflash <command> [flags]   (qflash <command> --help: its flags and defaults)\n");
    for (size_t i = 0; i < sizeof HELP / sizeof HELP[0]; i++) fprintf(f, "  %-13s %s\n", HELP[i].name, HELP[i].summary);
    fprintf(f, "  --version     the version\n");
}

void cli_help(FILE *f, const char *cmd) {
    const cmd_help *h = cmd ? find(cmd) : NULL;
    if (!h) {
        global_help(f);
        return;
    }
    if (h->own) h->own(f);
    else fputs(h->usage, f);
    if (h->blocks & SAMPLING) fputs(SAMPLING_HELP, f);
    if (h->blocks & DEVICE) device_help(f);
}

int cli_wants_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) return 1;
    return 0;
}
