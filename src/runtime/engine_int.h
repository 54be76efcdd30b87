/* Shared within the engine's files (engine.c, spec.c). */
#ifndef QF_RUNTIME_ENGINE_INT_H
#define QF_RUNTIME_ENGINE_INT_H

#include "base/utf8.h"
#include "runtime/engine.h"

/* Text of one token through the stream decoder into e->text (whole characters); its length. */
size_t qf_engine_token_text(qf_engine *e, qf_utf8_stream *us, int32_t tok);

#endif
