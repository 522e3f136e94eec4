#include "sdpa_config.h"

#include <cstring>
#include <functional>
#include <sstream>
#include <tuple>

namespace jax_sdpa {
namespace {

int32_t ScaleBits(float scale) {
  int32_t bits;
  std::memcpy(&bits, &scale, sizeof(bits));
  return bits;
}

// Every field, the scale by its bits: two scales that print alike must not share a graph.
auto Fields(const SdpaConfig& c) {
  return std::make_tuple(static_cast<int32_t>(c.direction), c.device,
                         static_cast<int32_t>(c.element_type), c.batch, c.q_seq_len,
                         c.kv_seq_len, c.q_heads, c.kv_heads, c.head_dim, ScaleBits(c.scale),
                         c.window_left, c.window_right, c.padding, c.bias_batch, c.bias_heads,
                         c.bias_grad, c.deterministic);
}

}  // namespace

bool SdpaConfig::operator==(const SdpaConfig& other) const {
  return Fields(*this) == Fields(other);
}

std::string SdpaConfig::ToString() const {
  std::ostringstream out;
  out << "SdpaConfig{" << (direction == Direction::kForward ? "forward" : "backward")
      << ", device=" << device
      << ", dtype=" << (element_type == ElementType::kFloat16 ? "float16" : "bfloat16")
      << ", batch=" << batch << ", q_seq_len=" << q_seq_len << ", kv_seq_len=" << kv_seq_len
      << ", q_heads=" << q_heads << ", kv_heads=" << kv_heads << ", head_dim=" << head_dim
      << ", scale=" << scale << ", window_left=" << window_left
      << ", window_right=" << window_right << ", padding=" << padding;
  if (bias_batch > 0) {
    out << ", bias=[" << bias_batch << ", " << bias_heads << ", " << q_seq_len << ", "
        << kv_seq_len << "]" << (bias_grad ? " with dbias" : "");
  }
  if (deterministic) out << ", deterministic";
  out << "}";
  return out.str();
}

size_t SdpaConfigHash::operator()(const SdpaConfig& c) const {
  size_t seed = 0;
  std::apply(
      [&seed](auto... field) {
        ((seed ^= std::hash<int64_t>{}(static_cast<int64_t>(field)) + 0x9e3779b97f4a7c15ULL +
                  (seed << 6) + (seed >> 2)),
         ...);
      },
      Fields(c));
  return seed;
}

}  // namespace jax_sdpa
