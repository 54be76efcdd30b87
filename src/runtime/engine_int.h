/* Shared within the engine's files (engine.c, load_experts.c). */
#ifndef QF_RUNTIME_ENGINE_INT_H
#define QF_RUNTIME_ENGINE_INT_H

#include "runtime/engine.h"

/* The experts' placement and sparsity at load (load_experts.c), as the engine's load calls them. */
/* dir's config_flash.json (dir NULL, or no such file: every field unset). */
int qf_load_flash_config(const char *dir, qf_flash_config *fc);
/* The expert cache's size from the flag, else the file's (0: none, unless a GPU budget). */
size_t qf_load_cache_bytes(const qf_flash_config *fc, const qf_engine_opts *o);
/* On the CPU: bytes of RAM pool in front of the checkpoint (0: every expert resident). */
int qf_load_experts_cpu(qf_engine *e, size_t bytes);
/* On a GPU, after the trunk and the workspace are there (free_start: the device's free memory
 * before the trunk, free_trunk: after it): the plan, the expert cache, the warm-up. sparse_bytes:
 * what sparsity's transposed weights take once the levels are set after it. */
int qf_load_experts_gpu(qf_engine *e, const qf_engine_opts *o, size_t cache_bytes, size_t free_start, size_t free_trunk, size_t sparse_bytes);
/* --expert-heat: a routing trace (route-record's) fills each layer's RAM cache slots with its most
 * used experts before any request. */
int qf_load_expert_heat(qf_engine *e, const char *path);
/* The ops' scratch for the workspace's shapes (with sparsity's products when sparse) reserved on
 * the backend, so no step grows it; *bytes: its size by the ops' arithmetic (0 on the CPU). */
int qf_load_scratch(qf_engine *e, int sparse, size_t *bytes);
/* Whether some layer's level will be above 0 (the flag, else the file's schedule). */
int qf_load_sparse_wanted(const qf_flash_config *fc, const qf_engine_opts *o, int n_layers);
/* The model's sparsity levels (the flag for every layer, else the file's schedule) and trunk
 * thresholds (the file's; dir names it in errors). */
int qf_load_sparsity(qf_engine *e, const qf_flash_config *fc, const char *dir, const qf_engine_opts *o);

#endif
