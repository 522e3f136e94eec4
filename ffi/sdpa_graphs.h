// cuDNN frontend SDPA graphs, built from an SdpaConfig and executed on device pointers.
// Only sdpa_graphs.cc includes the (slow to compile) frontend header.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "check.h"
#include "sdpa_config.h"

namespace jax_sdpa {

// Inputs shared by both directions; bias, the int32 [batch] lengths and the dropout seed only
// where the config has them (nullptr otherwise). dropout_seed holds two int64: Philox seed, then
// offset.
struct AttentionInputs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* bias = nullptr;
  const void* q_lengths = nullptr;
  const void* kv_lengths = nullptr;
  const void* dropout_seed = nullptr;
};

// Forward: o and stats (float32 log-sum-exp, [batch, q_heads, q_seq]) out.
struct ForwardBuffers {
  AttentionInputs in;
  void* o = nullptr;
  void* stats = nullptr;
  void* dropout_mask = nullptr;  // float32 [batch, q_heads, q_seq, kv_seq] if dump_dropout_mask
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
};

class SdpaGraph {
 public:
  ~SdpaGraph();
  SdpaGraph(const SdpaGraph&) = delete;
  SdpaGraph& operator=(const SdpaGraph&) = delete;

  // Builds the forward or backward graph (config.direction) and picks its execution plan.
  static ffi::Error Build(const SdpaConfig& config, cudnnHandle_t handle,
                          std::shared_ptr<SdpaGraph>* graph);
  // The same graph with every plan cuDNN's heuristics offer (modes A, B and fallback) built
  // where cuDNN can: for timing plans against each other (kernel_timing.h), not for calls.
  static ffi::Error BuildAllPlans(const SdpaConfig& config, cudnnHandle_t handle,
                                  std::shared_ptr<SdpaGraph>* graph);

  // Plans are indexed in the heuristics' order of preference; calls run the first that built.
  static constexpr int64_t kPreferredPlan = -1;
  int64_t plan_count() const;
  // cuDNN's name for plan `index` and its workspace, or an error if it did not build.
  ffi::Error PlanInfo(int64_t index, std::string* name, int64_t* workspace_size) const;

  const SdpaConfig& config() const { return config_; }
  int64_t workspace_size() const { return workspace_size_; }

  // Enqueue on the stream the handle is bound to; the caller holds the handle's lock.
  ffi::Error ExecuteForward(cudnnHandle_t handle, const ForwardBuffers& buffers,
                            void* workspace, int64_t plan = kPreferredPlan);
  ffi::Error ExecuteBackward(cudnnHandle_t handle, const BackwardBuffers& buffers,
                             void* workspace, int64_t plan = kPreferredPlan);

 private:
  struct Frontend;
  static ffi::Error BuildWithPlans(const SdpaConfig& config, cudnnHandle_t handle,
                                   bool all_plans, std::shared_ptr<SdpaGraph>* graph);
  // Runs `plan` on the tensors of `pack` (uid -> device pointer).
  ffi::Error Execute(cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack,
                     void* workspace, int64_t plan);
  SdpaGraph(const SdpaConfig& config, std::unique_ptr<Frontend> frontend, int64_t workspace_size);

  SdpaConfig config_;
  std::unique_ptr<Frontend> frontend_;
  int64_t workspace_size_ = 0;
};

}  // namespace jax_sdpa
