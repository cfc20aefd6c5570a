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

// IEEE half -> float, exact (every half is a float); no F16C needed, same on every build.
PLOW_HD static inline float half_to_f32(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t u;
  if (e == 0) {
    if (m == 0) {
      u = sign;
    } else {  // subnormal half: normalise
      int sh = 0;
      uint32_t mm = m;
      while ((mm & 0x400u) == 0) {
        mm <<= 1;
        ++sh;
      }
      u = sign | ((113u - sh) << 23) | ((mm & 0x3ffu) << 13);
    }
  } else if (e == 31) {
    u = sign | 0x7f800000u | (m << 13);
  } else {
    u = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

PLOW_HD static inline int64_t block_bytes(int32_t dt) {
  return dt == PLOW_Q4_0 ? 18 : dt == PLOW_Q4_1 ? 20 : 34;
}

PLOW_HD static inline bool is_blocked(int32_t dt) {
  return dt == PLOW_Q4_0 || dt == PLOW_Q4_1 || dt == PLOW_Q8_0;
}

// The 32 weights of block `b`, decoded.
PLOW_SIMD static void decode_block(const uint8_t* w, int32_t dt, int64_t b, float* out) {
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

// dot(x, w[off .. off + n)) with dot_f32's lanes and tree. A block-aligned run decodes whole
// blocks; an unaligned one (a split-K edge) decodes element by element, same values, same order.
PLOW_SIMD static float dot_blocks(const float* x, const uint8_t* w, int32_t dt, int64_t off,
                                  int64_t n) {
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
