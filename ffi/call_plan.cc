#include "call_plan.h"

#include <algorithm>
#include <utility>

namespace jax_sdpa {
namespace {

std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

std::string DimsToString(const std::vector<int64_t>& dims) {
  return DimsToString(ffi::Span<const int64_t>(dims.data(), dims.size()));
}

// The graph's attributes, under the names SdpaConfig shares with them (attribute_list.h).
void CopyGraphAttributes(const CallAttributes& attributes, SdpaConfig& c) {
#define JAX_SDPA_COPY(type, name, default_value) c.name = attributes.name;
  JAX_SDPA_GRAPH_ATTRIBUTES(JAX_SDPA_COPY, JAX_SDPA_NOTHING)
#undef JAX_SDPA_COPY
}

ffi::ErrorOr<ElementType> ReadElementType(const Operand& buffer, const char* name) {
  switch (buffer.element_type()) {
    case ffi::DataType::F16:
      return ElementType::kFloat16;
    case ffi::DataType::BF16:
      return ElementType::kBFloat16;
    case ffi::DataType::F8E4M3FN:
      return ElementType::kFloat8E4M3;
    case ffi::DataType::F8E5M2:
      return ElementType::kFloat8E5M2;
    default:
      return Failure{InvalidArgument(std::string(name) +
                                     " must be float16, bfloat16 or (FP8) float8_e4m3fn")};
  }
}

// An FP8 call: e4m3 operands, its backward's format, float32 scales per vmapped slice, and
// only the causal mask and sequence lengths (what cuDNN's FP8 graphs take here).
ffi::Error CheckFp8Call(Direction direction, const SdpaConfig& c, const OptionalInputs& optional,
                        int64_t vmapped) {
  if (c.element_type != ElementType::kFloat8E4M3 || !IsFp8(c.gradient_type)) {
    return InvalidArgument("an FP8 call takes float8_e4m3fn operands and an FP8 gradient format");
  }
  bool causal_only = c.window_left < 0 && (c.window_right < 0 || c.window_right == 0) &&
                     !c.bottom_right;
  if (!causal_only || c.logits_soft_cap > 0 || c.ragged || c.dropout > 0 || optional.bias ||
      c.page_size > 0 || c.segment_mask) {
    return InvalidArgument("an FP8 call takes no window but causal (top-left), soft-cap, bias, "
                           "dropout, segment ids, packed documents or paging: " + c.ToString());
  }
  const Operand& scales = *optional.fp8_scales;
  int64_t expected = vmapped * Fp8ScaleCount(direction) * kFp8ScaleRow;
  if (scales.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(scales.element_count()) != expected) {
    return InvalidArgument("FP8 scales must be float32 [" +
                           std::to_string(Fp8ScaleCount(direction)) + ", " +
                           std::to_string(kFp8ScaleRow) + "] per call, got " +
                           DimsToString(scales.dimensions()));
  }
  return ffi::Error::Success();
}

// Reads the operands into a graph config; every shape is checked here, before cuDNN sees it.
ffi::ErrorOr<CallPlan> PlanCall(Direction direction, int32_t device, const Operand& q,
                                const Operand& k, const Operand& v,
                                OptionalInputs optional_inputs, const CallAttributes& attributes) {
  CallPlan plan;
  plan.optional = std::move(optional_inputs);
  const OptionalInputs& optional = plan.optional;
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  size_t rank = qd.size();
  if (rank < 4 || kd.size() != rank || vd.size() != rank) {
    return Failure{InvalidArgument("query, key and value must share one rank >= 4, got " +
                                   DimsToString(qd) + ", " + DimsToString(kd) + ", " +
                                   DimsToString(vd))};
  }
  int64_t vmapped = 1;  // product of the leading (vmap) axes
  for (size_t i = 0; i + 4 < rank; ++i) {
    if (qd[i] != kd[i]) return Failure{InvalidArgument("query and key leading axes differ")};
    vmapped *= qd[i];
  }
  int64_t batch = qd[rank - 4];
  SdpaConfig& c = plan.config;
  c.direction = direction;
  c.device = device;
  JAX_SDPA_ASSIGN_OR_RETURN(c.element_type, ReadElementType(q, "query"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType k_type, ReadElementType(k, "key"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType v_type, ReadElementType(v, "value"));
  bool same_kv = true;  // key and value agree on every axis but head_dim
  for (size_t i = 0; i + 1 < rank; ++i) same_kv &= kd[i] == vd[i];
  if (k_type != c.element_type || v_type != c.element_type || !same_kv ||
      kd[rank - 4] != batch || kd[rank - 1] != qd[rank - 1] || kd[rank - 2] == 0 ||
      qd[rank - 2] % kd[rank - 2] != 0) {
    return Failure{InvalidArgument("query " + DimsToString(qd) + ", key " + DimsToString(kd) +
                                   " and value " + DimsToString(vd) +
                                   " do not form one attention problem")};
  }
  c.q_seq_len = qd[rank - 3];
  c.kv_seq_len = kd[rank - 3];
  c.q_heads = qd[rank - 2];
  c.kv_heads = kd[rank - 2];
  c.head_dim = qd[rank - 1];
  c.head_dim_v = vd[rank - 1];
  CopyGraphAttributes(attributes, c);
  // A forward graph is one graph whatever its backward's algorithm.
  c.deterministic = direction == Direction::kBackward && attributes.deterministic;
  c.gradient_type = attributes.fp8_gradients
                        ? static_cast<ElementType>(attributes.fp8_gradients)
                        : c.element_type;
  if (IsFp8(c.element_type) != (attributes.fp8_gradients != 0)) {
    return Failure{InvalidArgument("FP8 operands go with the fp8_gradients attribute, and only "
                                   "they do")};
  }
  if (attributes.fp8_gradients) {
    JAX_SDPA_RETURN_IF_ERROR(CheckFp8Call(direction, c, optional, vmapped));
  }
  if (c.ragged && !c.padding) {
    return Failure{InvalidArgument("the ragged layout needs per-document lengths")};
  }
  // Lengths are int32 [batch], or [documents] in the ragged layout, per vmapped slice.
  int64_t entries = batch;
  if (c.padding) {
    int64_t count = static_cast<int64_t>(optional.q_lengths->element_count());
    if (c.ragged) entries = count / vmapped;
    for (const Operand* lengths : {&*optional.q_lengths, &*optional.kv_lengths}) {
      if (lengths->element_type() != ffi::DataType::S32 ||
          static_cast<int64_t>(lengths->element_count()) != vmapped * entries || entries == 0) {
        return Failure{InvalidArgument(std::string("sequence lengths must be int32 [") +
                                       (c.ragged ? "documents" : "batch") + "], got " +
                                       DimsToString(lengths->dimensions()))};
      }
    }
  }
  if (c.segment_mask || attributes.fallback_ids) {
    bool dense_mask = c.segment_mask && !c.ragged && c.page_size == 0;
    bool ragged_fallback = attributes.fallback_ids && !c.segment_mask && c.ragged &&
                           optional.grid.has_value();
    if (!dense_mask && !ragged_fallback) {
      return Failure{InvalidArgument("segment ids mask a dense call, or a ragged call's "
                                     "fallback on a device grid")};
    }
    for (auto [ids, seq_len] : {std::pair{&*optional.q_segment_ids, c.q_seq_len},
                                std::pair{&*optional.kv_segment_ids, c.kv_seq_len}}) {
      if (ids->element_type() != ffi::DataType::S32 ||
          static_cast<int64_t>(ids->element_count()) != vmapped * batch * seq_len) {
        return Failure{InvalidArgument("segment ids must be int32 [batch, seq] (" +
                                       std::to_string(batch) + ", " + std::to_string(seq_len) +
                                       "), got " + DimsToString(ids->dimensions()))};
      }
    }
  }
  if (c.ragged) {
    const Operand& offsets = *optional.offsets;
    int64_t count = static_cast<int64_t>(offsets.element_count());
    plan.offsets_row = count / (5 * vmapped);
    if (offsets.element_type() != ffi::DataType::S32 || count != 5 * vmapped * plan.offsets_row ||
        plan.offsets_row < entries + 1) {
      return Failure{InvalidArgument("ragged offsets must be int32 [5, >= documents + 1], got " +
                                     DimsToString(offsets.dimensions()) + " for " +
                                     std::to_string(entries) + " documents")};
    }
  }
  if (optional.grid) {
    const Operand& grid = *optional.grid;
    if (!c.ragged || grid.element_type() != ffi::DataType::S32 ||
        static_cast<int64_t>(grid.element_count()) != 3 * vmapped) {
      return Failure{InvalidArgument("a device grid goes with the ragged layout as int32 [3], "
                                     "got " + DimsToString(grid.dimensions()))};
    }
  }
  if (c.dropout > 0) {
    const Operand& seed = *optional.dropout_seed;
    if (seed.element_type() != ffi::DataType::U32 ||
        static_cast<int64_t>(seed.element_count()) != vmapped * 4) {
      return Failure{InvalidArgument("the dropout seed must be uint32 [4], got " +
                                     DimsToString(seed.dimensions()))};
    }
  }
  // The graph runs once per vmapped slice when a slice's operands cannot be folded into one
  // batch: a bias shared by the slice's batch (no single batch stride says that), a dropout
  // seed per slice, or documents whose offsets count from their slice's start.
  bool shared_bias = optional.bias && optional.bias->dimensions()[rank - 4] == 1 && batch > 1;
  bool per_slice = vmapped > 1 && (shared_bias || c.dropout > 0 || c.ragged ||
                                    attributes.fp8_gradients != 0);
  plan.repeats = per_slice ? vmapped : 1;
  int64_t folded_batch = per_slice ? batch : vmapped * batch;
  if (attributes.fallback_ids) {
    // The rows as one dense call, no lengths: Python sends fallback ids only for rows that
    // are wholly their documents (self-attention without lengths).
    SdpaConfig& dense = plan.fallback.emplace(c);
    dense.batch = folded_batch;
    dense.ragged = false;
    dense.padding = false;
    dense.segment_mask = true;
    dense.stats_token_major = true;
  }
  if (c.ragged) {
    c.batch = entries;
    c.total_q_tokens = folded_batch * c.q_seq_len;
    c.total_kv_tokens = folded_batch * c.kv_seq_len;
    // A bound on the documents' lengths below the rows' sizes the kernels' grid to the
    // documents rather than to the rows (Python guarantees every document fits).
    const int64_t bound_q = attributes.max_document_length_q;
    const int64_t bound_kv = attributes.max_document_length_kv;
    if (bound_q > c.q_seq_len || bound_kv > c.kv_seq_len || bound_q < 0 || bound_kv < 0) {
      return Failure{InvalidArgument("document length bounds " +
                                     std::to_string(bound_q) + ", " + std::to_string(bound_kv) +
                                     " exceed the rows' lengths")};
    }
    if (bound_q > 0) c.q_seq_len = bound_q;
    if (bound_kv > 0) c.kv_seq_len = bound_kv;
  } else {
    c.batch = folded_batch;
  }
  if (optional.bias) {
    if (c.ragged) return Failure{InvalidArgument("a bias cannot go with the ragged layout")};
    auto bd = optional.bias->dimensions();
    JAX_SDPA_ASSIGN_OR_RETURN(ElementType bias_type, ReadElementType(*optional.bias, "bias"));
    int64_t bias_vmapped = 1;
    for (size_t i = 0; bd.size() == rank && i + 4 < rank; ++i) bias_vmapped *= bd[i];
    if (bd.size() != rank || bias_type != c.element_type || bias_vmapped != vmapped ||
        (bd[rank - 4] != 1 && bd[rank - 4] != batch) ||
        (bd[rank - 3] != 1 && bd[rank - 3] != c.q_heads) || bd[rank - 2] != c.q_seq_len ||
        bd[rank - 1] != c.kv_seq_len) {
      return Failure{InvalidArgument("bias " + DimsToString(bd) +
                                     " must be [1|batch, 1|heads, q_seq, kv_seq] in the inputs' "
                                     "dtype, for query " + DimsToString(qd))};
    }
    c.bias_heads = bd[rank - 3];
    c.bias_batch = per_slice ? bd[rank - 4] : bd[rank - 4] * vmapped;
    c.bias_grad = direction == Direction::kBackward && attributes.bias_grad;
  }
  return plan;
}

// A paged forward: q [B, T, N, H]; key and value page pools [pages, page_size, K, H|Hv];
// int32 [B] lengths (queries, keys) and page table [B, pages per sequence]. No bias, dropout,
// ragged layout or vmapped axes (Python sends none).
ffi::ErrorOr<CallPlan> PlanPagedCall(int32_t device, const Operand& q,
                                     const Operand& k, const Operand& v,
                                     OptionalInputs optional, const CallAttributes& attributes) {
  CallPlan plan;
  plan.optional = std::move(optional);
  if (!attributes.padding || attributes.ragged || attributes.has_bias ||
      attributes.dropout > 0 || attributes.segment_mask) {
    return Failure{InvalidArgument("a paged call takes lengths and a page table, and no bias, "
                                   "dropout, segment ids or ragged layout")};
  }
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  const Operand& table = *plan.optional.page_table;
  auto td = table.dimensions();
  SdpaConfig& c = plan.config;
  c.direction = Direction::kForward;
  c.device = device;
  JAX_SDPA_ASSIGN_OR_RETURN(c.element_type, ReadElementType(q, "query"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType k_type, ReadElementType(k, "key cache"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType v_type, ReadElementType(v, "value cache"));
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 ||
      k_type != c.element_type || v_type != c.element_type || kd[0] != vd[0] ||
      kd[1] != vd[1] || kd[2] != vd[2] || kd[3] != qd[3] || kd[2] == 0 || qd[2] % kd[2] != 0 ||
      td[0] != qd[0] || table.element_type() != ffi::DataType::S32) {
    return Failure{InvalidArgument("query " + DimsToString(qd) + ", key cache " +
                                   DimsToString(kd) + ", value cache " + DimsToString(vd) +
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
  for (const Operand* lengths : {&*plan.optional.q_lengths, &*plan.optional.kv_lengths}) {
    if (lengths->element_type() != ffi::DataType::S32 ||
        static_cast<int64_t>(lengths->element_count()) != c.batch) {
      return Failure{InvalidArgument("sequence lengths must be int32 [batch], got " +
                                     DimsToString(lengths->dimensions()))};
    }
  }
  CopyGraphAttributes(attributes, c);
  c.deterministic = false;  // a forward
  c.padding = true;
  return plan;
}

}  // namespace

ffi::Error CheckShape(const Operand& buffer, ffi::DataType type,
                      const std::vector<int64_t>& expected, const char* name) {
  auto dims = buffer.dimensions();
  bool same = buffer.element_type() == type && dims.size() == expected.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] == expected[i];
  if (!same) {
    return InvalidArgument(std::string(name) + " must be " + DimsToString(expected) + " of " +
                           "the expected dtype, got " + DimsToString(dims));
  }
  return ffi::Error::Success();
}

std::vector<int64_t> ToVector(ffi::Span<const int64_t> dims) {
  return std::vector<int64_t>(dims.begin(), dims.end());
}

ffi::ErrorOr<OptionalInputs> ReadOptionalInputs(const ffi::RemainingArgs& rest,
                                                const CallAttributes& attributes) {
  return ReadOptionalInputs(
      rest.size(),
      [&](size_t i) -> ffi::ErrorOr<Operand> {
        ffi::ErrorOr<ffi::AnyBuffer> buffer = rest.get<ffi::AnyBuffer>(i);
        if (!buffer.has_value()) return Failure{buffer.error()};
        return Operand(*buffer);
      },
      attributes);
}

ffi::ErrorOr<CallPlan> PlanAnyCall(Direction direction, int32_t device, const Operand& q,
                                   const Operand& k, const Operand& v,
                                   OptionalInputs optional, const CallAttributes& attributes) {
  if (attributes.paged) {
    if (attributes.fp8_gradients) return Failure{InvalidArgument("a paged call is not FP8")};
    if (direction == Direction::kBackward) {
      return Failure{InvalidArgument("paged attention has no backward")};
    }
    return PlanPagedCall(device, q, k, v, std::move(optional), attributes);
  }
  return PlanCall(direction, device, q, k, v, std::move(optional), attributes);
}

std::vector<int64_t> OutputDims(const Operand& q, const SdpaConfig& c) {
  std::vector<int64_t> dims = ToVector(q.dimensions());
  dims.back() = c.head_dim_v;
  return dims;
}

std::vector<int64_t> StatsDims(const Operand& q, const SdpaConfig& c) {
  std::vector<int64_t> dims = ToVector(q.dimensions());
  size_t rank = dims.size();
  int64_t seq = dims[rank - 3], heads = dims[rank - 2];
  dims.pop_back();
  bool token_major = c.ragged || c.stats_token_major;
  dims[rank - 3] = token_major ? seq : heads;
  dims[rank - 2] = token_major ? heads : seq;
  return dims;
}

ffi::Error ApplyGrid(const std::vector<int32_t>& grid, CallPlan& plan) {
  SdpaConfig& c = plan.config;
  int32_t entries = 0, queries = 0, keys = 0;
  bool fallback = false;
  for (size_t i = 0; i + 2 < grid.size(); i += 3) {  // vmapped slices: a grid every one fits
    fallback |= grid[i] == 0;
    entries = std::max(entries, grid[i]);
    queries = std::max(queries, grid[i + 1]);
    keys = std::max(keys, grid[i + 2]);
  }
  if (fallback) {
    if (!plan.fallback) {
      return Failure{InvalidArgument("a device grid of 0 documents needs the fallback's ids")};
    }
    c = *plan.fallback;
    return ffi::Error::Success();
  }
  if (entries < 1 || entries > c.batch || queries < 1 || queries > c.q_seq_len || keys < 1 ||
      keys > c.kv_seq_len) {
    return Failure{InvalidArgument(
        "the device grid (" + std::to_string(entries) + " documents of up to " +
        std::to_string(queries) + ", " + std::to_string(keys) + " tokens) does not fit " +
        std::to_string(c.batch) + " documents of up to " + std::to_string(c.q_seq_len) + ", " +
        std::to_string(c.kv_seq_len))};
  }
  c.batch = entries;
  c.q_seq_len = queries;
  c.kv_seq_len = keys;
  return ffi::Error::Success();
}

}  // namespace jax_sdpa
