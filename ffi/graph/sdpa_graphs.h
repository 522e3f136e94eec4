// cuDNN frontend SDPA graphs, built from an SdpaConfig and executed on device pointers.
// Only this, graph_description.cc and score_mod.cc include the (slow to compile) frontend header.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/check.h"
#include "graph/fp8_scales.h"
#include "graph/sdpa_config.h"

namespace jax_sdpa {

// Element offsets of each document (int32 [documents + 1] each) in the ragged layout.
struct RaggedOffsets {
  const void* q = nullptr;  // Q and dQ
  const void* k = nullptr;  // K and dK
  const void* v = nullptr;  // V and dV
  const void* o = nullptr;  // O and dO
  const void* stats = nullptr;
};

// Inputs shared by both directions; bias, the int32 [batch] lengths, the ragged offsets, the page
// table and the dropout seed only where the config has them (nullptr otherwise). dropout_seed
// holds two int64: Philox seed, then offset.
struct AttentionInputs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* bias = nullptr;
  const void* q_lengths = nullptr;
  const void* kv_lengths = nullptr;
  const void* q_segment_ids = nullptr;  // int32 [batch, q_seq] and [batch, kv_seq]
  const void* kv_segment_ids = nullptr;
  RaggedOffsets offsets;
  const void* page_table = nullptr;  // paged K/V: int32 [batch, pages per sequence]
  const void* dropout_seed = nullptr;
  const void* score_mod_tables = nullptr;  // float32 [batch, score_mod_tables, q_heads]
};

// An FP8 call's float32 scales in (rows of fp8_scales.h's kFp8ScaleRow floats) and amaxes out
// (the same rows); null for other calls.
struct Fp8Buffers {
  const float* scales = nullptr;
  float* amaxes = nullptr;
};

// Forward: o and stats (float32 log-sum-exp: [batch, q_heads, q_seq], or token-major
// [total_q_tokens, q_heads] when ragged) out.
struct ForwardBuffers {
  AttentionInputs in;
  void* o = nullptr;
  void* stats = nullptr;
  Fp8Buffers fp8;
};

// Backward: the forward's output and stats, and dO in; dq, dk, dv (and dbias) out.
struct BackwardBuffers {
  AttentionInputs in;
  const void* o = nullptr;
  const void* d_o = nullptr;
  const void* stats = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* dbias = nullptr;
  Fp8Buffers fp8;
};

class SdpaGraph {
 public:
  ~SdpaGraph();
  SdpaGraph(const SdpaGraph&) = delete;
  SdpaGraph& operator=(const SdpaGraph&) = delete;

  // Builds the forward or backward graph (config.direction) with the heuristics' first plan
  // that builds; an error carries cuDNN's message, the failing step and the config.
  static ffi::ErrorOr<std::shared_ptr<SdpaGraph>> Build(const SdpaConfig& config,
                                                        cudnnHandle_t handle);

  // A graph serialized by Serialize() (graph_files.h), rebuilt for `handle` without planning;
  // an error if the bytes are not such a graph or this cuDNN cannot load it.
  static ffi::ErrorOr<std::shared_ptr<SdpaGraph>> Load(const SdpaConfig& config,
                                                       cudnnHandle_t handle,
                                                       const std::vector<uint8_t>& bytes);
  ffi::ErrorOr<std::vector<uint8_t>> Serialize() const;

  // What a serialized graph of `config` depends on: the config, the cuDNN library and frontend
  // versions, and the GPU model.
  static std::string DiskKey(const SdpaConfig& config);

  const SdpaConfig& config() const { return config_; }
  int64_t workspace_size() const { return workspace_size_; }

  // Enqueue on the stream `handle` is bound to.
  ffi::Error ExecuteForward(cudnnHandle_t handle, const ForwardBuffers& buffers,
                            void* workspace) const;
  ffi::Error ExecuteBackward(cudnnHandle_t handle, const BackwardBuffers& buffers,
                             void* workspace) const;

 private:
  struct Frontend;
  // Runs the plan on the tensors of `pack` (uid -> device pointer).
  ffi::Error Execute(cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack,
                     void* workspace) const;
  SdpaGraph(const SdpaConfig& config, std::unique_ptr<Frontend> frontend, int64_t workspace_size);

  SdpaConfig config_;
  std::unique_ptr<Frontend> frontend_;
  int64_t workspace_size_ = 0;
  // Which score_mod tables the graph reads (score_mod.h), found once: executions bind them.
  std::vector<bool> score_mod_tables_read_;
  // Calls on several streams may share a graph; the frontend's execute is not documented as
  // safe to run concurrently on one graph, so enqueueing is serialised per graph (microseconds).
  mutable std::mutex execute_mutex_;
};

}  // namespace jax_sdpa
