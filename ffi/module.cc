// The Python module: handler capsules for jax.ffi.register_ffi_target, the per-call state's
// type for jax.ffi.register_ffi_type, the handlers' attribute names, library versions and the
// graph cache's counters. Benchmark-only tools live in the separate devtools module.
#include <cudnn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "call_attributes.h"
#include "call_state.h"
#include "graph_cache.h"
#include "sdpa_handlers.h"
#include "workspace_planning.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Encapsulate(T* pointer) {
  return nb::capsule(reinterpret_cast<void*>(pointer));
}

// Our FFI targets, named here alone (Python reads the names through target_names()).
struct Target {
  const char* role;  // what Python calls it
  const char* name;  // the custom call's target name
  XLA_FFI_Handler* execute;
};
const Target kTargets[] = {
    {"forward", "jax_sdpa_forward", jax_sdpa::SdpaForwardHandler},
    {"backward", "jax_sdpa_backward", jax_sdpa::SdpaBackwardHandler},
    // The same handlers, which XLA may record into its command buffers (CUDA graphs).
    {"forward_command_buffer", "jax_sdpa_forward_cmdbuf",
     jax_sdpa::SdpaForwardCommandBufferHandler},
    {"backward_command_buffer", "jax_sdpa_backward_cmdbuf",
     jax_sdpa::SdpaBackwardCommandBufferHandler},
};

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
  m.def("target_names", []() {
    nb::dict names;
    for (const Target& target : kTargets) names[target.role] = target.name;
    return names;
  });
  m.def("registrations", []() {
    nb::dict stages;
    for (const Target& target : kTargets) stages[target.name] = TargetStages(target.execute);
    return stages;
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
  m.def("attribute_names", &jax_sdpa::HandlerAttributeNames,
        "The attribute names the handlers decode (jax_sdpa/call_spec.py must send these).");
  m.def(
      "workspace_bytes",
      [](bool backward, int32_t device, const std::vector<std::pair<std::string,
                                                                    std::vector<int64_t>>>& shapes,
         const std::map<std::string, double>& attributes) {
        std::vector<jax_sdpa::OperandShape> operands;
        for (const auto& [dtype, dims] : shapes) operands.push_back({dtype, dims});
        auto bytes = jax_sdpa::PlannedWorkspaceBytes(backward, device, operands, attributes);
        if (!bytes.has_value()) throw std::runtime_error(bytes.error().message());
        return *bytes;
      },
      nb::arg("backward"), nb::arg("device"), nb::arg("operands"), nb::arg("attributes"),
      "The cuDNN workspace (bytes) of a call: operands as (dtype name, dims) in the handler's "
      "order, attributes by name. Builds the call's graph on `device` (or finds it cached).");
  m.def("graph_cache_stats", []() {
    jax_sdpa::GraphCacheStats s = jax_sdpa::GraphCache::Global().stats();
    const std::pair<const char*, int64_t> counts[] = {
        {"entries", s.entries},       {"capacity", s.capacity},     {"builds", s.builds},
        {"hits", s.hits},             {"evictions", s.evictions},   {"retired", s.retired},
        {"disk_loads", s.disk_loads}, {"disk_writes", s.disk_writes},
        {"disk_rejects", s.disk_rejects}};
    nb::dict result;
    for (const auto& [name, count] : counts) result[name] = count;
    return result;
  });
}
