// The straightforward C++ replay that scripts/bench_simulator.py compares the simulator with.
//
// A direct reading of docs/policies.md for the paper's presets (rules fetch_all, threshold,
// first_choice; eviction lfu with gamma = 1; admission beta with delay 1; fallback substitute),
// one layer cache after another, with plain linear scans: the victim is a pass over the slots,
// a substitute is a walk down the candidate ranking. No tricks, built with -O2.
//
//   g++ -O2 -std=c++17 -o replay_ref replay_ref.cpp
//   replay_ref INPUT.bin RULE TAU BETA REPEATS
// RULE: 0 fetch_all, 1 threshold, 2 first_choice (codes of runtime.policy.RULE_CODE); BETA <= 0: off.
// INPUT.bin: int64 T, L, E, k, M, C; int32 ids [L, T, k]; float64 w [L, T, k]; int32 rank [L, T, M];
// int32 init [L, C] (-1 = empty slot). Prints one line: hits fetches substitutions drops admissions
// substituted_mass best_cpu_seconds best_wall_seconds (the replay loop alone, best of REPEATS each).
#include <chrono>
#include <ctime>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <utility>
#include <vector>

int main(int argc, char** argv) {
    if (argc != 6) {
        std::fprintf(stderr, "usage: replay_ref INPUT.bin RULE TAU BETA REPEATS\n");
        return 2;
    }
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) { std::perror(argv[1]); return 2; }
    int64_t hdr[6];
    if (std::fread(hdr, sizeof(int64_t), 6, f) != 6) return 2;
    const int64_t T = hdr[0], L = hdr[1], E = hdr[2], k = hdr[3], M = hdr[4], C = hdr[5];
    std::vector<int32_t> ids(L * T * k), rank(L * T * M), init(L * C);
    std::vector<double> w(L * T * k);
    if (std::fread(ids.data(), 4, ids.size(), f) != ids.size() || std::fread(w.data(), 8, w.size(), f) != w.size() ||
        std::fread(rank.data(), 4, rank.size(), f) != rank.size() || std::fread(init.data(), 4, init.size(), f) != init.size())
        return 2;
    std::fclose(f);
    const int rule = std::atoi(argv[2]);
    const double tau = rule == 2 ? 1e300 : std::atof(argv[3]);
    const double beta = std::atof(argv[4]);
    const int repeats = std::atoi(argv[5]);
    int64_t hits = 0, fetches = 0, subs = 0, drops = 0, adm = 0;
    double mass = 0.0, best = 1e300, best_cpu = 1e300;
    for (int rep = 0; rep < repeats; ++rep) {
        hits = fetches = subs = drops = adm = 0;
        mass = 0.0;
        auto t_start = std::chrono::steady_clock::now();
        std::clock_t c_start = std::clock();
        for (int64_t l = 0; l < L; ++l) {
            std::vector<int32_t> slot(C, -1);          // expert held by each slot
            std::vector<int32_t> where(E, -1);         // slot of each expert
            std::vector<int64_t> freq(E, 0);           // LFU count f[e]
            std::vector<double> acc(E, 0.0);           // admission accumulator a[e]
            std::vector<char> queued(E, 0);
            std::vector<int64_t> pinned(C, -1);        // stamp of the step protecting a slot
            std::deque<std::pair<int32_t, int64_t>> queue;  // (expert, due token)
            for (int64_t s = 0; s < C; ++s) {
                int32_t e = init[l * C + s];
                slot[s] = e;
                if (e >= 0) where[e] = (int32_t)s;
            }
            int64_t stamp = 0;
            auto claim = [&](int32_t e, int64_t st) -> int64_t {  // free slot, else the min-(f, id) unpinned resident
                int64_t best_s = -1;
                for (int64_t s = 0; s < C; ++s)
                    if (slot[s] < 0) { best_s = s; break; }
                if (best_s < 0) {
                    for (int64_t s = 0; s < C; ++s) {
                        if (pinned[s] == st) continue;
                        if (best_s < 0 || freq[slot[s]] < freq[slot[best_s]] ||
                            (freq[slot[s]] == freq[slot[best_s]] && slot[s] < slot[best_s]))
                            best_s = s;
                    }
                    if (best_s < 0) return -1;
                    where[slot[best_s]] = -1;
                }
                slot[best_s] = e;
                where[e] = (int32_t)best_s;
                pinned[best_s] = st;
                acc[e] = 0.0;
                return best_s;
            };
            std::vector<int> kind(k);  // 0 hit, 1 fetch, 2 substitute (miss not fetched)
            std::vector<int32_t> used;
            std::vector<int32_t> cand;
            for (int64_t t = 0; t < T; ++t) {
                const int32_t* sel = &ids[(l * T + t) * k];
                const double* wt = &w[(l * T + t) * k];
                const int32_t* rk = &rank[(l * T + t) * M];
                // admissions due (one batch per due token, never evicting one of the same batch)
                while (!queue.empty() && queue.front().second <= t) {
                    int64_t due = queue.front().second;
                    ++stamp;
                    while (!queue.empty() && queue.front().second == due) {
                        int32_t e = queue.front().first;
                        queue.pop_front();
                        queued[e] = 0;
                        if (where[e] >= 0) continue;
                        if (claim(e, stamp) >= 0) ++adm;
                    }
                }
                ++stamp;
                used.clear();
                for (int64_t j = 0; j < k; ++j) {
                    int32_t e = sel[j];
                    if (where[e] >= 0) { kind[j] = 0; pinned[where[e]] = stamp; ++hits; }
                    else kind[j] = 2;
                    used.push_back(e);
                }
                for (int64_t j = 0; j < k; ++j)
                    if (kind[j] == 2 && (rule == 0 || j == 0 || wt[j] >= tau)) {
                        claim(sel[j], stamp);
                        kind[j] = 1;
                        ++fetches;
                    }
                cand.clear();
                for (int64_t j = 0; j < k; ++j) {
                    if (kind[j] != 2) continue;
                    int32_t found = -1;
                    for (int64_t m = 0; m < M && found < 0; ++m) {
                        int32_t c = rk[m];
                        if (where[c] < 0) continue;
                        bool u = false;
                        for (int32_t x : used) u = u || x == c;
                        if (!u) found = c;
                    }
                    if (found >= 0) { ++subs; used.push_back(found); }
                    else ++drops;
                    mass += wt[j];
                    acc[sel[j]] += wt[j];
                    cand.push_back(sel[j]);
                }
                for (int64_t j = 0; j < k; ++j) freq[sel[j]] += 1;
                if (beta > 0.0) {
                    std::vector<int32_t> q;
                    for (int32_t e : cand)
                        if (acc[e] >= beta && !queued[e] && where[e] < 0) { queued[e] = 1; q.push_back(e); }
                    for (size_t a = 1; a < q.size(); ++a)  // largest a[e] first, ties lower id
                        for (size_t b = a; b > 0 && (acc[q[b - 1]] < acc[q[b]] ||
                                                     (acc[q[b - 1]] == acc[q[b]] && q[b - 1] > q[b])); --b)
                            std::swap(q[b - 1], q[b]);
                    for (int32_t e : q) { queue.emplace_back(e, t + 1); acc[e] = 0.0; }
                }
            }
        }
        double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
        double cpu = double(std::clock() - c_start) / CLOCKS_PER_SEC;
        if (sec < best) best = sec;
        if (cpu < best_cpu) best_cpu = cpu;
    }
    std::printf("%lld %lld %lld %lld %lld %.10f %.9f %.9f\n", (long long)hits, (long long)fetches, (long long)subs,
                (long long)drops, (long long)adm, mass, best_cpu, best);
    return 0;
}
