// What one call runs, from its operands and attributes: the graph config (SdpaConfig, the graph
// cache's key) and how the handler runs it (repeats over vmapped slices, the fills around it).
// Each target's planner (planners.h) makes one with the checks here, before cuDNN sees
// anything; the handlers and the trace-time workspace planner share the planners.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/operand.h"
#include "graph/sdpa_config.h"
#include "call/target.h"

namespace jax_sdpa {

struct CallPlan {
  SdpaConfig config;
  // The graph runs `repeats` times, each time on the next 1/repeats of every operand.
  int64_t repeats = 1;
  int64_t offsets_row = 0;  // ragged: elements per row of the offsets operand
  CallOperands operands;
  // Zeros where cuDNN leaves elements unwritten: every output before it runs; or, with the
  // int32 [rows, 2] tails operand, the tokens past each row's lengths after it ran. Either way
  // the small outputs (stats, dbias) are zero-filled first.
  bool zero_outputs = false;
  bool zero_tails = false;
  // A ragged call with fallback ids: the dense call over its rows masking the segment ids
  // (stats token-major, as the ragged layout's), which a device grid of 0 documents runs.
  std::optional<SdpaConfig> fallback;
};

// A ragged call's grid chosen on the device (the int32 [3] grid operand per vmapped slice,
// copied to the host: documents, longest queries, longest keys): the plan's config runs the
// first documents of its operands with those bounds, or an error if they exceed the plan's;
// 0 documents in any slice runs the plan's fallback (the ids the table cannot express).
ffi::Error ApplyGrid(const std::vector<int32_t>& grid, CallPlan& plan);

// The query, key and value of a call in the [..., batch, seq, heads, dim] layout: leading
// (vmapped) axes they share, then one attention problem per slice. Sets the config's direction,
// device, element type, sequence lengths, heads and head dims; `batch` stays the caller's.
struct AttentionShape {
  int64_t vmapped = 1;  // product of the leading axes
  int64_t batch = 0;    // per slice
  size_t rank = 0;
};
ffi::ErrorOr<AttentionShape> ReadAttentionShape(Direction direction, int32_t device,
                                                const CallOperands& operands, SdpaConfig& c);

// The start of a dense-layout target's plan: its operands kept, its graph options and zero
// fills copied, its query, key and value read (in its direction; FP8 operands go to the FP8
// targets alone).
template <typename Attributes>
ffi::ErrorOr<AttentionShape> StartPlan(CallPlan& plan, int32_t device, CallOperands operands,
                                       const Attributes& attributes) {
  plan.operands = std::move(operands);
  TargetTraits<Attributes>::CopyGraphOptions(attributes, plan.config);
  TargetTraits<Attributes>::ReadZeroFills(attributes, plan.zero_outputs, plan.zero_tails);
  JAX_SDPA_ASSIGN_OR_RETURN(
      AttentionShape shape, ReadAttentionShape(TargetTraits<Attributes>::kDirection, device,
                                               plan.operands, plan.config));
  if (!TargetTraits<Attributes>::kFp8 && IsFp8(plan.config.element_type)) {
    return Failure{InvalidArgument("FP8 operands go to the FP8 targets")};
  }
  return shape;
}

// float16, bfloat16 or float8 (e4m3, e5m2) as the graph's element type, or an error naming the
// operand.
ffi::ErrorOr<ElementType> ReadElementType(const Operand& buffer, const char* name);

// Lengths are int32 [entries] per vmapped slice (entries: the batch, or the ragged layout's
// documents).
ffi::Error CheckLengths(const CallOperands& operands, int64_t count, const char* entries);
// Segment ids are int32 [batch, seq] per vmapped slice, of the queries and of the keys.
ffi::Error CheckSegmentIds(const CallOperands& operands, const SdpaConfig& c, int64_t elements);
// A score modifier's tables are float32 [batch, score_mod_tables, q_heads] (at most
// kMaxScoreModTables of them), present exactly when the config reads some.
ffi::Error CheckScoreModTables(const CallOperands& operands, const SdpaConfig& c, int64_t rows);
// The dropout seed is uint32 [4] per vmapped slice (Philox seed, then offset, as two int64).
ffi::Error CheckDropoutSeed(const CallOperands& operands, int64_t vmapped);

// The output (and its cotangent): the query's shape with the value's head_dim.
std::vector<int64_t> OutputDims(const Operand& q, const SdpaConfig& c);
// Stats: [..., batch, q_heads, q_seq], or token-major [..., batch, q_seq, q_heads] (ragged,
// and a ragged call's fallback).
std::vector<int64_t> StatsDims(const Operand& q, const SdpaConfig& c);

// The buffer has exactly this dtype and these dims, or an error naming it.
ffi::Error CheckShape(const Operand& buffer, ffi::DataType type,
                      const std::vector<int64_t>& expected, const char* name);

std::vector<int64_t> ToVector(ffi::Span<const int64_t> dims);
std::string DimsToString(ffi::Span<const int64_t> dims);

}  // namespace jax_sdpa
