#include "graph/graph_cache.h"

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "common/capture_mode.h"
#include "graph/graph_files.h"

namespace jax_sdpa {
namespace {

constexpr int64_t kDefaultCapacity = 256;

int64_t CapacityFromEnvironment() {
  const char* text = std::getenv("JAX_SDPA_GRAPH_CACHE_SIZE");
  if (text == nullptr || *text == '\0') return kDefaultCapacity;
  char* end = nullptr;
  long long value = std::strtoll(text, &end, 10);
  // jax_sdpa/cudnn/extension.py checks the variable when it loads the extension and names it in its
  // error; this only guards the rest.
  return (end != nullptr && *end == '\0' && value >= 1) ? value : kDefaultCapacity;
}

// An event marking the work queued on `stream` so far, or nullptr if CUDA refused one.
cudaEvent_t RecordedEvent(cudaStream_t stream) {
  cudaEvent_t event = nullptr;
  if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) return nullptr;
  if (cudaEventRecord(event, stream) != cudaSuccess) {
    cudaEventDestroy(event);
    return nullptr;
  }
  return event;
}

}  // namespace

GraphCache& GraphCache::Global() {
  // Never destroyed: graphs hold cuDNN objects that must not be freed after CUDA shuts down.
  static auto* cache = new GraphCache(CapacityFromEnvironment());
  return *cache;
}

ffi::ErrorOr<std::shared_ptr<SdpaGraph>> GraphCache::GetOrBuild(const SdpaConfig& config,
                                                                 cudnnHandle_t handle) {
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    auto found = entries_.find(config);
    if (found != entries_.end()) {
      entry = found->second;
      recency_.splice(recency_.begin(), recency_, entry->recency);
      if (entry->graph) {
        CountHit();
        return entry->graph;
      }
    } else {
      entry = std::make_shared<Entry>();
      recency_.push_front(config);
      entry->recency = recency_.begin();
      entries_.emplace(config, entry);
      while (static_cast<int64_t>(entries_.size()) > capacity_) EvictLeastRecentLocked();
    }
  }
  // The entry is ours even if it is evicted meanwhile: the shared_ptr keeps it alive.
  std::lock_guard<std::mutex> build_guard(entry->build_mutex);
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (entry->graph) {  // another thread built it while we waited
      CountHit();
      return entry->graph;
    }
  }
  // A failed build is not remembered: the next call with this config tries again.
  std::shared_ptr<SdpaGraph> built;
  {
    RelaxedCaptureMode relaxed;  // the first call may come while XLA captures the stream
    JAX_SDPA_ASSIGN_OR_RETURN(built, LoadOrBuild(config, handle));
  }
  std::lock_guard<std::mutex> guard(mutex_);
  // If the entry was evicted while the graph was built, only the caller (its executable's
  // state) holds the graph, and lets it go through Release like any other.
  auto found = entries_.find(config);
  if (found != entries_.end() && found->second == entry) entry->graph = built;
  return built;
}

ffi::ErrorOr<std::shared_ptr<SdpaGraph>> GraphCache::LoadOrBuild(const SdpaConfig& config,
                                                                 cudnnHandle_t handle) {
  const GraphFiles* files = GraphFiles::FromEnvironment();
  std::string key = files ? SdpaGraph::DiskKey(config) : std::string();
  if (files && files->Exists(key)) {
    std::optional<std::vector<uint8_t>> bytes = files->Read(key);
    if (bytes) {
      auto loaded = SdpaGraph::Load(config, handle, *bytes);
      if (loaded.has_value()) {
        disk_loads_.fetch_add(1, std::memory_order_relaxed);
        return loaded;
      }
    }
    // A damaged or foreign file, or a plan this cuDNN refuses: built and written again.
    disk_rejects_.fetch_add(1, std::memory_order_relaxed);
  }
  JAX_SDPA_ASSIGN_OR_RETURN(std::shared_ptr<SdpaGraph> built, SdpaGraph::Build(config, handle));
  {
    std::lock_guard<std::mutex> guard(mutex_);
    ++stats_.builds;
  }
  if (files) {
    auto bytes = built->Serialize();  // some engines cannot be serialized: then nothing is kept
    bool written = bytes.has_value() && files->Write(key, *bytes);
    (written ? disk_writes_ : disk_rejects_).fetch_add(1, std::memory_order_relaxed);
  }
  return built;
}

void GraphCache::EvictLeastRecentLocked() {
  auto found = entries_.find(recency_.back());
  recency_.pop_back();
  std::shared_ptr<Entry> entry = found->second;
  entries_.erase(found);
  ++stats_.evictions;
  if (entry->graph) {
    retired_.push_back(Retired{std::move(entry->graph), nullptr, nullptr});
    retired_count_.store(static_cast<int64_t>(retired_.size()), std::memory_order_relaxed);
  }
}

void GraphCache::Release(std::shared_ptr<SdpaGraph> graph,
                         std::shared_ptr<DeviceMemory> workspace) {
  if (!graph) return;
  std::lock_guard<std::mutex> guard(mutex_);
  retired_.push_back(Retired{std::move(graph), std::move(workspace), nullptr});
  retired_count_.store(static_cast<int64_t>(retired_.size()), std::memory_order_relaxed);
}

void GraphCache::SweepIfPending(int32_t device, cudaStream_t stream) {
  if (retired_count_.load(std::memory_order_relaxed) == 0) return;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess ||
      capturing != cudaStreamCaptureStatusNone) {
    return;  // an event recorded now would only be captured: sweep on an uncaptured call
  }
  std::lock_guard<std::mutex> guard(mutex_);
  SweepRetiredLocked(device, stream);
}

void GraphCache::SweepRetiredLocked(int32_t device, cudaStream_t stream) {
  std::vector<Retired> kept;
  for (Retired& retired : retired_) {
    if (retired.queued_work_done == nullptr) {
      if (retired.graph->config().device == device) {
        retired.queued_work_done = RecordedEvent(stream);  // nullptr on failure: try next time
      }
    } else if (cudaEventQuery(retired.queued_work_done) == cudaSuccess) {
      cudaEventDestroy(retired.queued_work_done);
      continue;  // this reference is dropped here (the graph is freed if it was the last)
    }
    kept.push_back(std::move(retired));
  }
  retired_.swap(kept);
  retired_count_.store(static_cast<int64_t>(retired_.size()), std::memory_order_relaxed);
}

GraphCacheStats GraphCache::stats() {
  std::lock_guard<std::mutex> guard(mutex_);
  GraphCacheStats result = stats_;
  result.capacity = capacity_;
  result.hits = hits_.load(std::memory_order_relaxed);
  result.disk_loads = disk_loads_.load(std::memory_order_relaxed);
  result.disk_writes = disk_writes_.load(std::memory_order_relaxed);
  result.disk_rejects = disk_rejects_.load(std::memory_order_relaxed);
  result.entries = 0;
  for (const auto& [config, entry] : entries_) {
    if (entry->graph) ++result.entries;  // entries whose build failed hold no graph
  }
  result.retired = static_cast<int64_t>(retired_.size());
  return result;
}

}  // namespace jax_sdpa
