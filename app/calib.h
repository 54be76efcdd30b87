/* Trunk sparsity's calibration (model.h): every layer's and projection group's dense input
 * magnitudes counted in a log-spaced histogram through the workspace's act hook, then the
 * magnitudes under which 10%, 20% .. 90% of the entries lie. */
#ifndef QF_APP_CALIB_H
#define QF_APP_CALIB_H

#include "cli.h"

typedef struct cli_calib cli_calib;
cli_calib *cli_calib_new(int layers);
void cli_calib_free(cli_calib *c);
/* The act hook (ud: the cli_calib). */
void cli_calib_count(void *ud, int layer, int group, const float *x, int rows, int dim);
/* thr: [layers][QF_ACT_GROUPS][QF_TRUNK_GRID] */
void cli_calib_grid(const cli_calib *c, float *thr);
/* The hook over n tokens of ids (windows of 512 from an empty state), then the grid into thr. */
int cli_calibrate(qf_engine *e, const int32_t *ids, int n, float *thr);

#endif
