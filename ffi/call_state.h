// State XLA keeps for each of our custom calls in a compiled executable (the FFI "instantiate"
// stage): the graphs that call ran with, one per device. It serves two purposes:
// - a call finds its graph without hashing its config or taking the cache's lock;
// - a graph stays alive as long as an executable that uses it: a call recorded into an XLA
//   command buffer (a CUDA graph) replays cuDNN's kernels and workspace long after the call
//   returned, so the graph must not be freed by the LRU cache while the executable lives.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "check.h"
#include "sdpa_config.h"
#include "sdpa_graphs.h"

namespace jax_sdpa {

class CallState {
 public:
  static ffi::TypeId id;
  static XLA_FFI_TypeInfo type_info;

  CallState() = default;
  ~CallState();  // hands its graphs to the cache, which frees them after their queued work
  CallState(const CallState&) = delete;
  CallState& operator=(const CallState&) = delete;

  // The graph this call already ran with for `config` (its device included), or nullptr.
  std::shared_ptr<SdpaGraph> Find(const SdpaConfig& config);
  void Remember(std::shared_ptr<SdpaGraph> graph);

 private:
  // One executable may run on several devices; a handful of entries, searched linearly.
  static constexpr size_t kMaxGraphs = 16;
  std::mutex mutex_;
  std::vector<std::shared_ptr<SdpaGraph>> graphs_;
};

}  // namespace jax_sdpa
