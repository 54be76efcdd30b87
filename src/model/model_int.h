/* Internals shared within src/model. */
#ifndef QF_MODEL_INT_H
#define QF_MODEL_INT_H

#include "model/model.h"

/* Takes ownership of p (freed with the model); frees p and fails when it cannot. */
int qf_model_own(qf_model *m, void *p);
/* Binds every weight of m->cfg from m->st. */
int qf_model_bind(qf_model *m, const qf_load_opts *opts);

#endif
