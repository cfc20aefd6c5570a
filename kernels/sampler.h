// plow native kernel — the step epilogue: the sampler and the multi-step bookkeeping.
//
// After each step of a quantum, every live row takes its token: greedy rows the packets'
// argmax (already in the ids slot: the sample op writes where the next step's embedding
// reads), stochastic rows a draw from their logits row with the filters of
// plow/runtime/sampler.py, in float64 and in the same order (temperature, top-k with ties at
// the boundary kept, top-p over a stable descending sort, min-p, renormalise, invert the CDF
// over the support with one uniform). The uniforms come from the request's own seeded
// generator, drawn by the host ahead of the quantum (one per token the row may produce), so a
// request's tokens depend only on its seed and its logits, never on its batch. Then the token
// goes to the ring, the row's budget shrinks and its position advances (or the row becomes
// padding at its budget, a stop id or the context end) — several steps per host round trip.
#ifndef PLOW_SAMPLER_H
#define PLOW_SAMPLER_H

#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "plow_abi.h"

namespace plow {

struct SampleScratch {
  std::vector<double> z, p, zk;
  std::vector<int32_t> order;
  std::vector<char> keep;
};

static inline void renormalise(std::vector<double>& p, const std::vector<char>& keep) {
  double s = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (!keep[i]) p[i] = 0.0;
    s += p[i];
  }
  for (double& x : p) x /= s;
}

// One token from one logits row (V entries) for a stochastic row with uniform `u` in [0, 1).
static int32_t sample_logits(const float* row, int64_t V, const PlowRow& r, double u,
                             SampleScratch& sc) {
  auto& z = sc.z;
  auto& p = sc.p;
  auto& keep = sc.keep;
  z.resize(V);
  p.resize(V);
  keep.resize(V);
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i)
    if (isfinite(row[i]) && row[i] > mx) mx = row[i];
  for (int64_t i = 0; i < V; ++i) {
    z[i] = (static_cast<double>(row[i]) - mx) / static_cast<double>(r.temperature);
    keep[i] = isfinite(z[i]) ? 1 : 0;
  }
  if (r.top_k > 0 && r.top_k < V) {  // keep z >= the k-th largest (ties kept)
    sc.zk.assign(z.begin(), z.end());
    std::nth_element(sc.zk.begin(), sc.zk.begin() + (V - r.top_k), sc.zk.end());
    const double kth = sc.zk[V - r.top_k];
    for (int64_t i = 0; i < V; ++i)
      if (!(z[i] >= kth)) keep[i] = 0;
  }
  for (int64_t i = 0; i < V; ++i) p[i] = keep[i] ? exp(z[i]) : 0.0;
  renormalise(p, keep);
  if (r.top_p < 1.0f) {  // mass strictly before a token (descending, ties by lower id) < top_p
    auto& order = sc.order;
    order.resize(V);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    double before = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      const int32_t i = order[j];
      if (j > 0 && before >= static_cast<double>(r.top_p)) keep[i] = 0;
      before += p[i];
    }
    renormalise(p, keep);
  }
  if (r.min_p > 0.0f) {
    double best = 0.0;
    for (double x : p) best = std::max(best, x);
    for (int64_t i = 0; i < V; ++i)
      if (p[i] < static_cast<double>(r.min_p) * best) keep[i] = 0;
    renormalise(p, keep);
  }
  double total = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < V; ++i)
    if (p[i] > 0.0) total += p[i], last = i;
  const double target = u * total;
  double cdf = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    if (p[i] <= 0.0) continue;
    cdf += p[i];
    if (cdf > target) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last);
}

}  // namespace plow
#endif
