/* Expert streaming's setup inside the runtime (flash.c): the engine calls these at load. */
#ifndef QF_RUNTIME_FLASH_H
#define QF_RUNTIME_FLASH_H

#include <stdio.h>

#include "runtime/engine.h"

/* The expert cache's size from the flag, else config_flash.json (0: none, unless a GPU budget). */
int qf_flash_wanted(const char *dir, const qf_engine_opts *o, size_t *cache_bytes);
/* On the CPU: bytes of RAM pool in front of the checkpoint (0: every expert resident). */
int qf_flash_cpu(qf_engine *e, size_t bytes);
/* On a GPU, after the trunk and the workspace are there (free_start: the device's free memory
 * before the trunk, free_trunk: after it): the plan, the expert cache, the warm-up. */
int qf_flash_gpu(qf_engine *e, const qf_engine_opts *o, size_t cache_bytes, size_t free_start, size_t free_trunk);
void qf_flash_print(FILE *f, const qf_flash_plan *p);
/* The model's sparsity levels: the flag for every layer, else config_flash.json's schedule. */
int qf_flash_sparsity(qf_engine *e, const char *dir, const qf_engine_opts *o);

#endif
