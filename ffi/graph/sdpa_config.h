// One SDPA call described by value: the graph cache's key, the graph builders' input and
// what every error message prints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "graph_options.inc"  // generated: cmake/generate_targets.py

// X-macro helpers: a field with its default; separators between entries.
#define JAX_SDPA_FIELD(type, name, default_value) type name = default_value;
#define JAX_SDPA_NOTHING()
#define JAX_SDPA_COMMA() ,

namespace jax_sdpa {

// FP8 calls (sdpa_fp8, sdpa_fp8_backward) take Q, K, V (and O) in e4m3; their backward's dO,
// its internal dS and the gradients come in one FP8 format of their own (gradient_type).
enum class ElementType : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat8E4M3 = 2, kFloat8E5M2 = 3 };

inline bool IsFp8(ElementType type) {
  return type == ElementType::kFloat8E4M3 || type == ElementType::kFloat8E5M2;
}

const char* ElementTypeName(ElementType type);

// A score modifier's tables (jax_sdpa/score_mod/program.py): at most this many per call.
constexpr int64_t kMaxScoreModTables = 32;

enum class Direction : int32_t { kForward = 0, kBackward = 1 };

// cuDNN frontend's SDPA forward implementations (SDPA_attributes::set_implementation): kAuto lets
// the frontend choose, as the product always does (from frontend 1.21 with cuDNN >= 9.21 it
// prefers the unified engine where that engine supports the graph); benchmarks.plans forces
// the others to time them against it.
enum class ForwardImplementation : int32_t { kAuto = 0, kComposite = 1, kUnified = 2 };

struct SdpaConfig {
  Direction direction = Direction::kForward;
  int32_t device = 0;
  ElementType element_type = ElementType::kFloat16;
  // Of dO and dQ, dK, dV: element_type, but for an FP8 call (element_type e4m3) its own format.
  // An FP8 call also takes float32 scale factors and returns float32 amaxes (sdpa_graphs.h).
  ElementType gradient_type = ElementType::kFloat16;
  // Tensors are [batch, seq, heads, head_dim] in memory (BSHD); cuDNN sees them as BHSD.
  int64_t batch = 0;
  int64_t q_seq_len = 0;
  int64_t kv_seq_len = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;    // of queries and keys
  int64_t head_dim_v = 0;  // of values and the output (may differ from head_dim)
  // CallSpec's graph options (jax_sdpa/call/spec.py), under their names: scale; soft-capping
  // (the scaled scores become logits_soft_cap * tanh(scores / logits_soft_cap) before the bias
  // and masks: cuDNN takes it as a score modifier, which replaces its built-in masks, so the
  // band and the padding are then built into the modifier, graph_description.cc); the diagonal
  // band (query i sees keys j with i + shift - window_left <= j <= i + shift + window_right,
  // inclusive as local_window_size, where shift is 0 aligned top-left and kv_seq_len - q_seq_len
  // aligned bottom-right; -1: no bound; causal is window_right = 0; the graph builder alone makes
  // cuDNN's exclusive left bound); deterministic (backward only); dropout (the probability of
  // dropping a weight: Philox seed and offset operands, so the backward drops what the forward
  // dropped); a score modifier (score_mod: its forward pointwise program, score_mod_bprop: its
  // derivative's, score_mod_tables: how many [batch, q_heads] tables they read; applied after
  // soft-capping, and like it turning cuDNN's built-in masks into nodes: score_mod.h).
  JAX_SDPA_GRAPH_OPTIONS(JAX_SDPA_FIELD, JAX_SDPA_NOTHING)
  bool padding = false;       // int32 [batch] lengths of queries and keys: cuDNN's padding mask
  bool ragged = false;        // packed documents (below)
  // int32 [batch, q_seq] and [batch, kv_seq] segment ids: a key whose id is not the query's is
  // masked, inside the score modifier, as soft-cap's band and padding are.
  bool segment_mask = false;
  // Packed documents (cuDNN's ragged layout): `batch` counts documents, each a run of tokens at
  // its own offset into [total_q_tokens, heads, dim] (queries, output) and [total_kv_tokens, ...]
  // (keys, values) memory, with its own lengths (padding is on); q_seq_len and kv_seq_len bound
  // a document's lengths. Stats are token-major then: [total_q_tokens, q_heads].
  int64_t total_q_tokens = 0;
  int64_t total_kv_tokens = 0;
  // A paged K/V cache (forward only): keys and values live in a pool of `num_pages` pages of
  // `page_size` tokens, [num_pages, page_size, kv_heads, dim] in memory; an int32 [batch,
  // kv_seq_len / page_size] table lists each sequence's pages in order, and kv_seq_len is the
  // table's capacity in tokens (padding is on: the lengths say how many are valid). 0: not paged.
  int64_t page_size = 0;
  int64_t num_pages = 0;
  int64_t bias_batch = 0;   // bias [bias_batch, bias_heads, q_seq, kv_seq]; 0: no bias
  int64_t bias_heads = 0;   // 1 or q_heads
  bool bias_grad = false;   // backward also produces dbias, shaped like the bias
  // A dense call's stats token-major ([batch, q_seq, q_heads] in memory), as the ragged
  // layout's always are: a ragged call's fallback writes the same buffer (targets/ragged.cc).
  bool stats_token_major = false;

  bool operator==(const SdpaConfig& other) const;
  std::string ToString() const;
  // Every field but the device ordinal, exactly (floats by their bits): what names the graph
  // across processes, where one GPU may have another ordinal (graph_files.h).
  std::string Key() const;
};

struct SdpaConfigHash {
  size_t operator()(const SdpaConfig& config) const;
};

}  // namespace jax_sdpa
