#include "call/call_state.h"

#include <memory>
#include <utility>

#include "common/capture_mode.h"
#include "graph/graph_cache.h"

namespace jax_sdpa {

ffi::TypeId CallState::id = {};
XLA_FFI_TypeInfo CallState::type_info = ffi::MakeTypeInfo<CallState>();

namespace {

ffi::ErrorOr<std::unique_ptr<CallState>> InstantiateCallState() {
  return std::make_unique<CallState>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CallStateInstantiateHandler, InstantiateCallState,
                              ffi::Ffi::BindInstantiate());

CallState::~CallState() {
  std::lock_guard<std::mutex> guard(mutex_);
  for (Held& held : held_) ReleaseLocked(held);
}

void CallState::ReleaseLocked(Held& held) {
  GraphCache::Global().Release(std::move(held.graph), std::move(held.workspace));
}

std::shared_ptr<SdpaGraph> CallState::Find(const SdpaConfig& config) {
  std::lock_guard<std::mutex> guard(mutex_);
  for (const Held& held : held_) {
    if (held.graph->config() == config) return held.graph;
  }
  return nullptr;
}

void CallState::Remember(std::shared_ptr<SdpaGraph> graph) {
  std::lock_guard<std::mutex> guard(mutex_);
  // A call's shapes are fixed: one config per device, but one per grid for a call whose grid
  // the device chooses, kept so that a grid coming back (a training step's documents) is found
  // here rather than in the cache. The oldest goes when the state is full.
  if (held_.size() == kMaxGraphs) {
    ReleaseLocked(held_.front());
    held_.erase(held_.begin());
  }
  held_.push_back(Held{std::move(graph), nullptr});
}

ffi::Error CallState::OwnWorkspace(const SdpaGraph& graph, void** workspace) {
  std::lock_guard<std::mutex> guard(mutex_);
  for (Held& held : held_) {
    if (held.graph.get() != &graph) continue;
    if (!held.workspace && graph.workspace_size() > 0) {
      // Possibly while XLA captures the stream: allocation is not a stream operation, so it
      // is allowed once this thread's capture mode is relaxed.
      RelaxedCaptureMode relaxed;
      ScopedDevice device(graph.config().device);
      JAX_SDPA_CUDA_CHECK(device.status());
      auto memory = std::make_shared<DeviceMemory>();
      JAX_SDPA_RETURN_IF_ERROR(memory->Allocate(graph.workspace_size()));
      held.workspace = std::move(memory);
    }
    *workspace = held.workspace ? held.workspace->data() : nullptr;
    return ffi::Error::Success();
  }
  return ffi::Error::Internal("jax_sdpa: no workspace for a graph this call does not hold: " +
                              graph.config().ToString());
}

}  // namespace jax_sdpa
