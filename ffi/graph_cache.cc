#include "graph_cache.h"

namespace jax_sdpa {

GraphCache& GraphCache::Global() {
  // Never destroyed: graphs hold cuDNN objects that must not be freed after CUDA shuts down.
  static auto* cache = new GraphCache();
  return *cache;
}

ffi::Error GraphCache::GetOrBuild(const SdpaConfig& config, cudnnHandle_t handle,
                                  std::shared_ptr<SdpaGraph>* graph) {
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    auto& slot = entries_[config];
    if (!slot) slot = std::make_shared<Entry>();
    entry = slot;
  }
  std::lock_guard<std::mutex> build_guard(entry->build_mutex);
  if (entry->graph) {
    std::lock_guard<std::mutex> guard(mutex_);
    ++stats_.hits;
  } else {
    // A failed build is not remembered: the next call with this config tries again.
    JAX_SDPA_RETURN_IF_ERROR(SdpaGraph::Build(config, handle, &entry->graph));
    std::lock_guard<std::mutex> guard(mutex_);
    ++stats_.builds;
  }
  *graph = entry->graph;  // shared: an entry may leave the cache while in use
  return ffi::Error::Success();
}

GraphCacheStats GraphCache::stats() {
  std::lock_guard<std::mutex> guard(mutex_);
  GraphCacheStats result = stats_;
  result.entries = 0;
  for (const auto& [config, entry] : entries_) {
    if (entry->graph) ++result.entries;  // entries whose build failed hold no graph
  }
  return result;
}

}  // namespace jax_sdpa
