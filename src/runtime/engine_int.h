/* Shared within the engine's files (engine.c, spec.c). */
#ifndef QF_RUNTIME_ENGINE_INT_H
#define QF_RUNTIME_ENGINE_INT_H

#include "base/utf8.h"
#include "runtime/engine.h"

/* The generation loops' handling of each picked token (engine.c's plain loop, spec.c's drafts):
 * counted, ended on an end of sequence, given to the sampler, its text streamed to the callback. */
typedef struct qf_emitter {
    qf_engine *e;
    const qf_gen_request *req;
    qf_gen_stats *stats;
    qf_utf8_stream us;
    int n; /* emitted */
} qf_emitter;

/* tok, picked when the state holds pos tokens: 0 go on, 1 stop with it fed (the callback stopped,
 * max_tokens, or the context's end), 2 stop before it (an end of sequence, not fed). */
int qf_engine_emit(qf_emitter *em, const qf_state *st, int pos, int32_t tok);
/* The stream decoder's held-back bytes to the callback, once generation ends. */
void qf_engine_emit_end(qf_emitter *em);
/* After a request's prompt ran (from t0): its tokens fed to the sampler's penalties and the prompt
 * statistics set; returns the time generation starts from. */
double qf_engine_prompt_done(const qf_gen_request *req, qf_gen_stats *stats, double t0);

#endif
