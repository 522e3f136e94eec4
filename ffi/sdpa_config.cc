#include "sdpa_config.h"

#include <cstring>
#include <functional>
#include <sstream>

namespace jax_sdpa {
namespace {

int32_t ScaleBits(float scale) {
  int32_t bits;
  std::memcpy(&bits, &scale, sizeof(bits));
  return bits;
}

}  // namespace

bool SdpaConfig::operator==(const SdpaConfig& other) const {
  // The scale is compared bitwise: two scales that print alike but differ must not share a graph.
  return direction == other.direction && device == other.device &&
         element_type == other.element_type && batch == other.batch &&
         q_seq_len == other.q_seq_len && kv_seq_len == other.kv_seq_len &&
         q_heads == other.q_heads && kv_heads == other.kv_heads && head_dim == other.head_dim &&
         ScaleBits(scale) == ScaleBits(other.scale) && causal == other.causal;
}

std::string SdpaConfig::ToString() const {
  std::ostringstream out;
  out << "SdpaConfig{" << (direction == Direction::kForward ? "forward" : "backward")
      << ", device=" << device
      << ", dtype=" << (element_type == ElementType::kFloat16 ? "float16" : "bfloat16")
      << ", batch=" << batch << ", q_seq_len=" << q_seq_len << ", kv_seq_len=" << kv_seq_len
      << ", q_heads=" << q_heads << ", kv_heads=" << kv_heads << ", head_dim=" << head_dim
      << ", scale=" << scale << ", causal=" << (causal ? "true" : "false") << "}";
  return out.str();
}

size_t SdpaConfigHash::operator()(const SdpaConfig& c) const {
  size_t seed = 0;
  auto mix = [&seed](int64_t value) {
    seed ^= std::hash<int64_t>{}(value) + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2);
  };
  mix(static_cast<int64_t>(c.direction));
  mix(c.device);
  mix(static_cast<int64_t>(c.element_type));
  mix(c.batch);
  mix(c.q_seq_len);
  mix(c.kv_seq_len);
  mix(c.q_heads);
  mix(c.kv_heads);
  mix(c.head_dim);
  mix(ScaleBits(c.scale));
  mix(c.causal);
  return seed;
}

}  // namespace jax_sdpa
