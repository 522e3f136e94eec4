// The paged target: decoding and chunked prefill over a paged K/V cache, forward only. Keys and
// values live in a pool of pages [pages, page_size, K, H|Hv]; an int32 [B, pages per sequence]
// table lists each sequence's pages in order, and cuDNN reads them in place, its padding mask
// and bottom-right band measured from each sequence's lengths.
#include <utility>

#include "targets/handler.h"
#include "targets/planners.h"

namespace jax_sdpa {

// Not the dense layout: the keys and values are page pools, read through the table.
ffi::ErrorOr<CallPlan> Plan(int32_t device, CallOperands operands,
                            const PagedForwardAttributes& attributes) {
  CallPlan plan;
  plan.operands = std::move(operands);
  const CallOperands& in = plan.operands;
  auto qd = in.query->dimensions();
  auto kd = in.key->dimensions();
  auto vd = in.value->dimensions();
  const Operand& table = *in.page_table;
  auto td = table.dimensions();
  SdpaConfig& c = plan.config;
  TargetTraits<PagedForwardAttributes>::CopyGraphOptions(attributes, c);
  c.direction = Direction::kForward;
  c.device = device;
  JAX_SDPA_ASSIGN_OR_RETURN(c.element_type, ReadElementType(*in.query, "query"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType k_type, ReadElementType(*in.key, "key pages"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType v_type, ReadElementType(*in.value, "value pages"));
  c.gradient_type = c.element_type;
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 ||
      k_type != c.element_type || v_type != c.element_type || IsFp8(c.element_type) ||
      kd[0] != vd[0] || kd[1] != vd[1] || kd[2] != vd[2] || kd[3] != qd[3] || kd[2] == 0 ||
      qd[2] % kd[2] != 0 || td[0] != qd[0] || table.element_type() != ffi::DataType::S32) {
    return Failure{InvalidArgument("query " + DimsToString(qd) + ", key pages " +
                                   DimsToString(kd) + ", value pages " + DimsToString(vd) +
                                   " and page table " + DimsToString(td) +
                                   " do not form one paged attention problem")};
  }
  c.batch = qd[0];
  c.q_seq_len = qd[1];
  c.q_heads = qd[2];
  c.head_dim = qd[3];
  c.num_pages = kd[0];
  c.page_size = kd[1];
  c.kv_heads = kd[2];
  c.head_dim_v = vd[3];
  c.kv_seq_len = td[1] * c.page_size;
  c.padding = true;
  JAX_SDPA_RETURN_IF_ERROR(CheckLengths(in, c.batch, "batch"));
  // cuDNN leaves the rows before a sequence's first key unwritten (Python fills them).
  plan.zero_outputs = true;
  return plan;
}

JAX_SDPA_DEFINE_HANDLER(PagedForward, PAGED_FORWARD)

}  // namespace jax_sdpa
