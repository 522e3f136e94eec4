// State XLA keeps for each of our custom calls in a compiled executable (the FFI "instantiate"
// stage): per device, the graphs that call runs (one per grid the device chose) and, for a call
// XLA records into command buffers
// without giving it a big enough workspace result, its own workspace. It serves three purposes:
// - a call finds its graph without hashing its config or taking the cache's lock;
// - a graph stays alive as long as an executable that uses it: a call recorded into a command
//   buffer (a CUDA graph) replays cuDNN's kernels long after the call returned, so the LRU
//   cache must not free the graph while the executable lives;
// - such a recorded call's workspace must outlive the call too (per-call scratch would be
//   gone), and must be the call's alone: XLA orders the commands of a CUDA graph only by the
//   buffers it sees, so two of our calls in one executable may run at the same time. (The
//   workspace result Python plans, execution.h, is such a buffer: it needs neither.)
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "common/check.h"
#include "common/device_memory.h"
#include "graph/sdpa_config.h"
#include "graph/sdpa_graphs.h"

namespace jax_sdpa {

class CallState {
 public:
  static ffi::TypeId id;
  static XLA_FFI_TypeInfo type_info;

  CallState() = default;
  ~CallState();  // hands its graphs and workspaces to the cache, freed after queued work
  CallState(const CallState&) = delete;
  CallState& operator=(const CallState&) = delete;

  // The graph this call already ran with for `config` (its device included), or nullptr.
  std::shared_ptr<SdpaGraph> Find(const SdpaConfig& config);
  void Remember(std::shared_ptr<SdpaGraph> graph);

  // This call's own workspace for `graph` (remembered before), allocated on first use; may be
  // called while XLA captures the stream.
  ffi::Error OwnWorkspace(const SdpaGraph& graph, void** workspace);

 private:
  struct Held {
    std::shared_ptr<SdpaGraph> graph;
    std::shared_ptr<DeviceMemory> workspace;  // command-buffer calls only
  };
  void ReleaseLocked(Held& held);

  // One executable may run on several devices, a call with a device grid on up to 9 graphs
  // per device (jax_sdpa/packing/grids.py's grids and the fallback); searched linearly.
  static constexpr size_t kMaxGraphs = 80;
  std::mutex mutex_;
  std::vector<Held> held_;
};

// XLA calls this once per custom call of ours when it loads an executable (every target's
// instantiate stage): the call's state lives as long as the executable.
XLA_FFI_DECLARE_HANDLER_SYMBOL(CallStateInstantiateHandler);

}  // namespace jax_sdpa
