// k_gemv_pre with int8 rows (dec_gemv_cuda.cu) on the CPU against the reference product: the pres,
// row counts and grids, and the DeltaNet epilogue with rows chained through one conv state.
#include "emu.h"
static float4 g_dyn[65536];
#include "backend/cuda/quant.cuh"
#include "backend/cuda/dec_int.cuh"
extern "C" {
#include "base/quant.h"
}
namespace qfc {
void dev_fail(ctx *, const char *, ...) {}
#include "gemv.inc" // dot16q8s and k_gemv_pre, cut from dec_gemv_cuda.cu by run.sh
}
using namespace qfc;


template <int NT, int PWT>
static double check(int rows, int cols, int n, int kind, int acc, unsigned grid) {
    size_t rb = qf_q_row_bytes(QF_Q_I8B32, cols);
    std::vector<uint8_t> W((size_t)rows * rb);
    std::vector<float> w(cols), x((size_t)n * cols), nw(cols), g((size_t)n * cols), y((size_t)n * rows), want((size_t)n * rows), xp((size_t)n * cols);
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols; c++) w[c] = 0.05f * frand();
        qf_q_quantize_row(QF_Q_I8B32, w.data(), cols, W.data() + (size_t)r * rb);
    }
    for (auto &v : x) v = 2.0f * frand();
    for (auto &v : nw) v = frand();
    for (auto &v : y) v = frand();
    // reference: pre then the dequantised product
    for (int t = 0; t < n; t++) {
        double ss = 0;
        for (int c = 0; c < cols; c++) ss += (double)x[t * cols + c] * x[t * cols + c];
        float inv = kind == QF_PRE_RMSNORM ? (float)(1.0 / sqrt(ss / cols + 1e-6)) : 1.0f;
        for (int c = 0; c < cols; c++) xp[t * cols + c] = kind == QF_PRE_RMSNORM ? x[t * cols + c] * inv * nw[c] : x[t * cols + c];
    }
    qf_q_matmul_ref(QF_Q_I8B32, W.data(), NULL, rows, cols, xp.data(), n, want.data());
    for (size_t i = 0; i < want.size(); i++) want[i] += acc ? y[i] : 0.0f;
    qf_pre pre = {kind, nw.data(), NULL, 0, 0, 0, 1e-6f};
    dpre p = dpre_of(kind ? &pre : NULL);
    depi e = {};
    run_grid(grid, 256, [&] { k_gemv_pre<NT, PWT, QK_I8>(W.data(), rows, cols, x.data(), n, p, e, acc, y.data(), 1); });
    double err = 0, ref = 0;
    for (size_t i = 0; i < want.size(); i++) err = std::max(err, (double)fabsf(y[i] - want[i])), ref = std::max(ref, (double)fabsf(want[i]));
    return err / ref;
}

/* in_proj with the DeltaNet epilogue, n rows chained through one conv state (a verify), int8 rows */
template <int NT>
static double check_epi(int n, unsigned grid) {
    int cd = 64, zd = 32, nv = 8, K = 4, rows = cd + zd + 2 * nv, cols = 256;
    size_t rb = qf_q_row_bytes(QF_Q_I8B32, cols);
    std::vector<uint8_t> W((size_t)rows * rb);
    std::vector<float> w(cols), x((size_t)n * cols), raw((size_t)n * rows), y((size_t)n * rows), want((size_t)n * rows);
    std::vector<float> cw((size_t)cd * K), dtb(nv), na(nv), st((size_t)(K - 1) * cd), st_ref;
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols; c++) w[c] = 0.05f * frand();
        qf_q_quantize_row(QF_Q_I8B32, w.data(), cols, W.data() + (size_t)r * rb);
    }
    for (auto &v : x) v = frand();
    for (auto &v : cw) v = 0.5f * frand();
    for (auto &v : dtb) v = frand();
    for (auto &v : na) v = -fabsf(frand());
    for (auto &v : st) v = frand();
    st_ref = st;
    qf_q_matmul_ref(QF_Q_I8B32, W.data(), NULL, rows, cols, x.data(), n, raw.data());
    for (int t = 0; t < n; t++)
        for (int r = 0; r < rows; r++) {
            float v = raw[(size_t)t * rows + r], o;
            if (r < cd) {
                float acc = 0;
                for (int j = 0; j < K - 1; j++) acc += cw[(size_t)r * K + j] * st_ref[(size_t)j * cd + r];
                acc += cw[(size_t)r * K + K - 1] * v;
                for (int j = 0; j + 1 < K - 1; j++) st_ref[(size_t)j * cd + r] = st_ref[(size_t)(j + 1) * cd + r];
                st_ref[(size_t)(K - 2) * cd + r] = v;
                o = acc / (1.0f + expf(-acc));
            } else if (r < cd + zd) o = v;
            else if (r < cd + zd + nv) o = 1.0f / (1.0f + expf(-v));
            else { float u = v + dtb[r - cd - zd - nv]; o = na[r - cd - zd - nv] * (u > 20.0f ? u : log1pf(expf(u))); }
            want[(size_t)t * rows + r] = o;
        }
    depi e = {1, cd, zd, nv, K, cw.data(), dtb.data(), na.data(), {}};
    for (int t = 0; t < n; t++) e.st[t] = st.data();
    run_grid(grid, 256, [&] { k_gemv_pre<NT, 2, QK_I8>(W.data(), rows, cols, x.data(), n, dpre_of(NULL), e, 0, y.data(), 1); });
    double err = 0, ref = 0;
    for (size_t i = 0; i < want.size(); i++) err = std::max(err, (double)fabsf(y[i] - want[i])), ref = std::max(ref, (double)fabsf(want[i]));
    double serr = 0;
    for (size_t i = 0; i < st.size(); i++) serr = std::max(serr, (double)fabsf(st[i] - st_ref[i]));
    return std::max(err / ref, serr);
}

static int bad;
static void report(const char *what, double err) {
    printf("  %-40s rel err %.2e\n", what, err);
    bad += !(err < 1e-5);
}

int main() {
    report("in_proj epilogue, 4 rows chained, NT 4", check_epi<4>(4, 2));
    report("in_proj epilogue, one row", check_epi<1>(1, 3));
    report("rmsnorm [100 x 2048], a warp a row", check<1, 1>(100, 2048, 1, QF_PRE_RMSNORM, 0, 2));
    report("none [70 x 4096] +=, 1 row", check<1, 2>(70, 4096, 1, QF_PRE_NONE, 1, 3));
    report("rmsnorm [50 x 2048], 3 rows", check<3, 2>(50, 2048, 3, QF_PRE_RMSNORM, 0, 2));
    report("none [33 x 256] +=, 4 rows", check<4, 2>(33, 256, 4, QF_PRE_NONE, 1, 1));
    report("rmsnorm [40 x 2048], 16 rows", check<16, 2>(40, 2048, 16, QF_PRE_RMSNORM, 0, 2));
    printf("k_gemv_pre (int8): %s\n", bad ? "FAIL" : "ok");
    return bad != 0;
}
