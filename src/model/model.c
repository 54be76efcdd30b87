/* Model load and free. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_int.h"

int qf_model_check_limits(const qf_config *c) {
    if (c->lin_k_dim > 512 || c->lin_v_dim > 512 || c->conv_kernel > 16 || c->conv_kernel < 2)
        return qf_fail(QF_EUNSUPPORTED, "linear-attention head dims %d/%d or conv kernel %d beyond what qflash supports (512, 2..16)",
                       c->lin_k_dim, c->lin_v_dim, c->conv_kernel);
    return QF_OK;
}

int qf_model_finish(qf_model *m) {
    int half = m->cfg.rot_dim / 2;
    m->inv_freq = malloc((size_t)(half > 0 ? half : 1) * sizeof *m->inv_freq);
    int rc = qf_model_own(m, m->inv_freq);
    /* fp32 as in HF: base ** (2i / rot), then its reciprocal */
    for (int i = 0; rc == QF_OK && i < half; i++)
        m->inv_freq[i] = 1.0f / powf((float)m->cfg.rope_theta, (float)(2 * i) / (float)m->cfg.rot_dim);
    if (m->mtp) m->mtp->embed = m->embed, m->mtp->lm_head = m->lm_head, m->mtp->inv_freq = m->inv_freq;
    return rc;
}

int qf_model_load(qf_model **out, const char *dir, const qf_load_opts *opts) {
    *out = NULL;
    qf_model *m = calloc(1, sizeof *m);
    if (!m) return qf_fail(QF_ENOMEM, "out of memory");
    int rc = qf_config_load(&m->cfg, dir);
    if (rc == QF_OK) rc = qf_model_check_limits(&m->cfg);
    if (rc == QF_OK) rc = qf_st_open_dir(&m->st, dir, opts ? opts->diag : NULL);
    if (rc == QF_OK) rc = qf_model_bind(m, opts, NULL);
    if (rc == QF_OK) rc = qf_model_finish(m);
    if (rc != QF_OK) {
        qf_model_free(m); /* cleanup never touches the error message */
        return rc;
    }
    *out = m;
    return QF_OK;
}

void qf_model_free(qf_model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_dev_bufs; i++) qf_be_free(m->dev, m->dev_bufs[i]);
    free(m->dev_bufs);
    qf_es_destroy(m->experts);
    if (m->mtp) qf_es_destroy(m->mtp->experts), free(m->mtp); /* the rest of the view is m's */
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->trunk_thr);
    qf_st_close(&m->st);
    free(m);
}
