// The FP8 targets: Q, K and V (the forward's O) in e4m3, the backward's dO, internal dS and
// gradients in the call's gradient format, with float32 scale rows in and amaxes out
// (graph/fp8_scales.h); the causal mask and sequence lengths, the masking cuDNN's FP8 graphs
// take.
#include <string>
#include <utility>

#include "graph/fp8_scales.h"
#include "targets/handler.h"
#include "targets/planners.h"

namespace jax_sdpa {
namespace {

ElementType GradientType(const Fp8ForwardAttributes&) { return ElementType::kFloat8E4M3; }
ElementType GradientType(const Fp8BackwardAttributes& attributes) {
  return static_cast<ElementType>(attributes.gradient_type);
}

// Completes an FP8 call's plan (StartPlan read its query, key and value).
template <typename Attributes>
ffi::Error CompleteFp8(const AttentionShape& shape, const Attributes& attributes,
                       CallPlan& plan) {
  constexpr Direction direction = TargetTraits<Attributes>::kDirection;
  const CallOperands& in = plan.operands;
  SdpaConfig& c = plan.config;
  c.gradient_type = GradientType(attributes);
  if (c.element_type != ElementType::kFloat8E4M3 || !IsFp8(c.gradient_type)) {
    return Failure{InvalidArgument("an FP8 call takes float8_e4m3fn operands and an FP8 "
                                   "gradient format")};
  }
  if (c.window_right > 0) {
    return Failure{InvalidArgument("an FP8 call's band is causal (top-left) or none")};
  }
  c.padding = attributes.padding;
  if (c.padding) JAX_SDPA_RETURN_IF_ERROR(CheckLengths(in, shape.vmapped * shape.batch, "batch"));
  const Operand& scales = *in.scales;
  int64_t expected = shape.vmapped * Fp8ScaleCount(direction) * kFp8ScaleRow;
  if (scales.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(scales.element_count()) != expected) {
    return Failure{InvalidArgument("FP8 scales must be float32 [" +
                                   std::to_string(Fp8ScaleCount(direction)) + ", " +
                                   std::to_string(kFp8ScaleRow) + "] per call, got " +
                                   DimsToString(scales.dimensions()))};
  }
  // Scales and amaxes per vmapped slice: one graph run each.
  plan.repeats = shape.vmapped;
  c.batch = shape.batch;
  return ffi::Error::Success();
}

}  // namespace

JAX_SDPA_DEFINE_TARGETS(Fp8, FP8, CompleteFp8)

}  // namespace jax_sdpa
