/* Shared by the subcommands: argument parsing helpers, the load progress bar, sampling flags. */
#ifndef QF_APP_CLI_H
#define QF_APP_CLI_H

#define QF_VERSION "0.5.0"

#include "runtime/engine.h"

typedef struct cli_args {
    int argc, i;
    char **argv;
    int bad;
} cli_args;

/* Value of the current flag (argv[i+1]); sets bad and prints when missing. */
const char *cli_value(cli_args *a);
int cli_int(cli_args *a, int lo, int hi);
double cli_num(cli_args *a, double lo, double hi);
int cli_is(const cli_args *a, const char *shortf, const char *longf);

/* Sampling flags shared by run and chat; returns 1 when argv[i] was one of them. */
int cli_sampling_flag(cli_args *a, qf_sampling *s, int *seed_set);
/* generation_config.json defaults, then the user's flags win. */
void cli_sampling_defaults(const qf_config *c, qf_sampling *s);

/* Final sampling: generation_config defaults, overridden by the flags the user set (fields of
 * user left at their "unset" sentinel are ignored). Prints the result; 2 on invalid values. */
int cli_prepare_sampling(const qf_engine *e, const qf_sampling *user, int seed_set, qf_sampling *out);
#define CLI_SAMPLING_UNSET {-1, -1, -1, -1, -1, -9, -9, 0}

void cli_progress(void *ud, int done, int total);
/* The device flags (--device, --precision, --cuda-opt, --gpu-mem, --expert-cache, --expert-policy,
 * --sparsity-level) into a command's engine options and the backend options: 1 when argv[i] was one of
 * them (`--cuda-opt help` is answered before a command runs: cli_help). */
int cli_device_flag(cli_args *a, qf_engine_opts *eo, qf_backend_opts *bo);
/* Engine options with their defaults (device cpu) and the process's backend options (main's). */
void cli_engine_init(qf_engine_opts *eo, const qf_backend_opts *bo);
void cli_print_expert_cache(const qf_engine *e);
/* The RAM expert cache's counts so far (nothing without one). */
void cli_print_expert_stats(const qf_engine *e);
/* --only experts|trunk|kv (bench, fidelity): the QF_SPARSE_* bit of the one sparsity level to keep
 * on; sets bad and prints for anything else. */
int cli_sparse_only(cli_args *a);
/* A comma list of sparsity levels, each 0..1, into out (at most cap): how many, or -1 when malformed. */
int cli_parse_levels(const char *s, float *out, int cap);
/* The engine on dir and file's text as its tokens (errors printed; the caller closes and frees). */
int cli_open_on_text(const char *dir, const char *file, int threads, const qf_engine_opts *eo, qf_engine **e, int32_t **ids, int *n);
/* The engine on dir with eo (threads and the progress bar added); errors printed. */
int cli_open_engine(qf_engine **e, const char *dir, int threads, const qf_engine_opts *eo);
/* A command's help (flags and defaults; the device and sampling flags where it takes them). */
void cli_help(FILE *f, const char *cmd);
/* Whether argv (after the command) asks for help: -h or --help anywhere. */
int cli_wants_help(int argc, char **argv);

int cmd_run(int argc, char **argv, qf_backend_opts *bo);
int cmd_chat(int argc, char **argv, qf_backend_opts *bo);
int cmd_verify(int argc, char **argv, qf_backend_opts *bo);
int cmd_perplexity(int argc, char **argv, qf_backend_opts *bo);
int cmd_serve(int argc, char **argv, qf_backend_opts *bo);
int cmd_bench(int argc, char **argv, qf_backend_opts *bo);
int cmd_route_replay(int argc, char **argv, qf_backend_opts *bo);
int cmd_route_record(int argc, char **argv, qf_backend_opts *bo);
int cmd_synth_export(int argc, char **argv, qf_backend_opts *bo);
int cmd_fidelity(int argc, char **argv, qf_backend_opts *bo);
int cmd_calibrate(int argc, char **argv, qf_backend_opts *bo);
int cmd_quantize(int argc, char **argv, qf_backend_opts *bo);
void cmd_serve_help(FILE *f);
void cmd_bench_help(FILE *f);

#endif
