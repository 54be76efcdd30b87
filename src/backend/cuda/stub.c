/* Builds without CUDA: the backend reports that it is not there. */
#include "backend/cuda/ops_cuda.h"
#include "base/err.h"

int qf_cuda_available(void) { return 0; }

int qf_cuda_backend_init(qf_backend *be, int device, const qf_cuda_opts *opts) {
    (void)be, (void)device, (void)opts;
    return qf_fail(QF_EUNSUPPORTED, "this build has no CUDA backend (configure with -DQFLASH_CUDA=ON where nvcc is installed)");
}

void qf_cuda_backend_free(qf_backend *be) { (void)be; }
size_t qf_cuda_peak_bytes(const qf_backend *be) { return (void)be, 0; }
const char *qf_cuda_device_name(const qf_backend *be) { return (void)be, ""; }
