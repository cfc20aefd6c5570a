// plow native kernel — block-quantized weights (GGML Q4_0, Q4_1, Q8_0), decoded in the tile.
//
// A quantized [N, K] weight is its raw blocks, 32 consecutive elements of a row per block
// (K is a multiple of 32, so element i of the flattened weight is element i % 32 of block
// i / 32). A weight is decoded with exactly the float operations of the reference
// de-quantization (plow/checkpoint/quant.py, gguf-py's): q4_1 d * q + m (a multiply, then an
// add), q4_0 d * (q - 8), q8_0 d * q; the dots then accumulate as dot_f32 does, lane l of
// 32 summing elements l, l + 32, ... So a quantized linear gives the bits of the fp32 linear
// over the de-quantized weights, while reading 5/8 (q8_0: 17/16) of a byte per weight.
//
// Included by tiles.h after its lanes (PLOW_LANES, lanes_sum).

#ifndef PLOW_BLOCKS_H
#define PLOW_BLOCKS_H

namespace plow {

// IEEE half -> float, exact: the half's bits shifted into a float's place are the value
// times 2^-112 (normal and subnormal halves alike), and a power-of-two scale is exact;
// infinities and NaNs keep an all-ones exponent. Branch-light, the same on every build.
PLOW_HD static inline float half_to_f32(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  uint32_t u = (h & 0x7fffu) << 13;
  float f;
  if ((h & 0x7c00u) == 0x7c00u) {
    u |= 0x7f800000u;
    memcpy(&f, &u, 4);
  } else {
    memcpy(&f, &u, 4);
    f *= 0x1p112f;
  }
  return (h & 0x8000u) ? -f : f;
}

PLOW_HD static inline int64_t block_bytes(int32_t dt) {
  return dt == PLOW_Q4_0 ? 18 : dt == PLOW_Q4_1 ? 20 : 34;
}

PLOW_HD static inline bool is_blocked(int32_t dt) {
  return dt == PLOW_Q4_0 || dt == PLOW_Q4_1 || dt == PLOW_Q8_0;
}

// The 32 weights of block `b`, decoded; inlined into each SIMD clone of its callers.
PLOW_HD static inline void decode_block(const uint8_t* w, int32_t dt, int64_t b, float* out) {
  const uint8_t* blk = w + b * block_bytes(dt);
  const float d = half_to_f32(blk);
  if (dt == PLOW_Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int l = 0; l < 32; ++l) out[l] = d * static_cast<float>(q[l]);
  } else if (dt == PLOW_Q4_1) {
    const float m = half_to_f32(blk + 2);
    const uint8_t* qs = blk + 4;
    for (int l = 0; l < 16; ++l) {
      out[l] = d * static_cast<float>(qs[l] & 0x0f) + m;
      out[l + 16] = d * static_cast<float>(qs[l] >> 4) + m;
    }
  } else {
    const uint8_t* qs = blk + 2;
    for (int l = 0; l < 16; ++l) {
      out[l] = d * static_cast<float>((qs[l] & 0x0f) - 8);
      out[l + 16] = d * static_cast<float>((qs[l] >> 4) - 8);
    }
  }
}

// Element i of the flattened weight (embedding rows, a bias, an unaligned tile edge).
PLOW_HD static inline float block_weight(const uint8_t* w, int32_t dt, int64_t i) {
  const uint8_t* blk = w + (i / 32) * block_bytes(dt);
  const int j = static_cast<int>(i % 32);
  const float d = half_to_f32(blk);
  if (dt == PLOW_Q8_0) return d * static_cast<float>(reinterpret_cast<const int8_t*>(blk + 2)[j]);
  const uint8_t* qs = blk + (dt == PLOW_Q4_1 ? 4 : 2);
  const int q = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
  if (dt == PLOW_Q4_1) return d * static_cast<float>(q) + half_to_f32(blk + 2);
  return d * static_cast<float>(q - 8);
}

#if defined(PLOW_X86_BLOCKS)
// AVX2 + FMA + F16C spellings of the block-aligned q4_1 / q8_0 dots (the host build's hot
// path; GCC's vectorisation of the portable loop spills the 32 lanes). Each lane does the
// portable loop's operations in its order — exact half widening, d * q rounded, + m rounded,
// one fma — and the lanes are reduced by lanes_sum, so the bits are the portable path's.
}  // namespace plow
#include <immintrin.h>
namespace plow {

// The 32 lanes (four registers of 8) reduced by lanes_sum's tree.
__attribute__((target("avx2,fma,f16c"))) static inline float lanes_sum4(__m256 a0, __m256 a1,
                                                                        __m256 a2, __m256 a3) {
  float acc[PLOW_LANES];
  _mm256_storeu_ps(acc, a0);
  _mm256_storeu_ps(acc + 8, a1);
  _mm256_storeu_ps(acc + 16, a2);
  _mm256_storeu_ps(acc + 24, a3);
  return lanes_sum(acc);
}

#define PLOW_WIDEN_U8(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
#define PLOW_WIDEN_I8(v) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))

__attribute__((target("avx2,fma,f16c"))) static float dot_q4_1_avx2(const float* x,
                                                                    const uint8_t* blk,
                                                                    int64_t blocks) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const __m128i low = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < blocks; ++b, blk += 20, x += 32) {
    uint16_t hd, hm;
    memcpy(&hd, blk, 2);
    memcpy(&hm, blk + 2, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd)), m = _mm256_set1_ps(_cvtsh_ss(hm));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
    const __m256 w0 = _mm256_add_ps(_mm256_mul_ps(d, PLOW_WIDEN_U8(lo)), m);
    const __m256 w1 = _mm256_add_ps(_mm256_mul_ps(d, PLOW_WIDEN_U8(_mm_srli_si128(lo, 8))), m);
    const __m256 w2 = _mm256_add_ps(_mm256_mul_ps(d, PLOW_WIDEN_U8(hi)), m);
    const __m256 w3 = _mm256_add_ps(_mm256_mul_ps(d, PLOW_WIDEN_U8(_mm_srli_si128(hi, 8))), m);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w2, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w3, a3);
  }
  return lanes_sum4(a0, a1, a2, a3);
}

__attribute__((target("avx2,fma,f16c"))) static float dot_q8_0_avx2(const float* x,
                                                                    const uint8_t* blk,
                                                                    int64_t blocks) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < blocks; ++b, blk += 34, x += 32) {
    uint16_t hd;
    memcpy(&hd, blk, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd));
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_mul_ps(d, PLOW_WIDEN_I8(q0)), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), _mm256_mul_ps(d, PLOW_WIDEN_I8(_mm_srli_si128(q0, 8))), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), _mm256_mul_ps(d, PLOW_WIDEN_I8(q1)), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), _mm256_mul_ps(d, PLOW_WIDEN_I8(_mm_srli_si128(q1, 8))), a3);
  }
  return lanes_sum4(a0, a1, a2, a3);
}

// decode_block over `blocks` consecutive q4_1 / q8_0 blocks (the rows a >= 4-row tile decodes
// once for all its rows): the same float operations per element as decode_block.
__attribute__((target("avx2,fma,f16c"))) static void decode_blocks_avx2(const uint8_t* blk,
                                                                        int32_t dt,
                                                                        int64_t blocks,
                                                                        float* out) {
  const __m128i low = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < blocks; ++b, out += 32) {
    uint16_t hd;
    memcpy(&hd, blk, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd));
    if (dt == PLOW_Q4_1) {
      uint16_t hm;
      memcpy(&hm, blk + 2, 2);
      const __m256 m = _mm256_set1_ps(_cvtsh_ss(hm));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(d, PLOW_WIDEN_U8(lo)), m));
      _mm256_storeu_ps(out + 8,
                       _mm256_add_ps(_mm256_mul_ps(d, PLOW_WIDEN_U8(_mm_srli_si128(lo, 8))), m));
      _mm256_storeu_ps(out + 16, _mm256_add_ps(_mm256_mul_ps(d, PLOW_WIDEN_U8(hi)), m));
      _mm256_storeu_ps(out + 24,
                       _mm256_add_ps(_mm256_mul_ps(d, PLOW_WIDEN_U8(_mm_srli_si128(hi, 8))), m));
      blk += 20;
    } else {
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
      _mm256_storeu_ps(out, _mm256_mul_ps(d, PLOW_WIDEN_I8(q0)));
      _mm256_storeu_ps(out + 8, _mm256_mul_ps(d, PLOW_WIDEN_I8(_mm_srli_si128(q0, 8))));
      _mm256_storeu_ps(out + 16, _mm256_mul_ps(d, PLOW_WIDEN_I8(q1)));
      _mm256_storeu_ps(out + 24, _mm256_mul_ps(d, PLOW_WIDEN_I8(_mm_srli_si128(q1, 8))));
      blk += 34;
    }
  }
}

static const bool plow_has_avx2 =
    __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
    __builtin_cpu_supports("f16c");
#endif

// dot(x, w[off .. off + n)) with dot_f32's lanes and tree. A block-aligned run decodes whole
// blocks; an unaligned one (a split-K edge) decodes element by element, same values, same order.
PLOW_SIMD static float dot_blocks(const float* x, const uint8_t* w, int32_t dt, int64_t off,
                                  int64_t n) {
#if defined(PLOW_X86_BLOCKS)
  if (plow_has_avx2 && off % 32 == 0 && n % 32 == 0 && (dt == PLOW_Q4_1 || dt == PLOW_Q8_0)) {
    const uint8_t* blk = w + off / 32 * block_bytes(dt);
    return dt == PLOW_Q4_1 ? dot_q4_1_avx2(x, blk, n / 32) : dot_q8_0_avx2(x, blk, n / 32);
  }
#endif
  float acc[PLOW_LANES] = {0};
  float wv[32];
  int64_t k = 0;
  if (off % 32 == 0) {
    for (; k + 32 <= n; k += 32) {
      decode_block(w, dt, (off + k) / 32, wv);
      for (int l = 0; l < PLOW_LANES; ++l) acc[l] = fmaf(x[k + l], wv[l], acc[l]);
    }
  }
  for (; k < n; ++k) {
    const int l = static_cast<int>(k % PLOW_LANES);
    acc[l] = fmaf(x[k], block_weight(w, dt, off + k), acc[l]);
  }
  return lanes_sum(acc);
}

// Four rows of x against one quantized weight row; each block decoded once for the four.
PLOW_SIMD static void dot4_blocks(const float* x, int64_t ldx, const uint8_t* w, int32_t dt,
                                  int64_t off, int64_t n, float* y) {
  float a0[PLOW_LANES] = {0}, a1[PLOW_LANES] = {0}, a2[PLOW_LANES] = {0}, a3[PLOW_LANES] = {0};
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
  float wv[32];
  int64_t k = 0;
  if (off % 32 == 0) {
    for (; k + 32 <= n; k += 32) {
      decode_block(w, dt, (off + k) / 32, wv);
      for (int l = 0; l < PLOW_LANES; ++l) {
        a0[l] = fmaf(x0[k + l], wv[l], a0[l]);
        a1[l] = fmaf(x1[k + l], wv[l], a1[l]);
        a2[l] = fmaf(x2[k + l], wv[l], a2[l]);
        a3[l] = fmaf(x3[k + l], wv[l], a3[l]);
      }
    }
  }
  for (; k < n; ++k) {
    const int l = static_cast<int>(k % PLOW_LANES);
    const float wk = block_weight(w, dt, off + k);
    a0[l] = fmaf(x0[k], wk, a0[l]);
    a1[l] = fmaf(x1[k], wk, a1[l]);
    a2[l] = fmaf(x2[k], wk, a2[l]);
    a3[l] = fmaf(x3[k], wk, a3[l]);
  }
  y[0] = lanes_sum(a0);
  y[1] = lanes_sum(a1);
  y[2] = lanes_sum(a2);
  y[3] = lanes_sum(a3);
}

}  // namespace plow

#endif
