/* qflash: the command-line front end. Subcommands live in cmd_*.c; this file only dispatches. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

/* `--cuda-opt help` anywhere: the CUDA backend's options, before any command parses its flags. */
static int cuda_opt_help(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i++) {
        if (strcmp(argv[i], "--cuda-opt") || strcmp(argv[i + 1], "help")) continue;
        if (qf_backend_has_cuda()) printf("CUDA backend options (--cuda-opt name=value, repeatable), with their defaults:\n");
        else printf("this build has no CUDA backend; the options a CUDA build takes (--cuda-opt name=value, repeatable):\n");
        qf_cuda_opts_print(stdout, NULL);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        cli_help(stderr, NULL);
        return 2;
    }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        cli_help(stdout, argc > 2 ? argv[2] : NULL);
        return 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
        printf("qflash %s\n", QF_VERSION);
        return 0;
    }
    const char *cmd = argv[1];
    if (cuda_opt_help(argc, argv)) return 0;
    if (cli_wants_help(argc - 1, argv + 1)) {
        cli_help(stdout, cmd);
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
    cli_help(stderr, NULL);
    return 2;
}
