// k_gdn_head (dec_gdn_cuda.cu) on the CPU: a chain of rows (one sequence's tokens, one state) in
// one launch against the rows' one-row launches on a copy of the state: the same bits.
#include "emu.h"
#include "backend/cuda/dec_int.cuh"
namespace qfc {
void dev_fail(ctx *, const char *, ...) {}
#include "gdn.inc" // gdn_task and k_gdn_head, cut from dec_gdn_cuda.cu by run.sh
}
using namespace qfc;

int main() {
    int n = 3, nk = 2, nv = 4, dk = 128, dv = 128, qk = nk * dk, cd = 2 * qk + nv * dv, stride = cd + nv * dv + 2 * nv + 5, sz = nv * dk * dv;
    std::vector<float> mixed((size_t)n * stride), S(sz), S1, gw(dv), out((size_t)n * nv * dv), out1((size_t)n * nv * dv);
    for (auto &v : mixed) v = frand();
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nv; h++) mixed[(size_t)t * stride + cd + nv * dv + h] = 0.5f + 0.4f * frand(), mixed[(size_t)t * stride + cd + nv * dv + nv + h] = -0.3f + 0.25f * frand();
    for (auto &v : S) v = 0.1f * frand();
    for (auto &v : gw) v = frand();
    S1 = S;
    qf_pre gn = {QF_PRE_GATED_NORM, gw.data(), mixed.data() + cd, stride, dv, dv, 1e-6f};
    qf_gdn_dec g = {mixed.data(), stride, n, nk, nv, dk, dv, {0}, out.data(), 1};
    for (int t = 0; t < n; t++) g.S[t] = S.data();
    run_grid(nv, dv / 8 * 32, [&] { k_gdn_head<128, 4, true>(g, dpre_of(&gn)); }); // a block a head
    for (int t = 0; t < n; t++) {
        qf_gdn_dec r = {mixed.data() + (size_t)t * stride, stride, 1, nk, nv, dk, dv, {S1.data()}, out1.data() + (size_t)t * nv * dv, 0};
        qf_pre rn = gn;
        rn.g = gn.g + (size_t)t * stride;
        run_grid(nv, dv / 8 * 32, [&] { k_gdn_head<128, 4>(r, dpre_of(&rn)); });
    }
    for (int t = 0; t < n; t++) {
        double d = 0;
        for (int i = 0; i < nv * dv; i++) d = std::max(d, (double)fabsf(out[(size_t)t * nv * dv + i] - out1[(size_t)t * nv * dv + i]));
        printf("  row %d: max diff %.3g\n", t, d);
    }
    double ds = 0;
    for (int i = 0; i < sz; i++) ds = std::max(ds, (double)fabsf(S[i] - S1[i]));
    printf("  state: max diff %.3g\n", ds);
    int same = !memcmp(out.data(), out1.data(), out.size() * 4) && !memcmp(S.data(), S1.data(), S.size() * 4);
    printf("k_gdn_head chain of %d against one-row launches: %s\n", n, same ? "the same bits" : "FAIL");
    return !same;
}
