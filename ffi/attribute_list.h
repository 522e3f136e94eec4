// The attributes of our FFI calls, as X-macro lists X(type, name, default). The graph's
// attributes are SdpaConfig's fields under the same names (sdpa_config.h: its cache key, its
// graph's input, its errors' text); the call's shape how the handler runs the graph around it.
// Both make CallAttributes (call_attributes.h), which Python's attributes decode into.
#pragma once

#define JAX_SDPA_GRAPH_ATTRIBUTES(X, SEP)                                                    \
  X(float, scale, 1.0f)                                                                      \
  SEP() X(float, logits_soft_cap, 0.0f) /* cap * tanh(scores / cap); 0: none */                \
  SEP() X(int64_t, window_left, -1)     /* inclusive, as local_window_size; -1: none */        \
  SEP() X(int64_t, window_right, -1)    /* 0 is causal; -1: none */                            \
  SEP() X(bool, bottom_right, false)    /* the band measured from the bottom-right diagonal */ \
  SEP() X(bool, padding, false)         /* int32 [B] lengths operands: cuDNN's padding mask */ \
  SEP() X(bool, ragged, false)          /* packed documents: lengths per document, offsets */  \
  SEP() X(bool, deterministic, false)   /* backward: cuDNN's deterministic algorithm */        \
  SEP() X(float, dropout, 0.0f)         /* > 0: Philox seed and offset operands */          \
  SEP() X(bool, segment_mask, false)    /* int32 [B, T], [B, S] ids: keys of other ids masked */

#define JAX_SDPA_CALL_ATTRIBUTES(X, SEP)                                                      \
  X(bool, has_bias, false)                                                                    \
  SEP() X(int64_t, max_document_length_q, 0)  /* ragged: longest document, queries; 0: T */     \
  SEP() X(int64_t, max_document_length_kv, 0) /* and keys; 0: S */                              \
  SEP() X(bool, paged, false)         /* forward: K/V page pools and a page table */            \
  SEP() X(bool, bias_grad, false)                                                               \
  SEP() X(int64_t, fp8_gradients, 0)  /* FP8 call: its backward's ElementType; 0: not FP8 */    \
  SEP() X(bool, zero_outputs, false)  /* elements no document or length covers stay zero */     \
  SEP() X(bool, poison_rows, false)   /* int32 [rows] operand: rows whose first token is NaN */ \
  SEP() X(bool, zero_tails, false)    /* int32 [rows, 2] operand: tokens past them become 0 */  \
  SEP() X(bool, command_buffer, false) /* recorded into command buffers: see PrepareCall */     \
  SEP() X(bool, workspace_result, false) /* the last result is the call's cuDNN workspace */ \
  SEP() X(bool, device_grid, false) /* ragged: int32 [3] operand, the grid: see ReadGrid */    \
  SEP() X(bool, fallback_ids, false) /* device grid: [B, T], [B, S] ids; 0 documents: masked */

#define JAX_SDPA_ATTRIBUTES(X, SEP) \
  JAX_SDPA_GRAPH_ATTRIBUTES(X, SEP) SEP() JAX_SDPA_CALL_ATTRIBUTES(X, SEP)

#define JAX_SDPA_FIELD(type, name, default_value) type name = default_value;
// Separators: SEP() between entries.
#define JAX_SDPA_NOTHING()
#define JAX_SDPA_COMMA() ,
