#include "call/call_plan.h"

#include <algorithm>
#include <utility>

namespace jax_sdpa {

std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
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

ffi::ErrorOr<AttentionShape> ReadAttentionShape(Direction direction, int32_t device,
                                                const CallOperands& operands, SdpaConfig& c) {
  const Operand& q = *operands.query;
  const Operand& k = *operands.key;
  const Operand& v = *operands.value;
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  AttentionShape shape;
  shape.rank = qd.size();
  size_t rank = shape.rank;
  if (rank < 4 || kd.size() != rank || vd.size() != rank) {
    return Failure{InvalidArgument("query, key and value must share one rank >= 4, got " +
                                   DimsToString(qd) + ", " + DimsToString(kd) + ", " +
                                   DimsToString(vd))};
  }
  for (size_t i = 0; i + 4 < rank; ++i) {
    if (qd[i] != kd[i]) return Failure{InvalidArgument("query and key leading axes differ")};
    shape.vmapped *= qd[i];
  }
  shape.batch = qd[rank - 4];
  c.direction = direction;
  c.device = device;
  JAX_SDPA_ASSIGN_OR_RETURN(c.element_type, ReadElementType(q, "query"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType k_type, ReadElementType(k, "key"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType v_type, ReadElementType(v, "value"));
  c.gradient_type = c.element_type;
  bool same_kv = true;  // key and value agree on every axis but head_dim
  for (size_t i = 0; i + 1 < rank; ++i) same_kv &= kd[i] == vd[i];
  if (k_type != c.element_type || v_type != c.element_type || !same_kv ||
      kd[rank - 4] != shape.batch || kd[rank - 1] != qd[rank - 1] || kd[rank - 2] == 0 ||
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
  return shape;
}

ffi::Error CheckLengths(const CallOperands& operands, int64_t count, const char* entries) {
  for (const Operand* lengths : {&*operands.q_lengths, &*operands.kv_lengths}) {
    if (lengths->element_type() != ffi::DataType::S32 ||
        static_cast<int64_t>(lengths->element_count()) != count || count == 0) {
      return InvalidArgument(std::string("sequence lengths must be int32 [") + entries +
                             "], got " + DimsToString(lengths->dimensions()));
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckSegmentIds(const CallOperands& operands, const SdpaConfig& c, int64_t rows) {
  for (auto [ids, seq_len] : {std::pair{&*operands.q_segment_ids, c.q_seq_len},
                              std::pair{&*operands.kv_segment_ids, c.kv_seq_len}}) {
    if (ids->element_type() != ffi::DataType::S32 ||
        static_cast<int64_t>(ids->element_count()) != rows * seq_len) {
      return InvalidArgument("segment ids must be int32 [batch, seq] (" + std::to_string(rows) +
                             " rows of " + std::to_string(seq_len) + "), got " +
                             DimsToString(ids->dimensions()));
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckScoreModTables(const CallOperands& operands, const SdpaConfig& c, int64_t rows) {
  if (c.score_mod_tables == 0) return ffi::Error::Success();
  if (c.score_mod_tables < 0 || c.score_mod_tables > kMaxScoreModTables) {
    return InvalidArgument("a score modifier reads at most " +
                           std::to_string(kMaxScoreModTables) + " tables, got " +
                           std::to_string(c.score_mod_tables));
  }
  const std::optional<Operand>& tables = operands.score_mod_tables;
  if (!tables || tables->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(tables->element_count()) != rows * c.score_mod_tables * c.q_heads) {
    return InvalidArgument("score_mod tables must be float32 [batch, " +
                           std::to_string(c.score_mod_tables) + ", heads] (" +
                           std::to_string(rows) + " rows of " + std::to_string(c.q_heads) +
                           " heads)" + (tables ? ", got " + DimsToString(tables->dimensions())
                                               : std::string(", got none")));
  }
  return ffi::Error::Success();
}

ffi::Error CheckDropoutSeed(const CallOperands& operands, int64_t vmapped) {
  const Operand& seed = *operands.dropout_seed;
  if (seed.element_type() != ffi::DataType::U32 ||
      static_cast<int64_t>(seed.element_count()) != vmapped * 4) {
    return InvalidArgument("the dropout seed must be uint32 [4], got " +
                           DimsToString(seed.dimensions()));
  }
  return ffi::Error::Success();
}

ffi::Error CheckShape(const Operand& buffer, ffi::DataType type,
                      const std::vector<int64_t>& expected, const char* name) {
  auto dims = buffer.dimensions();
  bool same = buffer.element_type() == type && dims.size() == expected.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] == expected[i];
  if (!same) {
    return InvalidArgument(std::string(name) + " must be " +
                           DimsToString({expected.data(), expected.size()}) +
                           " of the expected dtype, got " + DimsToString(dims));
  }
  return ffi::Error::Success();
}

std::vector<int64_t> ToVector(ffi::Span<const int64_t> dims) {
  return std::vector<int64_t>(dims.begin(), dims.end());
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
      return InvalidArgument("a device grid of 0 documents needs the fallback's ids");
    }
    c = *plan.fallback;
    return ffi::Error::Success();
  }
  if (entries < 1 || entries > c.batch || queries < 1 || queries > c.q_seq_len || keys < 1 ||
      keys > c.kv_seq_len) {
    return InvalidArgument(
        "the device grid (" + std::to_string(entries) + " documents of up to " +
        std::to_string(queries) + ", " + std::to_string(keys) + " tokens) does not fit " +
        std::to_string(c.batch) + " documents of up to " + std::to_string(c.q_seq_len) + ", " +
        std::to_string(c.kv_seq_len));
  }
  c.batch = entries;
  c.q_seq_len = queries;
  c.kv_seq_len = keys;
  return ffi::Error::Success();
}

}  // namespace jax_sdpa
