// The ragged targets: packed documents on cuDNN's ragged layout. Each document is its own batch
// entry at its own element offsets into the rows' [tokens, heads, dim] memory, with its own
// lengths; the stats are token-major. A checked call's grid may come from the device (the grid
// operand, read when the call runs: execution.cc), with the segment ids its dense fallback
// masks; a stated bound's broken rows are poisoned (row_fills.h).
#include <utility>

#include "targets/handler.h"
#include "targets/planners.h"

namespace jax_sdpa {
namespace {

// Completes a ragged call's plan (StartPlan read its query, key and value).
template <typename Attributes>
ffi::Error CompleteRagged(const AttentionShape& shape, const Attributes& attributes,
                          CallPlan& plan) {
  const CallOperands& in = plan.operands;
  SdpaConfig& c = plan.config;
  c.padding = true;
  c.ragged = true;
  const int64_t vmapped = shape.vmapped;
  // Lengths are int32 [documents] per vmapped slice.
  const int64_t entries = static_cast<int64_t>(in.q_lengths->element_count()) / vmapped;
  JAX_SDPA_RETURN_IF_ERROR(CheckLengths(in, vmapped * entries, "documents"));
  const Operand& offsets = *in.offsets;
  int64_t count = static_cast<int64_t>(offsets.element_count());
  plan.offsets_row = count / (5 * vmapped);
  if (offsets.element_type() != ffi::DataType::S32 || count != 5 * vmapped * plan.offsets_row ||
      plan.offsets_row < entries + 1) {
    return Failure{InvalidArgument("ragged offsets must be int32 [5, >= documents + 1], got " +
                                   DimsToString(offsets.dimensions()) + " for " +
                                   std::to_string(entries) + " documents")};
  }
  if (in.grid && (in.grid->element_type() != ffi::DataType::S32 ||
                  static_cast<int64_t>(in.grid->element_count()) != 3 * vmapped)) {
    return Failure{InvalidArgument("a device grid is int32 [3], got " +
                                   DimsToString(in.grid->dimensions()))};
  }
  if (c.dropout > 0) JAX_SDPA_RETURN_IF_ERROR(CheckDropoutSeed(in, vmapped));
  // Documents' offsets count from their slice's start: one graph run per vmapped slice.
  plan.repeats = vmapped;
  if (attributes.fallback_ids) {
    if (!in.grid) {
      return Failure{InvalidArgument("fallback segment ids go with a device grid")};
    }
    JAX_SDPA_RETURN_IF_ERROR(CheckSegmentIds(in, c, vmapped * shape.batch));
    // The rows as one dense call, no lengths: Python sends fallback ids only for rows that
    // are wholly their documents (self-attention without lengths).
    SdpaConfig& dense = plan.fallback.emplace(c);
    dense.batch = shape.batch;
    dense.ragged = false;
    dense.padding = false;
    dense.segment_mask = true;
    dense.stats_token_major = true;
  }
  c.batch = entries;
  c.total_q_tokens = shape.batch * c.q_seq_len;
  c.total_kv_tokens = shape.batch * c.kv_seq_len;
  // A bound on the documents' lengths below the rows' sizes the kernels' grid to the documents
  // rather than to the rows (Python guarantees every document fits).
  const int64_t bound_q = attributes.max_document_length_q;
  const int64_t bound_kv = attributes.max_document_length_kv;
  if (bound_q > c.q_seq_len || bound_kv > c.kv_seq_len || bound_q < 0 || bound_kv < 0) {
    return Failure{InvalidArgument("document length bounds " + std::to_string(bound_q) + ", " +
                                   std::to_string(bound_kv) + " exceed the rows' lengths")};
  }
  if (bound_q > 0) c.q_seq_len = bound_q;
  if (bound_kv > 0) c.kv_seq_len = bound_kv;
  return ffi::Error::Success();
}

}  // namespace

JAX_SDPA_DEFINE_TARGETS(Ragged, RAGGED, CompleteRagged)

}  // namespace jax_sdpa
