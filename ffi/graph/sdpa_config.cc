#include "graph/sdpa_config.h"

#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <tuple>

namespace jax_sdpa {
namespace {

int32_t FloatBits(float value) {
  int32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

int64_t KeyValue(float value) { return FloatBits(value); }
int64_t KeyValue(int64_t value) { return value; }
int64_t KeyValue(bool value) { return value; }
const std::string& KeyValue(const std::string& value) { return value; }

// A field in a key: numbers as integers, strings with their length (no two keys alike).
void WriteKeyField(std::ostringstream& out, const std::string& value) {
  out << value.size() << ':' << value;
}
template <typename Number>
void WriteKeyField(std::ostringstream& out, Number value) {
  out << static_cast<int64_t>(value);
}

size_t HashField(const std::string& value) { return std::hash<std::string>{}(value); }
template <typename Number>
size_t HashField(Number value) {
  return std::hash<int64_t>{}(static_cast<int64_t>(value));
}

// Every field, floats by their bits: two scales that print alike must not share a graph.
auto Fields(const SdpaConfig& c) {
#define JAX_SDPA_KEY_VALUE(type, name, default_value) KeyValue(c.name)
  return std::make_tuple(static_cast<int32_t>(c.direction), c.device,
                         static_cast<int32_t>(c.element_type),
                         static_cast<int32_t>(c.gradient_type), c.batch, c.q_seq_len,
                         c.kv_seq_len, c.q_heads, c.kv_heads, c.head_dim, c.head_dim_v,
                         JAX_SDPA_GRAPH_OPTIONS(JAX_SDPA_KEY_VALUE, JAX_SDPA_COMMA),
                         c.padding, c.ragged, c.segment_mask,
                         c.total_q_tokens, c.total_kv_tokens, c.page_size, c.num_pages,
                         c.bias_batch, c.bias_heads, c.bias_grad, c.stats_token_major);
#undef JAX_SDPA_KEY_VALUE
}

}  // namespace

const char* ElementTypeName(ElementType type) {
  switch (type) {
    case ElementType::kFloat16:
      return "float16";
    case ElementType::kBFloat16:
      return "bfloat16";
    case ElementType::kFloat8E4M3:
      return "float8_e4m3fn";
    case ElementType::kFloat8E5M2:
      return "float8_e5m2";
  }
  return "unknown";
}

bool SdpaConfig::operator==(const SdpaConfig& other) const {
  return Fields(*this) == Fields(other);
}

std::string SdpaConfig::ToString() const {
  std::ostringstream out;
  out << "SdpaConfig{" << (direction == Direction::kForward ? "forward" : "backward")
      << ", device=" << device
      << ", dtype=" << ElementTypeName(element_type);
  if (IsFp8(element_type)) out << ", gradients=" << ElementTypeName(gradient_type);
  out << ", batch=" << batch << ", q_seq_len=" << q_seq_len << ", kv_seq_len=" << kv_seq_len
      << ", q_heads=" << q_heads << ", kv_heads=" << kv_heads << ", head_dim=" << head_dim
      << ", head_dim_v=" << head_dim_v;
#define JAX_SDPA_PRINT(type, name, default_value) \
  if (name != default_value) out << ", " #name "=" << name;
  JAX_SDPA_GRAPH_OPTIONS(JAX_SDPA_PRINT, JAX_SDPA_NOTHING)
#undef JAX_SDPA_PRINT
  if (padding) out << ", padding";
  if (segment_mask) out << ", segment_mask";
  if (ragged) {
    out << ", ragged documents (tokens: " << total_q_tokens << " query, " << total_kv_tokens
        << " key/value)";
  }
  if (page_size > 0) {
    out << ", paged K/V (" << num_pages << " pages of " << page_size << " tokens, "
        << kv_seq_len / page_size << " per sequence)";
  }
  if (bias_batch > 0) {
    out << ", bias=[" << bias_batch << ", " << bias_heads << ", " << q_seq_len << ", "
        << kv_seq_len << "]" << (bias_grad ? " with dbias" : "");
  }
  if (stats_token_major) out << ", stats token-major";
  out << "}";
  return out.str();
}

std::string SdpaConfig::Key() const {
  SdpaConfig any_device = *this;
  any_device.device = 0;
  std::ostringstream out;
  std::apply([&out](const auto&... field) { ((WriteKeyField(out, field), out << ','), ...); },
             Fields(any_device));
  return out.str();
}

size_t SdpaConfigHash::operator()(const SdpaConfig& c) const {
  size_t seed = 0;
  std::apply(
      [&seed](const auto&... field) {
        ((seed ^= HashField(field) + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2)), ...);
      },
      Fields(c));
  return seed;
}

}  // namespace jax_sdpa
