// An FP8 call's float32 scale factors and amaxes: which, in which order, and how they lie in
// memory (one row of kFp8ScaleRow floats each: cuDNN reads each as a [1, 1, 1, 1] tensor and
// wants it 16-byte aligned). Python builds the same rows (jax_sdpa/fp8_kernels.py, fp8.py).
#pragma once

#include <cstdint>

#include "graph/sdpa_config.h"

namespace jax_sdpa {

constexpr int64_t kFp8ScaleRow = 4;

// A descale undoes the scale its tensor was quantized with; scale_s quantizes the softmax
// weights, scale_o the output, scale_dp the backward's dS, scale_dq/dk/dv the gradients. The
// forward reads the first six, the backward all thirteen.
enum Fp8Scale : int64_t {
  kDescaleQ,
  kDescaleK,
  kDescaleV,
  kDescaleS,
  kScaleS,
  kScaleO,
  kDescaleO,
  kDescaleDO,
  kDescaleDP,
  kScaleDQ,
  kScaleDK,
  kScaleDV,
  kScaleDP,
};
enum Fp8ForwardAmax : int64_t { kAmaxS, kAmaxO };
enum Fp8BackwardAmax : int64_t { kAmaxDQ, kAmaxDK, kAmaxDV, kAmaxDP };

inline int64_t Fp8ScaleCount(Direction direction) {
  return direction == Direction::kForward ? kScaleO + 1 : kScaleDP + 1;
}
inline int64_t Fp8AmaxCount(Direction direction) {
  return direction == Direction::kForward ? kAmaxO + 1 : kAmaxDP + 1;
}

}  // namespace jax_sdpa
