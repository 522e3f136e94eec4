// The attributes of our FFI calls, declared once as a list: the struct's fields, the handlers'
// decoding (sdpa_handlers.cc), the names Python is checked against (HandlerAttributeNames) and
// the trace-time decoding from Python's values (AttributesFromValues) all come from it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "check.h"

#define JAX_SDPA_ATTRIBUTES(X, SEP)                                                  \
  X(float, scale)                                                                    \
  SEP X(float, soft_cap)       /* cap * tanh(scores / cap); 0: none */                \
  SEP X(int64_t, window_left)  /* inclusive, as local_window_size; -1: none */        \
  SEP X(int64_t, window_right) /* 0 is causal; -1: none */                           \
  SEP X(bool, bottom_right)                                                          \
  SEP X(bool, has_bias)                                                              \
  SEP X(bool, padding) /* int32 [B] lengths operands: cuDNN's padding mask */       \
  SEP X(bool, ragged) /* packed documents: lengths per document, offsets */          \
  SEP X(int64_t, max_document_length_q)  /* ragged: longest document, queries; 0: T */ \
  SEP X(int64_t, max_document_length_kv) /* and keys; 0: S */                       \
  SEP X(bool, paged) /* forward: K/V page pools and a page table */                  \
  SEP X(bool, bias_grad)                                                             \
  SEP X(bool, deterministic)                                                         \
  SEP X(float, dropout)                                                              \
  SEP X(int64_t, fp8_gradients) /* FP8 call: its backward's ElementType; 0: not FP8 */ \
  SEP X(bool, zero_outputs) /* elements no document or length covers stay zero */    \
  SEP X(bool, poison_rows)  /* int32 [rows] operand: rows whose first token becomes NaN */ \
  SEP X(bool, zero_tails) /* int32 [rows, 2] operand: tokens past them become zero */     \
  SEP X(int64_t, debug)     /* DebugFlags */                                         \
  SEP X(bool, command_buffer) /* recorded into command buffers: see PrepareCall */     \
  SEP X(bool, workspace_result) /* the last result is the call's cuDNN workspace */

#define JAX_SDPA_FIELD(type, name) type name;
#define JAX_SDPA_DECODE(type, name) ::xla::ffi::StructMember<type>(#name)
#define JAX_SDPA_NAME(type, name) #name
#define JAX_SDPA_NOTHING
#define JAX_SDPA_COMMA ,

namespace jax_sdpa {

struct CallAttributes {
  JAX_SDPA_ATTRIBUTES(JAX_SDPA_FIELD, JAX_SDPA_NOTHING)
};

// Bits of the `debug` attribute (tests only).
enum DebugFlags : int64_t {
  // NaN-fill outputs before cuDNN runs, to prove every element is written, and the workspace,
  // to prove cuDNN initialises what it reads there.
  kPoisonOutputs = 1,
};

// The attribute names, in order: what Python must send (tests compare).
std::vector<std::string> HandlerAttributeNames();

// The attributes from Python's values by name (each held exactly by a double: bools, small
// integers, float32 values); every attribute must be there.
ffi::ErrorOr<CallAttributes> AttributesFromValues(const std::map<std::string, double>& values);

}  // namespace jax_sdpa
