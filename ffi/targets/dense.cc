// The dense targets: attention over [..., batch, seq, heads, dim] rows, with a bias, sequence
// lengths, segment ids masked inside cuDNN's kernel, dropout, soft-capping, a score modifier
// (with its tables) and a diagonal band.
#include <utility>

#include "targets/handler.h"
#include "targets/planners.h"

namespace jax_sdpa {
namespace {

bool BiasGradient(const DenseForwardAttributes&) { return false; }
bool BiasGradient(const DenseBackwardAttributes& attributes) { return attributes.bias_grad; }

// Completes a dense call's plan (StartPlan read its query, key and value).
template <typename Attributes>
ffi::Error CompleteDense(const AttentionShape& shape, const Attributes& attributes,
                         CallPlan& plan) {
  const CallOperands& in = plan.operands;
  SdpaConfig& c = plan.config;
  c.padding = attributes.padding;
  c.segment_mask = attributes.segment_mask;
  const int64_t rows = shape.vmapped * shape.batch;
  if (c.padding) JAX_SDPA_RETURN_IF_ERROR(CheckLengths(in, rows, "batch"));
  if (c.segment_mask) JAX_SDPA_RETURN_IF_ERROR(CheckSegmentIds(in, c, rows));
  if (c.dropout > 0) JAX_SDPA_RETURN_IF_ERROR(CheckDropoutSeed(in, shape.vmapped));
  JAX_SDPA_RETURN_IF_ERROR(CheckScoreModTables(in, c, rows));
  // The graph runs once per vmapped slice when a slice's operands cannot be folded into one
  // batch: a bias shared by the slice's batch (no single batch stride says that), a dropout
  // seed per slice, or score_mod tables (cuDNN reads a batch's first row: score_mod.h).
  const size_t rank = shape.rank;
  bool shared_bias = in.bias && in.bias->dimensions()[rank - 4] == 1 && shape.batch > 1;
  bool per_slice = shape.vmapped > 1 && (shared_bias || c.dropout > 0 || c.score_mod_tables > 0);
  plan.repeats = per_slice ? shape.vmapped : 1;
  c.batch = per_slice ? shape.batch : rows;
  if (in.bias) {
    auto bd = in.bias->dimensions();
    auto qd = in.query->dimensions();
    JAX_SDPA_ASSIGN_OR_RETURN(ElementType bias_type, ReadElementType(*in.bias, "bias"));
    int64_t bias_vmapped = 1;
    for (size_t i = 0; bd.size() == rank && i + 4 < rank; ++i) bias_vmapped *= bd[i];
    if (bd.size() != rank || bias_type != c.element_type || bias_vmapped != shape.vmapped ||
        (bd[rank - 4] != 1 && bd[rank - 4] != shape.batch) ||
        (bd[rank - 3] != 1 && bd[rank - 3] != c.q_heads) || bd[rank - 2] != c.q_seq_len ||
        bd[rank - 1] != c.kv_seq_len) {
      return Failure{InvalidArgument("bias " + DimsToString(bd) +
                                     " must be [1|batch, 1|heads, q_seq, kv_seq] in the inputs' "
                                     "dtype, for query " + DimsToString(qd))};
    }
    c.bias_heads = bd[rank - 3];
    c.bias_batch = per_slice ? bd[rank - 4] : bd[rank - 4] * shape.vmapped;
    c.bias_grad = BiasGradient(attributes);
  }
  return ffi::Error::Success();
}

}  // namespace

JAX_SDPA_DEFINE_TARGETS(Dense, DENSE, CompleteDense)

}  // namespace jax_sdpa
