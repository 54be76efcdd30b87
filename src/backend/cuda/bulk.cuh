// Bulk copies (sm_90's cp.async.bulk) into shared memory, counted on mbarriers: the primitives of
// the decode kernels' shared-memory rings and of bench/step_probe.cu. On older chips the copies and
// waits compile to nothing (their callers are guarded).
#ifndef QF_CUDA_BULK_CUH
#define QF_CUDA_BULK_CUH
#include <stdint.h>

__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t *b) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(b)) : "memory"); }
// The barrier's phase now waits for `bytes` more (and this thread's arrival is counted).
__device__ __forceinline__ void mbar_arrive_expect(uint64_t *b, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
#endif
}
// The copy engine moves bytes (a multiple of 16) from global to shared memory; b counts them.
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes, uint64_t *b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(bytes), "r"(smem_u32(b))
                 : "memory");
#endif
}
// Barriers made by this thread are seen by the copy engine.
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// One slot: its barrier expects the bytes, then the copy engine moves them.
__device__ __forceinline__ void bulk_load(void *dst, const void *src, unsigned bytes, uint64_t *b) {
    mbar_arrive_expect(b, bytes);
    bulk_copy(dst, src, bytes, b);
}
__device__ __forceinline__ void mbar_wait(uint64_t *b, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(smem_u32(b)), "r"(parity)
                     : "memory");
#endif
}
// The warp's reads of a slot are ordered before the copy engine's next writes into it.
__device__ __forceinline__ void fence_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

#endif
