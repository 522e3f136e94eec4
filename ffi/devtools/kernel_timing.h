// cuDNN's SDPA graphs timed alone, outside JAX and XLA: every plan cuDNN's heuristics offer,
// on device buffers of random inputs, with CUDA events around a straight run of executions on
// a private stream. benchmarks/plans.py sets these against the same shapes called through
// jax_sdpa (how much a call costs around the kernel) and shows whether a plan other than the
// heuristics' first would be faster (whether autotuning could pay).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/check.h"
#include "graph/sdpa_config.h"

namespace jax_sdpa {

struct PlanTiming {
  int64_t plan = 0;            // index in the heuristics' order of preference
  std::string name;            // cuDNN's name for the plan's engine configuration
  int64_t workspace_size = 0;  // bytes
  double ms = -1;              // GPU time per execution; < 0 if the plan did not build or run
  double host_us = -1;         // CPU time to enqueue one execution
  std::string error;           // why the plan has no time
};

// Device pointers of one input set the caller owns (e.g. JAX arrays' buffers), in the order
// q, k, v, o, stats and, for the backward, d_o, dq, dk, dv. o and stats (and the gradients) are
// overwritten.
using BufferSet = std::vector<void*>;

// Times config.direction's graph (no bias or dropout) on config.device: `iterations`
// executions of each plan, rotating over the `given` sets of buffers, or, if none are given,
// over `input_sets` sets of buffers of random values. A ragged config (config.ragged and
// padding, batch = entries, total_q/kv_tokens the arrays' tokens) takes random inputs and one
// length per entry in `document_lengths` (0: an empty entry), packed from token 0 on. A
// forward may force one of the frontend's implementations.
ffi::Error TimePlans(const SdpaConfig& config, ForwardImplementation implementation,
                     int64_t iterations, int64_t input_sets, const std::vector<BufferSet>& given,
                     const std::vector<int32_t>& document_lengths,
                     std::vector<PlanTiming>* timings);

}  // namespace jax_sdpa
