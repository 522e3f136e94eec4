// The Python module: handler capsules for jax.ffi.register_ffi_target, the per-call state's
// type for jax.ffi.register_ffi_type, library versions and the graph cache's counters.
#include <cudnn.h>
#include <nanobind/nanobind.h>

#include "call_state.h"
#include "graph_cache.h"
#include "sdpa_handlers.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Encapsulate(T* pointer) {
  return nb::capsule(reinterpret_cast<void*>(pointer));
}

// One target: its instantiate stage (creates the call's state) and its execute stage.
template <typename T>
nb::dict TargetStages(T* execute) {
  nb::dict stages;
  stages["instantiate"] = Encapsulate(jax_sdpa::CallStateInstantiateHandler);
  stages["execute"] = Encapsulate(execute);
  return stages;
}

}  // namespace

NB_MODULE(_sdpa_ffi, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_sdpa_forward"] = TargetStages(jax_sdpa::SdpaForwardHandler);
    targets["jax_sdpa_backward"] = TargetStages(jax_sdpa::SdpaBackwardHandler);
    targets["jax_sdpa_forward_cmdbuf"] = TargetStages(jax_sdpa::SdpaForwardCommandBufferHandler);
    targets["jax_sdpa_backward_cmdbuf"] =
        TargetStages(jax_sdpa::SdpaBackwardCommandBufferHandler);
    return targets;
  });
  m.def("call_state_type", []() {
    nb::dict registration;
    registration["type_id"] = Encapsulate(&jax_sdpa::CallState::id);
    registration["type_info"] = Encapsulate(&jax_sdpa::CallState::type_info);
    return registration;
  });
  m.def("cudnn_version", []() { return static_cast<int64_t>(cudnnGetVersion()); },
        "cuDNN version of the libcudnn loaded in this process, e.g. 91900 for 9.19.0.");
  m.def("cudnn_header_version", []() { return static_cast<int64_t>(CUDNN_VERSION); },
        "cuDNN version the extension was compiled against.");
  m.def("graph_cache_stats", []() {
    jax_sdpa::GraphCacheStats stats = jax_sdpa::GraphCache::Global().stats();
    nb::dict result;
    result["entries"] = stats.entries;
    result["capacity"] = stats.capacity;
    result["builds"] = stats.builds;
    result["hits"] = stats.hits;
    result["evictions"] = stats.evictions;
    result["retired"] = stats.retired;
    return result;
  });
}
