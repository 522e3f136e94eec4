// From a call's operands and attributes to the graph config it runs (SdpaConfig) and how it
// runs it (repeats over vmapped slices, the optional operands); every shape is checked here,
// before cuDNN sees it. The handlers and the trace-time workspace planning share it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "call_attributes.h"
#include "check.h"
#include "fp8_scales.h"
#include "operand.h"
#include "sdpa_config.h"

namespace jax_sdpa {

// The optional inputs after the fixed ones: [bias], [q_lengths, kv_lengths], [q_segment_ids,
// kv_segment_ids], [offsets], [grid], [page_table], [dropout_seed], [poison_rows], [tails],
// [fp8_scales].
struct OptionalInputs {
  std::optional<Operand> bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, offsets,
      grid, page_table, dropout_seed, poison_rows, tails, fp8_scales;
};

// How one call maps onto a cached graph: the config, and how many times the graph runs, each
// time on the next 1/repeats of every operand.
struct CallPlan {
  SdpaConfig config;
  int64_t repeats = 1;
  int64_t offsets_row = 0;  // ragged: elements per row of the offsets operand
  OptionalInputs optional;
  // A ragged call with fallback_ids: the dense call over its rows masking the segment ids
  // (stats token-major, as the ragged layout's), which a device grid of 0 documents runs.
  std::optional<SdpaConfig> fallback;
};

// Reads the optional operands from `count` operands, `get(i)` returning the i-th (an
// ffi::ErrorOr<Operand>): XLA's remaining arguments, or shapes Python describes when it plans
// a call (PlannedWorkspaceBytes).
template <typename Get>
ffi::ErrorOr<OptionalInputs> ReadOptionalInputs(size_t count, Get get,
                                                const CallAttributes& attributes) {
  bool has_dropout = attributes.dropout > 0;
  size_t expected = (attributes.has_bias ? 1 : 0) + (attributes.padding ? 2 : 0) +
                    (attributes.segment_mask || attributes.fallback_ids ? 2 : 0) +
                    (attributes.ragged ? 1 : 0) + (attributes.device_grid ? 1 : 0) +
                    (attributes.paged ? 1 : 0) +
                    (has_dropout ? 1 : 0) + (attributes.poison_rows ? 1 : 0) +
                    (attributes.zero_tails ? 1 : 0) + (attributes.fp8_gradients ? 1 : 0);
  if (count != expected) {
    return Failure{InvalidArgument("expected " + std::to_string(expected) +
                                   " optional operands, got " + std::to_string(count))};
  }
  OptionalInputs inputs;
  size_t index = 0;
  auto next = [&](std::optional<Operand>* slot) -> ffi::Error {
    ffi::ErrorOr<Operand> buffer = get(index++);
    if (!buffer.has_value()) return buffer.error();
    *slot = *buffer;
    return ffi::Error::Success();
  };
  if (attributes.has_bias) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.bias));
  if (attributes.padding) {
    JAX_SDPA_RETURN_IF_ERROR(next(&inputs.q_lengths));
    JAX_SDPA_RETURN_IF_ERROR(next(&inputs.kv_lengths));
  }
  if (attributes.segment_mask || attributes.fallback_ids) {
    JAX_SDPA_RETURN_IF_ERROR(next(&inputs.q_segment_ids));
    JAX_SDPA_RETURN_IF_ERROR(next(&inputs.kv_segment_ids));
  }
  if (attributes.ragged) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.offsets));
  if (attributes.device_grid) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.grid));
  if (attributes.paged) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.page_table));
  if (has_dropout) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.dropout_seed));
  if (attributes.poison_rows) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.poison_rows));
  if (attributes.zero_tails) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.tails));
  if (attributes.fp8_gradients) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.fp8_scales));
  return inputs;
}

ffi::ErrorOr<OptionalInputs> ReadOptionalInputs(const ffi::RemainingArgs& rest,
                                                const CallAttributes& attributes);

// The call's plan from its operands: a paged forward or any other.
ffi::ErrorOr<CallPlan> PlanAnyCall(Direction direction, int32_t device, const Operand& q,
                                   const Operand& k, const Operand& v,
                                   OptionalInputs optional, const CallAttributes& attributes);

// A ragged call's grid chosen on the device (the `grid` operand, copied to the host: int32
// (documents, longest queries, longest keys) per vmapped slice): the plan's config runs the
// first documents of its operands with those bounds, or an error if they exceed the plan's;
// 0 documents in any slice runs the plan's fallback (the ids the table cannot express).
ffi::Error ApplyGrid(const std::vector<int32_t>& grid, CallPlan& plan);

// The output (and its cotangent): the query's shape with the value's head_dim.
std::vector<int64_t> OutputDims(const Operand& q, const SdpaConfig& c);

// Stats: [..., batch, q_heads, q_seq], or token-major [..., batch, q_seq, q_heads] (ragged,
// and a ragged call's fallback).
std::vector<int64_t> StatsDims(const Operand& q, const SdpaConfig& c);

// The buffer has exactly this dtype and these dims, or an error naming it.
ffi::Error CheckShape(const Operand& buffer, ffi::DataType type,
                      const std::vector<int64_t>& expected, const char* name);

std::vector<int64_t> ToVector(ffi::Span<const int64_t> dims);

}  // namespace jax_sdpa
