#pragma once
#include <cstdint>
extern "C" {
#include "base/numeric.h"
}
struct __half { uint16_t v; };
static inline __half __ushort_as_half(unsigned short u) { return {u}; }
static inline float __half2float(__half h) { return qf_f16_to_f32(h.v); }
