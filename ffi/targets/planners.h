// Each target's planner: its operands and attributes to the call it runs (call_plan.h), every
// shape checked before cuDNN sees it. One overload per target's attribute struct; the handlers
// (handler.h) and the trace-time workspace planner (workspace_planning.h) call them alike.
#pragma once

#include <cstdint>

#include "common/check.h"
#include "call/call_plan.h"
#include "call/target.h"

namespace jax_sdpa {

// Plan(device, operands, attributes) of every target (defined by JAX_SDPA_DEFINE_TARGET in its
// job's file):
// - dense.cc: q [..., B, T, N, H], k [..., B, S, K, H], v [..., B, S, K, Hv]; a bias
//   [1|B, 1|N, T, S], int32 [B] lengths, int32 [B, T] / [B, S] segment ids, a uint32 [4]
//   dropout seed where the attributes say;
// - ragged.cc: packed documents on cuDNN's ragged layout: int32 lengths per document and int32
//   [5, >= documents + 1] element offsets of each document in q, k, v, o and the token-major
//   stats;
// - paged.cc: q [B, T, N, H], key and value pages [P, page_size, K, H|Hv], int32 [B] lengths
//   and an int32 [B, pages per sequence] page table; forward only;
// - fp8.cc: e4m3 q, k, v (the backward's dO in its gradient format) and float32 scale rows
//   (graph/fp8_scales.h); the causal mask and lengths only.
#define JAX_SDPA_DECLARE_PLAN(Handler) \
  ffi::ErrorOr<CallPlan> Plan(int32_t device, CallOperands operands, \
                              const Handler##Attributes& attributes);
JAX_SDPA_TARGETS(JAX_SDPA_DECLARE_PLAN)
#undef JAX_SDPA_DECLARE_PLAN

}  // namespace jax_sdpa
