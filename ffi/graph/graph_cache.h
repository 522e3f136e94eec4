// Thread-safe, bounded cache of built SDPA graphs, one per (device, config): no graph is built
// twice while it is cached, a build for one config never blocks lookups of others, and the least
// recently used graph leaves when the cache is full (JAX_SDPA_GRAPH_CACHE_SIZE, default 256).
// Executables hold the graphs they use too (call_state.h): a graph is freed once neither holds
// it and the work queued with it has run.
#pragma once

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/check.h"
#include "common/device_memory.h"
#include "graph/sdpa_config.h"
#include "graph/sdpa_graphs.h"

namespace jax_sdpa {

struct GraphCacheStats {
  int64_t entries = 0;    // graphs held now
  int64_t capacity = 0;   // most graphs held at once
  int64_t builds = 0;     // successful graph builds since the process started
  int64_t hits = 0;
  int64_t evictions = 0;  // graphs that left to make room
  int64_t retired = 0;    // graphs let go (evicted, or their executable freed) whose queued
                          // work may not have finished yet
  // The graph files directory (graph_files.h), when one is set:
  int64_t disk_loads = 0;    // graphs loaded from it instead of built
  int64_t disk_writes = 0;   // graphs written to it after a build
  int64_t disk_rejects = 0;  // files there that could not be used (stale, foreign, corrupt,
                             // or refused by cuDNN), and writes that failed
};

class GraphCache {
 public:
  static GraphCache& Global();

  // Returns the graph for `config`, building it with `handle` (the caller's alone) if needed.
  ffi::ErrorOr<std::shared_ptr<SdpaGraph>> GetOrBuild(const SdpaConfig& config,
                                                     cudnnHandle_t handle);

  // A call that found its graph in its executable's state (call_state.h) counts as a hit.
  void CountHit() { hits_.fetch_add(1, std::memory_order_relaxed); }

  // Takes one holder's reference to a graph (and a workspace used with it); they are dropped
  // once the work queued so far on the graph's device has run (freed if nothing else holds
  // them).
  void Release(std::shared_ptr<SdpaGraph> graph,
               std::shared_ptr<DeviceMemory> workspace = nullptr);

  // Frees let-go graphs whose work has run, from a call about to enqueue work on `device`.
  // A no-op costing one atomic load when there are none.
  void SweepIfPending(int32_t device, cudaStream_t stream);

  GraphCacheStats stats();

 private:
  explicit GraphCache(int64_t capacity) : capacity_(capacity) {}

  struct Entry {
    std::mutex build_mutex;            // held while the graph is built
    std::shared_ptr<SdpaGraph> graph;  // read and written under mutex_
    std::list<SdpaConfig>::iterator recency;  // position in recency_ (front: most recent)
  };
  // A let-go graph is freed only once the work queued with it has run: a kernel in flight must
  // not outlive its plan. The event is recorded on the stream of the next call on the graph's
  // own device (XLA queues one device's work on one compute stream), never on a stream XLA is
  // capturing (a captured event record does not run until replay). Nothing can queue new work
  // on a let-go graph: only the retired list still holds it once it is freed here.
  struct Retired {
    std::shared_ptr<SdpaGraph> graph;
    std::shared_ptr<DeviceMemory> workspace;
    cudaEvent_t queued_work_done = nullptr;
  };

  // Loads the graph from the graph files directory if one is set and holds it, else builds
  // it (and writes it there).
  ffi::ErrorOr<std::shared_ptr<SdpaGraph>> LoadOrBuild(const SdpaConfig& config,
                                                      cudnnHandle_t handle);
  void EvictLeastRecentLocked();
  // Frees retired graphs whose work has run; records events for those of `device`.
  void SweepRetiredLocked(int32_t device, cudaStream_t stream);

  const int64_t capacity_;
  std::mutex mutex_;
  std::unordered_map<SdpaConfig, std::shared_ptr<Entry>, SdpaConfigHash> entries_;
  std::list<SdpaConfig> recency_;
  std::vector<Retired> retired_;
  std::atomic<int64_t> retired_count_{0};
  std::atomic<int64_t> hits_{0};
  std::atomic<int64_t> disk_loads_{0}, disk_writes_{0}, disk_rejects_{0};
  GraphCacheStats stats_;  // builds and evictions; hits and retired are counted above
};

}  // namespace jax_sdpa
