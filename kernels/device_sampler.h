// plow device kernel — the sampler of a stochastic row, run by all threads of one CTA in the
// quantum's epilogue (kernels/device.cu), so a quantum with temperature > 0 rows stays one
// launch: no logits round trip to the host per step.
//
// The filters and their order are the host's (kernels/sampler.h, plow/runtime/sampler.py):
// softmax at the temperature in float64, top-k (ties at the boundary kept), top-p over the
// order "descending probability, lower id first", min-p, renormalise, then invert the CDF over
// the support in id order with the row's own uniform (drawn by the host from the request's
// generator, one per step). What differs is how sums are associated: the host adds in id
// order, the CTA adds a contiguous chunk per thread and then the chunks in order. The token
// can differ from the host's only when the uniform lands within rounding of a CDF boundary.
//
// Scratch (global memory, one row at a time, its size from sampler_scratch_bytes; the loader
// allocates it with the quantum, plow/runtime/cuda/model.py):
//   z[V], p[V]       float64 logits / temperature and probabilities
//   key[N2], id[N2]  the sort's keys and ids (N2: the power of two >= V)
//   red[T + 1]       per-thread partials, red[T] the combined value
//   idx[2T]          per-thread first CDF crossing and last positive id
//   keep[V]          the survivors
#ifndef PLOW_DEVICE_SAMPLER_H
#define PLOW_DEVICE_SAMPLER_H

#include <math.h>
#include <stdint.h>

#include "plow_abi.h"

namespace plow_dev {

__host__ __device__ inline int64_t sampler_pow2(int64_t v) {
  int64_t n = 1;
  while (n < v) n <<= 1;
  return n;
}

// Bytes of scratch the sampler needs for a vocabulary of V with T threads (8-byte aligned
// pieces; plow/runtime/cuda/model.py's sampler_scratch_bytes states the same layout).
__host__ __device__ inline int64_t sampler_scratch_bytes(int64_t V, int64_t T) {
  const int64_t n2 = sampler_pow2(V);
  const int64_t keep = (V + 7) / 8 * 8;
  return 8 * V + 8 * V + 8 * n2 + 4 * n2 + 8 * (T + 1) + 8 * (2 * T) + keep;
}

struct SamplerScratch {
  double *z, *p, *key, *red;
  int32_t* id;
  int64_t* idx;
  unsigned char* keep;
  int64_t n2;
};

__device__ inline SamplerScratch sampler_carve(unsigned char* base, int64_t V, int64_t T) {
  SamplerScratch s;
  s.n2 = sampler_pow2(V);
  s.z = reinterpret_cast<double*>(base);
  s.p = s.z + V;
  s.key = s.p + V;
  s.red = s.key + s.n2;
  s.idx = reinterpret_cast<int64_t*>(s.red + T + 1);
  s.id = reinterpret_cast<int32_t*>(s.idx + 2 * T);
  s.keep = reinterpret_cast<unsigned char*>(s.id + s.n2);
  return s;
}

// Thread t's contiguous chunk of [0, n).
__device__ inline void sampler_chunk(int64_t n, int64_t* lo, int64_t* hi) {
  const int64_t T = blockDim.x, t = threadIdx.x;
  const int64_t c = (n + T - 1) / T;
  *lo = t * c < n ? t * c : n;
  *hi = (t + 1) * c < n ? (t + 1) * c : n;
}

// The sum of f(i) over [0, n): each thread its chunk in order, then thread 0 the chunks in
// order. Every thread gets the total; red[] is free again on return.
template <class F>
__device__ double sampler_sum(int64_t n, double* red, F f) {
  int64_t lo, hi;
  sampler_chunk(n, &lo, &hi);
  double s = 0.0;
  for (int64_t i = lo; i < hi; ++i) s += f(i);
  red[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (unsigned k = 0; k < blockDim.x; ++k) t += red[k];
    red[blockDim.x] = t;
  }
  __syncthreads();
  const double total = red[blockDim.x];
  __syncthreads();
  return total;
}

// The maximum of f(i) over [0, n) (exact: the order of a max does not matter), -inf if empty.
template <class F>
__device__ double sampler_max(int64_t n, double* red, F f) {
  double m = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double v = f(i);
    if (v > m) m = v;
  }
  red[threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = -INFINITY;
    for (unsigned k = 0; k < blockDim.x; ++k)
      if (red[k] > t) t = red[k];
    red[blockDim.x] = t;
  }
  __syncthreads();
  const double best = red[blockDim.x];
  __syncthreads();
  return best;
}

// Does (ka, ia) come before (kb, ib)? Descending key, then ascending id: a total order, so any
// correct sort gives the host's stable order.
__device__ inline bool sampler_before(double ka, int32_t ia, double kb, int32_t ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// Bitonic sort of key[0, n2) / id[0, n2) into sampler_before order, by the whole CTA.
__device__ void sampler_sort(double* key, int32_t* id, int64_t n2) {
  for (int64_t k = 2; k <= n2; k <<= 1) {
    for (int64_t j = k >> 1; j > 0; j >>= 1) {
      for (int64_t i = threadIdx.x; i < n2; i += blockDim.x) {
        const int64_t l = i ^ j;
        if (l <= i) continue;
        const bool first = (i & k) == 0;  // this run ends in sampler_before order
        const bool swap = first ? sampler_before(key[l], id[l], key[i], id[i])
                                : sampler_before(key[i], id[i], key[l], id[l]);
        if (swap) {
          const double tk = key[i];
          key[i] = key[l];
          key[l] = tk;
          const int32_t ti = id[i];
          id[i] = id[l];
          id[l] = ti;
        }
      }
      __syncthreads();
    }
  }
}

// p[i] = 0 where the row no longer keeps i, then p /= sum(p).
__device__ void sampler_renormalise(SamplerScratch& s, int64_t V) {
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
    if (!s.keep[i]) s.p[i] = 0.0;
  __syncthreads();
  const double total = sampler_sum(V, s.red, [&](int64_t i) { return s.p[i]; });
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) s.p[i] /= total;
  __syncthreads();
}

// One token from the logits row `row` (V entries) of stochastic row `r` with uniform `u` in
// [0, 1); every thread of the CTA calls it, every thread gets the token.
__device__ int32_t sample_row_cta(const float* row, int64_t V, const PlowRow& r, double u,
                                  SamplerScratch& s) {
  const double mx = sampler_max(V, s.red, [&](int64_t i) {
    return isfinite(row[i]) ? static_cast<double>(row[i]) : -INFINITY;
  });
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    s.z[i] = (static_cast<double>(row[i]) - mx) / static_cast<double>(r.temperature);
    s.keep[i] = isfinite(s.z[i]) ? 1 : 0;
  }
  __syncthreads();
  if (r.top_k > 0 && r.top_k < V) {  // keep z >= the k-th largest (ties kept)
    for (int64_t i = threadIdx.x; i < s.n2; i += blockDim.x) {
      s.key[i] = i < V && !isnan(s.z[i]) ? s.z[i] : -INFINITY;
      s.id[i] = i < V ? static_cast<int32_t>(i) : INT32_MAX;
    }
    __syncthreads();
    sampler_sort(s.key, s.id, s.n2);
    const double kth = s.key[r.top_k - 1];
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
      if (!(s.z[i] >= kth)) s.keep[i] = 0;
    __syncthreads();
  }
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) s.p[i] = s.keep[i] ? exp(s.z[i]) : 0.0;
  __syncthreads();
  sampler_renormalise(s, V);
  if (r.top_p < 1.0f) {  // mass strictly before a token (descending, ties by lower id) < top_p
    for (int64_t i = threadIdx.x; i < s.n2; i += blockDim.x) {
      s.key[i] = i < V ? s.p[i] : -1.0;  // padding sorts after every probability
      s.id[i] = i < V ? static_cast<int32_t>(i) : INT32_MAX;
    }
    __syncthreads();
    sampler_sort(s.key, s.id, s.n2);
    int64_t lo, hi;
    sampler_chunk(V, &lo, &hi);
    double part = 0.0;
    for (int64_t j = lo; j < hi; ++j) part += s.key[j];
    s.red[threadIdx.x] = part;
    __syncthreads();
    if (threadIdx.x == 0) {  // exclusive scan of the chunks' masses
      double run = 0.0;
      for (unsigned k = 0; k < blockDim.x; ++k) {
        const double c = s.red[k];
        s.red[k] = run;
        run += c;
      }
    }
    __syncthreads();
    double before = s.red[threadIdx.x];
    for (int64_t j = lo; j < hi; ++j) {
      if (j > 0 && before >= static_cast<double>(r.top_p)) s.keep[s.id[j]] = 0;
      before += s.key[j];
    }
    __syncthreads();
    sampler_renormalise(s, V);
  }
  if (r.min_p > 0.0f) {
    const double best = sampler_max(V, s.red, [&](int64_t i) { return s.p[i]; });
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
      if (s.p[i] < static_cast<double>(r.min_p) * best) s.keep[i] = 0;
    __syncthreads();
    sampler_renormalise(s, V);
  }
  // invert the CDF in id order: chunk masses, their exclusive scan, then the crossing chunk
  int64_t lo, hi;
  sampler_chunk(V, &lo, &hi);
  double part = 0.0;
  for (int64_t i = lo; i < hi; ++i)
    if (s.p[i] > 0.0) part += s.p[i];
  s.red[threadIdx.x] = part;
  __syncthreads();
  if (threadIdx.x == 0) {
    double run = 0.0;
    for (unsigned k = 0; k < blockDim.x; ++k) {
      const double c = s.red[k];
      s.red[k] = run;
      run += c;
    }
    s.red[blockDim.x] = run;
  }
  __syncthreads();
  const double target = u * s.red[blockDim.x];
  double cdf = s.red[threadIdx.x];
  int64_t hit = -1, last = -1;
  for (int64_t i = lo; i < hi; ++i) {
    if (s.p[i] <= 0.0) continue;
    last = i;
    cdf += s.p[i];
    if (hit < 0 && cdf > target) hit = i;
  }
  s.idx[threadIdx.x] = hit;
  s.idx[blockDim.x + threadIdx.x] = last;
  __syncthreads();
  int64_t tok = -1;
  for (unsigned k = 0; k < blockDim.x && tok < 0; ++k) tok = s.idx[k];
  if (tok < 0)  // rounding left the target at or past the total: the last survivor
    for (unsigned k = 0; k < blockDim.x; ++k)
      if (s.idx[blockDim.x + k] > tok) tok = s.idx[blockDim.x + k];
  __syncthreads();
  return static_cast<int32_t>(tok);
}

}  // namespace plow_dev
#endif
