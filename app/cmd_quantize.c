/* qflash quantize: a model directory with its routed experts (and optionally the trunk's large
 * projections) in a quantised format, written tensor by tensor (layout: src/model/quantize.h). */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/quant.h"
#include "base/timer.h"
#include "cli.h"
#include "model/quantize.h"

typedef struct bar {
    double t0;
    int shown, tty;
} bar;

static void progress(void *ud, uint64_t done, uint64_t total) {
    bar *b = ud;
    int pct = total ? (int)(100 * done / total) : 100;
    if (pct == b->shown && done < total) return;
    b->shown = pct;
    double dt = qf_now() - b->t0, gb = 1e-9 * (double)done;
    char line[160], hashes[41];
    memset(hashes, '#', 40), hashes[40] = 0;
    memset(hashes + pct * 40 / 100, '.', (size_t)(40 - pct * 40 / 100));
    snprintf(line, sizeof line, "[%s] %3d%% %.2f/%.2f GB %.0f MB/s", hashes, pct, gb, 1e-9 * (double)total, dt > 0 ? 1e3 * gb / dt : 0.0);
    if (b->tty) fprintf(stderr, "\r%s", line);
    else if (pct % 10 == 0) fprintf(stderr, "%s\n", line);
}

int cmd_quantize(int argc, char **argv, qf_backend_opts *bo) {
    (void)bo; /* runs no model */
    const char *in = NULL, *out = NULL, *ex = "int4", *tr = NULL;
    int threads = 0;
    double shard_gb = 4.0;
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, "-m", "--model")) in = cli_value(&a);
        else if (cli_is(&a, "-o", "--out")) out = cli_value(&a);
        else if (cli_is(&a, NULL, "--experts")) ex = cli_value(&a);
        else if (cli_is(&a, NULL, "--trunk")) tr = cli_value(&a);
        else if (cli_is(&a, "-t", "--threads")) threads = cli_int(&a, 1, 1024);
        else if (cli_is(&a, NULL, "--shard-gb")) shard_gb = cli_num(&a, 0.001, 1024);
        else {
            fprintf(stderr, "error: unknown option '%s' for quantize\n", argv[a.i]);
            a.bad = 1;
        }
    }
    qf_quantize_opts o = {0};
    if (!a.bad && ex && !(o.experts = qf_qfmt_parse(ex))) fprintf(stderr, "error: --experts takes int8, int4 or fp8, not '%s'\n", ex), a.bad = 1;
    if (!a.bad && tr && strcmp(tr, "bf16") && strcmp(tr, "int8")) fprintf(stderr, "error: --trunk takes bf16 or int8, not '%s'\n", tr), a.bad = 1;
    if (a.bad || !in || !out) {
        fprintf(stderr, "usage: qflash quantize -m DIR -o OUT [--experts int4|int8|fp8] [--trunk bf16|int8] [-t THREADS] [--shard-gb 4]\n");
        return 2;
    }
    o.trunk = !tr ? 0 : strcmp(tr, "bf16") ? QF_Q_I8B32 : QF_DT_BF16;
    o.shard_bytes = (uint64_t)(shard_gb * 1e9);
    o.pool = qf_pool_create(threads ? threads : qf_cpu_count());
    bar b = {qf_now(), -1, isatty(2)};
    o.progress = progress, o.progress_ud = &b;
    int rc = qf_quantize_dir(in, out, &o);
    qf_pool_destroy(o.pool);
    if (b.tty) fprintf(stderr, "\n");
    if (rc != QF_OK) {
        fprintf(stderr, "error: %s\n", qf_last_error());
        return 1;
    }
    fprintf(stderr, "wrote %s (experts %s, trunk %s) in %.1f s; SHA256SUMS lists its files\n", out, ex, tr ? tr : "as stored", qf_now() - b.t0);
    return 0;
}
