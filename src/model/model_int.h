/* Internals shared within src/model. */
#ifndef QF_MODEL_INT_H
#define QF_MODEL_INT_H

#include "model/model.h"

/* Takes ownership of p (freed with the model); frees p and fails when it cannot. */
int qf_model_own(qf_model *m, void *p);
/* A device buffer the model frees with itself (m->dev_bufs); on failure the caller still owns it. */
int qf_model_keep_dev(qf_model *m, void *p);
/* Makes a tensor the checkpoint lacks (a synthetic model's), adds it to m->st; NULL when out of memory. */
typedef const qf_st_tensor *(*qf_make_tensor_fn)(qf_model *m, const char *name, int ndim, const int64_t *shape);
/* Binds every weight of m->cfg from m->st; with make, missing tensors are made by it. */
int qf_model_bind(qf_model *m, const qf_load_opts *opts, qf_make_tensor_fn make);
/* Generates a tensor for a synthetic model (values by kind of name, deterministic), adds it to
 * m->st and returns it; NULL when out of memory. */
const qf_st_tensor *qf_synth_tensor(qf_model *m, const char *name, int ndim, const int64_t *shape);
/* What every load does after binding: limits checked, RoPE frequencies. */
int qf_model_finish(qf_model *m);
int qf_model_check_limits(const qf_config *c);

#endif
