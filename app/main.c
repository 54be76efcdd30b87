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
        qf_backend_opts_print(stdout, NULL);
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
    static const struct {
        const char *name;
        int (*run)(int argc, char **argv, qf_backend_opts *bo);
    } cmds[] = {{"run", cmd_run},           {"chat", cmd_chat},           {"verify", cmd_verify},     {"perplexity", cmd_perplexity},
                {"serve", cmd_serve},       {"bench", cmd_bench},         {"route-replay", cmd_route_replay}, {"route-record", cmd_route_record},
                {"synth-export", cmd_synth_export}, {"fidelity", cmd_fidelity}, {"calibrate", cmd_calibrate}, {"quantize", cmd_quantize}};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        if (strcmp(cmd, cmds[i].name)) continue;
        qf_backend_opts *bo; /* the backends' options: this process's, owned here */
        if (qf_backend_opts_create(&bo) != QF_OK) {
            fprintf(stderr, "error: %s\n", qf_last_error());
            return 2;
        }
        int rc = cmds[i].run(argc - 1, argv + 1, bo);
        qf_backend_opts_free(bo);
        return rc;
    }
    fprintf(stderr, "error: unknown command '%s'\n", cmd);
    cli_help(stderr, NULL);
    return 2;
}
