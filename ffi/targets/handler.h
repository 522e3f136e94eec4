// A target's XLA FFI handler: its binding (exactly the operands, results and attributes
// jax_sdpa/cudnn/targets.py declares for it), its entry (the buffers by name, the optional
// ones read by the declared order, its planner, then the run), and the same handler marked for
// XLA's command buffers. Every target of targets.py is defined by one JAX_SDPA_DEFINE_TARGET
// in its job's file; module.cc registers them.
#pragma once

#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "call/call_state.h"
#include "call/execution.h"
#include "call/target.h"
#include "targets/planners.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

// Each target's handler and its command-buffer twin: <Handler>Handler and
// <Handler>CommandBufferHandler.
#define JAX_SDPA_DECLARE_TARGET_HANDLERS(Handler)            \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Handler##Handler);          \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Handler##CommandBufferHandler);
JAX_SDPA_TARGETS(JAX_SDPA_DECLARE_TARGET_HANDLERS)
#undef JAX_SDPA_DECLARE_TARGET_HANDLERS

// Reads a target's optional operands from XLA's remaining arguments.
template <typename Attributes>
ffi::Error ReadOptionalOperands(const ffi::RemainingArgs& rest, const Attributes& attributes,
                                CallOperands& operands) {
  return TargetTraits<Attributes>::ReadOptional(
      rest.size(),
      [&](size_t i) -> ffi::ErrorOr<Operand> {
        ffi::ErrorOr<ffi::AnyBuffer> buffer = rest.get<ffi::AnyBuffer>(i);
        if (!buffer.has_value()) return Failure{buffer.error()};
        return Operand(*buffer);
      },
      attributes, operands);
}

// Plans and runs a call whose buffers are gathered, forward or backward as its target's
// direction.
template <typename Attributes>
ffi::Error PlanAndRun(cudaStream_t stream, int32_t device, ffi::ScratchAllocator& scratch,
                      CallState* state, CallOperands operands, const ffi::RemainingArgs& rest,
                      CallResults results, ffi::RemainingRets& extra,
                      const Attributes& attributes) {
  using Traits = TargetTraits<Attributes>;
  try {
    JAX_SDPA_RETURN_IF_ERROR(ReadOptionalOperands(rest, attributes, operands));
    JAX_SDPA_RETURN_IF_ERROR(Traits::ReadOptionalResults(extra, attributes, results));
    JAX_SDPA_ASSIGN_OR_RETURN(CallPlan plan, Plan(device, std::move(operands), attributes));
    CallContext context{stream, device, scratch, *state, attributes.command_buffer};
    if constexpr (Traits::kDirection == Direction::kForward) {
      return RunForward(context, plan, results);
    } else {
      return RunBackward(context, plan, results);
    }
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(Traits::kName) + ": " + e.what());
  }
}

}  // namespace jax_sdpa

// Defines target `Handler` (its declarations in targets.inc under UPPER) of the dense layout:
// its planner, StartPlan (call_plan.h) then `Complete(shape, attributes, plan)`, and its
// handlers, run by RunForward or RunBackward as its direction says.
#define JAX_SDPA_DEFINE_TARGET(Handler, UPPER, Complete)                                      \
  ffi::ErrorOr<CallPlan> Plan(int32_t device, CallOperands operands,                          \
                              const Handler##Attributes& attributes) {                        \
    CallPlan plan;                                                                             \
    JAX_SDPA_ASSIGN_OR_RETURN(AttentionShape shape,                                            \
                              StartPlan(plan, device, std::move(operands), attributes));       \
    JAX_SDPA_RETURN_IF_ERROR(Complete(shape, attributes, plan));                               \
    return plan;                                                                               \
  }                                                                                            \
  JAX_SDPA_DEFINE_HANDLER(Handler, UPPER)

// A job's forward and backward targets (JobForward and JobBackward), one planner for both.
#define JAX_SDPA_DEFINE_TARGETS(Job, JOB, Complete)           \
  JAX_SDPA_DEFINE_TARGET(Job##Forward, JOB##_FORWARD, Complete) \
  JAX_SDPA_DEFINE_TARGET(Job##Backward, JOB##_BACKWARD, Complete)

// The handlers of target `Handler`.
#define JAX_SDPA_DEFINE_HANDLER(Handler, UPPER)                                               \
  ffi::Error Handler##Entry(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch, \
                            CallState* state,                                                  \
                            JAX_SDPA_##UPPER##_ARGS(JAX_SDPA_ARG_PARAMETER)                    \
                                ffi::RemainingArgs rest,                                       \
                            JAX_SDPA_##UPPER##_RETS(JAX_SDPA_RET_PARAMETER)                    \
                                ffi::RemainingRets extra,                                      \
                            Handler##Attributes attributes) {                                  \
    CallOperands operands;                                                                     \
    JAX_SDPA_##UPPER##_ARGS(JAX_SDPA_KEEP_ARG)                                                 \
    CallResults results;                                                                       \
    JAX_SDPA_##UPPER##_RETS(JAX_SDPA_KEEP_RET)                                                 \
    return PlanAndRun(stream, device, scratch, state, std::move(operands), rest,              \
                      std::move(results), extra, attributes);                                  \
  }                                                                                            \
  auto Handler##Binding() {                                                                    \
    return ffi::Ffi::Bind()                                                                    \
        .Ctx<ffi::PlatformStream<cudaStream_t>>()                                              \
        .Ctx<ffi::DeviceOrdinal>()                                                             \
        .Ctx<ffi::ScratchAllocator>()                                                          \
        .Ctx<ffi::State<CallState>>()                                                          \
        JAX_SDPA_##UPPER##_ARGS(JAX_SDPA_BIND_ARG)                                             \
        .RemainingArgs()                                                                       \
        JAX_SDPA_##UPPER##_RETS(JAX_SDPA_BIND_RET)                                             \
        .RemainingRets()                                                                       \
        .Attrs<Handler##Attributes>();                                                         \
  }                                                                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Handler##Handler, Handler##Entry, Handler##Binding());       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Handler##CommandBufferHandler, Handler##Entry,                \
                                Handler##Binding(), {ffi::Traits::kCmdBufferCompatible});
