// Running a planned call on XLA's stream, whatever its target: the results checked against the
// plan, cuDNN's unwritten elements filled, the graph found (the call's state, the cache, or a
// build) with its workspace, executed once per repeat, and the rows the plan poisons or zeroes
// written after (row_fills.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "call/call_plan.h"
#include "call/call_state.h"
#include "call/target.h"
#include "common/check.h"

namespace jax_sdpa {

struct CallContext {
  cudaStream_t stream;
  int32_t device;
  ffi::ScratchAllocator& scratch;
  CallState& state;
  // Recorded into a command buffer (a CUDA graph): replays after the call returned, so it takes
  // a workspace of its own when XLA gives it none, and may not wait for the GPU.
  bool command_buffer;
};

// Forward: results.output, results.stats (and an FP8 call's results.amaxes, a planned
// results.workspace).
ffi::Error RunForward(const CallContext& context, CallPlan& plan, const CallResults& results);

// Backward: results.dq, dk, dv (and dbias, amaxes, workspace as the plan has them).
ffi::Error RunBackward(const CallContext& context, CallPlan& plan, const CallResults& results);

}  // namespace jax_sdpa
