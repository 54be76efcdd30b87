/* The model's forward pass as a plain reference (ref_forward.c): what every fast path is tested against. */
#ifndef QF_MODEL_REF_FORWARD_H
#define QF_MODEL_REF_FORWARD_H

#include "model/model.h"

/* The logits of every position of ids[0..T) from an empty state ([T][vocab]), the model's weights
 * read where they are bound in host memory (QF_EUNSUPPORTED once they moved to a device). */
int qf_model_ref_forward(const qf_model *m, const int32_t *ids, int T, float *logits);
/* The MTP head's logits of the pairs (ids[t + 1], the state after ids[t]), t < T - 1 ([T - 1][vocab]). */
int qf_model_ref_mtp(const qf_model *m, const int32_t *ids, int T, float *logits);

#endif
