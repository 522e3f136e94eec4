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
  // Diagonal band, aligned top-left: query i sees keys j with i - window_left < j (cuDNN's
  // exclusive left bound) and j <= i + window_right. -1: no bound. Causal is window_right = 0.
  int64_t window_left = -1;
  int64_t window_right = -1;
  bool padding = false;     // int32 [batch] actual lengths of queries and keys/values
  int64_t bias_batch = 0;   // bias [bias_batch, bias_heads, q_seq, kv_seq]; 0: no bias
  int64_t bias_heads = 0;   // 1 or q_heads
  bool bias_grad = false;   // backward also produces dbias, shaped like the bias
  bool deterministic = false;  // backward: cuDNN's deterministic algorithm

  bool operator==(const SdpaConfig& other) const;
  std::string ToString() const;
};

struct SdpaConfigHash {
  size_t operator()(const SdpaConfig& config) const;
};

}  // namespace jax_sdpa
