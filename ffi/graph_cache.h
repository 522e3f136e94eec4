// Thread-safe cache of built SDPA graphs, one per (device, config): no graph is built twice, and
// a build for one config never blocks lookups of others.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "check.h"
#include "sdpa_config.h"
#include "sdpa_graphs.h"

namespace jax_sdpa {

struct GraphCacheStats {
  int64_t entries = 0;
  int64_t builds = 0;  // successful graph builds since the process started
  int64_t hits = 0;
};

class GraphCache {
 public:
  static GraphCache& Global();

  // Returns the graph for `config`, building it with `handle` (locked by the caller) if needed.
  ffi::Error GetOrBuild(const SdpaConfig& config, cudnnHandle_t handle,
                        std::shared_ptr<SdpaGraph>* graph);

  GraphCacheStats stats();

 private:
  struct Entry {
    std::mutex build_mutex;
    std::shared_ptr<SdpaGraph> graph;
  };

  std::mutex mutex_;
  std::unordered_map<SdpaConfig, std::shared_ptr<Entry>, SdpaConfigHash> entries_;
  GraphCacheStats stats_;
};

}  // namespace jax_sdpa
