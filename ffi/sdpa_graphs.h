// cuDNN frontend SDPA graphs, built from an SdpaConfig and executed on device pointers.
// Only sdpa_graphs.cc includes the (slow to compile) frontend header.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <memory>

#include "check.h"
#include "sdpa_config.h"

namespace jax_sdpa {

// Device pointers of one forward call: q, k, v in; o and stats (float32 log-sum-exp) out.
struct ForwardBuffers {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  void* stats;
};

// Device pointers of one backward call: the forward's inputs, output and stats, and dO in;
// dq, dk, dv out.
struct BackwardBuffers {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* d_o;
  const void* stats;
  void* dq;
  void* dk;
  void* dv;
};

class SdpaGraph {
 public:
  ~SdpaGraph();
  SdpaGraph(const SdpaGraph&) = delete;
  SdpaGraph& operator=(const SdpaGraph&) = delete;

  // Builds the forward or backward graph (config.direction) and picks its execution plan.
  static ffi::Error Build(const SdpaConfig& config, cudnnHandle_t handle,
                          std::shared_ptr<SdpaGraph>* graph);

  const SdpaConfig& config() const { return config_; }
  int64_t workspace_size() const { return workspace_size_; }

  // Enqueue on the stream the handle is bound to; the caller holds the handle's lock.
  ffi::Error ExecuteForward(cudnnHandle_t handle, const ForwardBuffers& buffers,
                            void* workspace);
  ffi::Error ExecuteBackward(cudnnHandle_t handle, const BackwardBuffers& buffers,
                             void* workspace);

 private:
  struct Frontend;
  SdpaGraph(const SdpaConfig& config, std::unique_ptr<Frontend> frontend, int64_t workspace_size);

  SdpaConfig config_;
  std::unique_ptr<Frontend> frontend_;
  int64_t workspace_size_ = 0;
};

}  // namespace jax_sdpa
