/* Expert streaming's setup inside the runtime (flash.c): the engine calls these at load. */
#ifndef QF_RUNTIME_FLASH_H
#define QF_RUNTIME_FLASH_H

#include <stdio.h>

#include "runtime/engine.h"

/* dir's config_flash.json (dir NULL, or no such file: every field unset). */
int qf_flash_config_read(const char *dir, qf_flash_config *fc);
/* The expert cache's size from the flag, else the file's (0: none, unless a GPU budget). */
size_t qf_flash_wanted(const qf_flash_config *fc, const qf_engine_opts *o);
/* On the CPU: bytes of RAM pool in front of the checkpoint (0: every expert resident). */
int qf_flash_cpu(qf_engine *e, size_t bytes);
/* On a GPU, after the trunk and the workspace are there (free_start: the device's free memory
 * before the trunk, free_trunk: after it): the plan, the expert cache, the warm-up. sparse_bytes:
 * what sparsity's transposed weights take once the levels are set after it. */
int qf_flash_gpu(qf_engine *e, const qf_engine_opts *o, size_t cache_bytes, size_t free_start, size_t free_trunk, size_t sparse_bytes);
/* Whether some layer's level will be above 0 (the flag, else the file's schedule). */
int qf_flash_sparse_wanted(const qf_flash_config *fc, const qf_engine_opts *o, int n_layers);
/* The model's sparsity levels (the flag for every layer, else the file's schedule) and trunk
 * thresholds (the file's; dir names it in errors). */
int qf_flash_sparsity(qf_engine *e, const qf_flash_config *fc, const char *dir, const qf_engine_opts *o);

#endif
