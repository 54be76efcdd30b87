/* The forward pass's per-call state, shared by the layer-by-layer path (forward.c) and the
 * decode steps through the device's fused ops (forward_dec.c). */
#ifndef QF_MODEL_FORWARD_INT_H
#define QF_MODEL_FORWARD_INT_H

#include "model/model_int.h"
#include "model/workspace.h"

#define OPS (be->ops)

typedef struct fwd {
    const qf_model *m;
    qf_backend *be;
    qf_workspace *ws;
    qf_seq_step *seqs;
    int n_seqs, N; /* sequences, total rows */
    int lg_rows; /* after the step: the rows of lg that hold logits (DRAW rows drawn from there; 0: none kept):
                  * a decode step's rows, or in the prompt path one a sequence that wants logits */
    /* decode steps: row t is row roff[t] of sequence rseq[t], rows in waves (every sequence's
     * first row, then the second rows of those with more, ...), wave i at rows wave[i] ..
     * wave[i + 1] - 1; more than one wave: some sequence chains its rows (a verify: its token and
     * drafts), and the DeltaNet steps and attention run a wave at a time */
    int dec, rseq[QF_DEC_ROWS], roff[QF_DEC_ROWS], wave[QF_DEC_CHAIN + 1], waves;
} fwd;

float fw_row_level(const fwd *f, int r, int L);
float fw_expert_level(const fwd *f, int r, int L);
int fw_kv_budget(const fwd *f, int r, int L, const qf_state *st);
void fw_kv_count(fwd *f, const qf_seq_step *q, int budget);
int fw_moe(fwd *f, int L, float *xn, float *out);
void fw_pick(fwd *f, const float *rows, int n, int32_t *out);
void fw_logits(fwd *f);
int fw_dec_usable(const fwd *f);
void fw_dec_rows(fwd *f);
int fw_seq_row(const fwd *f, int s, int i);
int fw_dec_layer(fwd *f, int L);
void fw_draw_on_host(qf_backend *be, qf_seq_step *q, const float *row, int V);
void fw_hidden_out(fwd *f, const float *x, float *xn);
void fw_dec_logits(fwd *f);
int fw_draw_after(fwd *f);

#endif
