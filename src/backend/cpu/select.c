/* Run-time choice of the CPU ops table: the widest ISA this CPU has. QFLASH_CPU_OPS=ref|avx2|avx512
 * forces one (for A/B checks). */
#include <stdlib.h>
#include <string.h>

#include "backend/ops.h"

const qf_ops *qf_cpu_ops_best(void) {
    const char *force = getenv("QFLASH_CPU_OPS");
    if (force && strcmp(force, "ref") == 0) return &qf_cpu_ops_ref;
    if (force && strcmp(force, "avx2") == 0 && qf_cpu_ops_avx2()) return qf_cpu_ops_avx2();
    if ((!force || strcmp(force, "avx512") == 0) && qf_cpu_ops_avx512()) return qf_cpu_ops_avx512();
    if (qf_cpu_ops_avx2()) return qf_cpu_ops_avx2();
    return &qf_cpu_ops_ref;
}
