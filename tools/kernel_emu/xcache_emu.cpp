// k_xc_resolve (xcache_cuda.cu) on the CPU, with hybrid execution: over steps of routed rows, the
// slot map follows the reference policy (experts/cache_policy.c) when the host takes declined
// misses only; the host gets the first ceil(share x misses) of the declined, in order of first
// appearance (share 1: every miss, none admitted); the table points its experts at the zero
// expert, the slots' at their slots and the rest home, so the last step's host experts are home
// again; the job's choices name the host's experts, and the resolve counts what crosses the link.
#include "emu.h"
extern "C" {
#include "experts/cache_policy.h"
}
namespace qfc {
struct xc_drop {
    float tau[QF_DEC_ROWS];
    int min_k;
};
void dev_fail(ctx *, const char *, ...) {}
template <class T> static T atomicMin(T *p, T v) {
    std::lock_guard<std::mutex> g(g_mu);
    T o = *p;
    if (v < o) *p = v;
    return o;
}
#include "xcache.inc" // the resolve kernel, cut from xcache_cuda.cu by run.sh
}
using namespace qfc;

enum { E = 64, S = 8, K = 4, ROWS = 3, STEPS = 12 };

// The reference's ids of a row: top-K of the logits, ties to the lower index.
static void top_k(const float *l, int *ids) {
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int j = 0; j < k; j++) taken |= ids[j] == e;
            if (!taken && (best < 0 || l[e] > l[best])) best = e;
        }
        ids[k] = best;
    }
}

static int run(float share, float fixed, int policy) {
    std::vector<uint32_t> state(qf_xcache_state_bytes(E, S) / 4, 0);
    std::vector<unsigned long long> ctr(QF_XC_COUNTERS, 0);
    std::vector<int32_t> words(QF_XC_HOST_WORDS, 0);
    std::vector<char> slots(S * 64), zero(64), home(E * 64);
    std::vector<const void *> hometab(3 * E), tab(3 * E);
    qf_xc_job job = {};
    for (int m = 0; m < 3; m++)
        for (int e = 0; e < E; e++) hometab[m * E + e] = tab[m * E + e] = home.data() + e * 64 + m * 16;
    qf_xcache x = {};
    x.n_experts = E, x.n_slots = S, x.policy = policy, x.half_life = 64, x.slot_bytes = 64, x.off[1] = 16, x.off[2] = 32;
    x.home = hometab.data(), x.tab = tab.data(), x.slots = slots.data(), x.state = state.data(), x.counters = ctr.data();
    x.host_share = share, x.host_fixed = fixed, x.job = &job, x.zero = zero.data(), x.host_words = words.data();
    qf_slot_cache ref;
    qf_slot_cache_init(&ref, policy, E, S, 64);
    int bad = 0, hosted = 0;
    for (int step = 0; step < STEPS; step++) {
        std::vector<float> rl(ROWS * E);
        for (auto &v : rl) v = frand();
        for (int e = 0; e < 6; e++) rl[(step % ROWS) * E + e] += 1.5f; // some experts come back: hits
        int ids[ROWS * K];
        for (int r = 0; r < ROWS; r++) top_k(rl.data() + r * E, ids + r * K);
        xc_drop drop = {};
        run_grid(1, 512, [&] { k_xc_resolve(x, NULL, 0, rl.data(), E, ROWS, K, drop, 1); });
        // the reference: misses in order of first appearance, which the policy declines
        std::vector<int> order, missed;
        for (int i = 0; i < ROWS * K; i++)
            if (std::find(order.begin(), order.end(), ids[i]) == order.end()) order.push_back(ids[i]);
        for (int e : order)
            if (ref.slot_of[e] < 0) missed.push_back(e);
        int hmax = std::max(0, std::min((int)ceilf(share * (float)missed.size() - fixed), (int)QF_XC_HOST_MAX));
        std::vector<int> host;
        if (share < 1.0f) {
            qf_slot_cache_access(&ref, ids, ROWS * K, NULL, NULL, NULL);
            for (int e : missed)
                if (ref.slot_of[e] < 0 && (int)host.size() < hmax) host.push_back(e);
        } else {
            for (int e : missed)
                if ((int)host.size() < hmax) host.push_back(e);
        }
        qf_slot_cache_tick(&ref);
        hosted += (int)host.size();
        bad += job.n_host != (int)host.size() || state[3] != (uint32_t)(missed.size() - host.size()); // moved over the link
        for (int i = 0; i < (int)host.size() && i < job.n_host; i++) bad += job.host_ids[i] != host[i];
        for (int e = 0; e < E; e++) {
            bool h = std::find(host.begin(), host.end(), e) != host.end();
            int slot = (int)state[QF_XC_HEAD_WORDS + e] - 1;
            if (share < 1.0f) bad += slot != ref.slot_of[e];
            for (int m = 0; m < 3; m++) {
                const void *want = h ? zero.data() + x.off[m] : slot >= 0 ? slots.data() + slot * 64 + x.off[m] : home.data() + e * 64 + m * 16;
                bad += tab[m * E + e] != want;
            }
        }
        for (int i = 0; i < ROWS * K; i++) bad += job.ids[i] != (std::find(host.begin(), host.end(), ids[i]) != host.end() ? ids[i] : -1);
    }
    qf_slot_cache_free(&ref);
    printf("k_xc_resolve, host share %.2f less %.1f, %s: %d steps of %d rows, %d experts to the host, %d mismatches: %s\n", share, fixed, qf_policy_name(policy), STEPS, ROWS,
           hosted, bad, bad ? "FAIL" : "ok");
    return bad || (share > 0.0f && hosted == 0);
}

int main() {
    int fail = 0;
    fail |= run(0.0f, 0.0f, QF_POLICY_DLFU_AD);
    fail |= run(0.5f, 0.0f, QF_POLICY_DLFU_AD);
    fail |= run(0.5f, 0.0f, QF_POLICY_LRU);
    fail |= run(0.5f, 1.5f, QF_POLICY_DLFU_AD); // a call's fixed cost of 1.5 experts: fewer to the host, none for 3 misses or fewer
    fail |= run(1.0f, 0.0f, QF_POLICY_DLFU_AD);
    return fail;
}
