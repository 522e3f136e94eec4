// One SDPA call described by value: the graph cache's key, the graph builders' input and
// what every error message prints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_sdpa {

enum class ElementType : int32_t { kFloat16 = 0, kBFloat16 = 1 };

enum class Direction : int32_t { kForward = 0, kBackward = 1 };

struct SdpaConfig {
  Direction direction = Direction::kForward;
  int32_t device = 0;
  ElementType element_type = ElementType::kFloat16;
  // Tensors are [batch, seq, heads, head_dim] in memory (BSHD); cuDNN sees them as BHSD.
  int64_t batch = 0;
  int64_t q_seq_len = 0;
  int64_t kv_seq_len = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  float scale = 1.0f;
  bool causal = false;  // top-left aligned, as jax.nn

  bool operator==(const SdpaConfig& other) const;
  std::string ToString() const;
};

struct SdpaConfigHash {
  size_t operator()(const SdpaConfig& config) const;
};

}  // namespace jax_sdpa
