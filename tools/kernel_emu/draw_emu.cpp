// k_draw (dec_draw_cuda.cu) on the CPU against the host sampler with the same uniform numbers: the
// same ids for every setting but the flat one (top-p past QF_DRAW_MAX_K tokens: walked in id order,
// so only its distribution is the host's; `draw_emu V R flat` compares mean ranks).
#include "emu.h"
extern "C" {
#include "runtime/sampler.h"
}

namespace qfc {
#include "draw.inc" // k_draw and its helpers, cut from dec_draw_cuda.cu by run.sh
}

static void run_block(int b, std::function<void()> body) {
    (void)b;
    run_grid(1, 1024, body);
}

static float frand(uint64_t *s) {
    g_rs = *s;
    float f = frand();
    *s = g_rs;
    return f;
}

static int flat_main(int V, int R) {
    uint64_t rs = 5;
    std::vector<float> x0(V);
    for (int i = 0; i < V; i++) x0[i] = frand(&rs) + frand(&rs) + frand(&rs);
    for (int j = 0; j < 6; j++) x0[j * 601] = 4.0f + 0.2f * (float)j;
    qf_sampling p = {1.5f, 0, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 11};
    qf_sampler *a = qf_sampler_create(V, &p), *b = qf_sampler_create(V, &p);
    std::vector<int> rank(V);
    { std::vector<int> ord(V); for (int i = 0; i < V; i++) ord[i] = i;
      std::sort(ord.begin(), ord.end(), [&](int u, int v) { return x0[u] > x0[v] || (x0[u] == x0[v] && u < v); });
      for (int i = 0; i < V; i++) rank[ord[i]] = i; }
    double rd = 0, rh = 0; int maxd = 0, maxh = 0;
    for (int t = 0; t < R; t++) {
        qf_draw d; qf_sampler_draw_desc(a, &d);
        std::vector<float> x = x0, h = x0;
        qfc::ddesc dd = {1, d.top_k, 0, 0, d.temperature, d.top_p, d.min_p, d.repetition, d.u};
        int32_t out = -7;
        run_block(0, [&] { qfc::k_draw(x.data(), V, &dd, nullptr, nullptr, &out); });
        int32_t want = qf_sampler_sample(b, h.data());
        rd += rank[out], rh += rank[want], maxd = std::max(maxd, rank[out]), maxh = std::max(maxh, rank[want]);
    }
    printf("flat: mean rank device %.1f host %.1f, max %d / %d over %d draws\n", rd / R, rh / R, maxd, maxh, R);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 3) return flat_main(atoi(argv[1]), atoi(argv[2]));
    int V = argc > 1 ? atoi(argv[1]) : 4096, R = argc > 2 ? atoi(argv[2]) : 6;
    const qf_sampling set[] = {
        {0.0f, 0, 1.0f, 0.0f, 1.3f, 0.0f, 0.0f, 1},  {0.7f, 20, 0.8f, 0.0f, 1.0f, 0.0f, 0.0f, 2}, {1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 3},
        {0.6f, 0, 0.95f, 0.0f, 1.0f, 0.0f, 0.0f, 4}, {1.0f, 50, 1.0f, 0.1f, 1.1f, 0.5f, 0.3f, 5}, {1.2f, 1024, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 6},
        {1.5f, 0, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 7},
    };
    uint64_t rs = 99;
    int total_bad = 0;
    for (size_t k = 0; k < sizeof set / sizeof *set; k++) {
        int bad = 0;
        for (int t = 0; t < R; t++) {
            std::vector<float> x(V), host(V);
            for (int i = 0; i < V; i++) x[i] = frand(&rs) + frand(&rs) + frand(&rs);
            if (k != 6)
                for (int j = 0; j < 6; j++) x[(t * 7919 + j * 104729) % V] = 6.0f + logf((float)V / 4096.0f) + 0.5f * (float)j; // test_cuda's rows
            qf_sampling p = set[k];
            p.seed = set[k].seed * 1000 + t;
            qf_sampler *a = qf_sampler_create(V, &p), *b = qf_sampler_create(V, &p);
            for (int j = 0; j < 12; j++) {
                int32_t tok = (t * 7919 + (j % 4) * 104729) % V;
                qf_sampler_accept(a, tok, j >= 4), qf_sampler_accept(b, tok, j >= 4);
            }
            qf_draw d;
            qf_sampler_draw_desc(a, &d);
            qfc::ddesc dd = {1, d.top_k, d.n_pen, 0, d.temperature, d.top_p, d.min_p, d.repetition, d.u};
            std::vector<int32_t> ids(d.pen_ids, d.pen_ids + d.n_pen);
            std::vector<float> sub(d.pen_sub, d.pen_sub + d.n_pen);
            host = x;
            int32_t out = -7;
            std::vector<qfc::ddesc> dv(1, dd);
            run_block(0, [&] { qfc::k_draw(x.data(), V, dv.data(), ids.data(), sub.data(), &out); });
            int32_t want = qf_sampler_sample_u(b, host.data(), d.u);
            if (out != want) bad++;
            if (out != want) printf("  setting %zu row %d: device %d, host %d\n", k, t, out, want);
            qf_sampler_free(a), qf_sampler_free(b);
        }
        printf("setting %zu: %d of %d differ%s\n", k, bad, R, k == 6 ? " (flat: only the distribution is the host's)" : "");
        if (k != 6) total_bad += bad;
    }
    return total_bad != 0;
}
