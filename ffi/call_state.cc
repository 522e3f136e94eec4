#include "call_state.h"

#include <utility>

#include "graph_cache.h"

namespace jax_sdpa {

ffi::TypeId CallState::id = {};
XLA_FFI_TypeInfo CallState::type_info = ffi::MakeTypeInfo<CallState>();

CallState::~CallState() {
  for (auto& graph : graphs_) GraphCache::Global().Release(std::move(graph));
}

std::shared_ptr<SdpaGraph> CallState::Find(const SdpaConfig& config) {
  std::lock_guard<std::mutex> guard(mutex_);
  for (const auto& graph : graphs_) {
    if (graph->config() == config) return graph;
  }
  return nullptr;
}

void CallState::Remember(std::shared_ptr<SdpaGraph> graph) {
  std::lock_guard<std::mutex> guard(mutex_);
  for (auto& held : graphs_) {
    // Same device and shape, other config (not expected from one instruction): replace it.
    if (held->config().device == graph->config().device) {
      GraphCache::Global().Release(std::move(held));
      held = std::move(graph);
      return;
    }
  }
  if (graphs_.size() == kMaxGraphs) {
    GraphCache::Global().Release(std::move(graphs_.front()));
    graphs_.erase(graphs_.begin());
  }
  graphs_.push_back(std::move(graph));
}

}  // namespace jax_sdpa
