// The Python module: our targets' handler capsules for jax.ffi.register_ffi_target (their names
// as jax_sdpa/cudnn/targets.py declares them), the per-call state's type for
// jax.ffi.register_ffi_type, each target's attribute names, the trace-time workspace planner,
// library versions and the graph cache's counters. Benchmark-only tools live in the separate
// devtools module.
#include <cudnn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "call/call_state.h"
#include "call/target.h"
#include "graph/graph_cache.h"
#include "targets/handler.h"
#include "targets/workspace_planning.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Encapsulate(T* pointer) {
  return nb::capsule(reinterpret_cast<void*>(pointer));
}

// One target: its instantiate stage (creates the call's state) and its execute stage.
nb::dict TargetStages(XLA_FFI_Handler* execute) {
  nb::dict stages;
  stages["instantiate"] = Encapsulate(jax_sdpa::CallStateInstantiateHandler);
  stages["execute"] = Encapsulate(execute);
  return stages;
}

}  // namespace

NB_MODULE(_sdpa_ffi, m) {
  m.def(
      "registrations",
      []() {
        nb::dict stages;
#define JAX_SDPA_REGISTER(Handler)                                                      \
  stages[jax_sdpa::TargetTraits<jax_sdpa::Handler##Attributes>::kName] =               \
      TargetStages(jax_sdpa::Handler##Handler);                                         \
  stages[jax_sdpa::TargetTraits<jax_sdpa::Handler##Attributes>::kCommandBufferName] = \
      TargetStages(jax_sdpa::Handler##CommandBufferHandler);
        JAX_SDPA_TARGETS(JAX_SDPA_REGISTER)
#undef JAX_SDPA_REGISTER
        return stages;
      },
      "Every target's stages by name, and its command-buffer twin's (name + '_cmdbuf').");
  m.def(
      "target_attributes",
      []() {
        std::map<std::string, std::vector<std::string>> names;
#define JAX_SDPA_ATTRIBUTE_NAMES(Handler)                         \
  names[jax_sdpa::TargetTraits<jax_sdpa::Handler##Attributes>::kName] = \
      jax_sdpa::TargetTraits<jax_sdpa::Handler##Attributes>::AttributeNames();
        JAX_SDPA_TARGETS(JAX_SDPA_ATTRIBUTE_NAMES)
#undef JAX_SDPA_ATTRIBUTE_NAMES
        return names;
      },
      "The attribute names each target's handler decodes, as this build was generated.");
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
  m.def(
      "workspace_bytes",
      [](const std::string& target, int32_t device,
         const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
         const std::map<std::string, std::variant<double, std::string>>& attributes) {
        std::vector<jax_sdpa::OperandShape> operands;
        for (const auto& [dtype, dims] : shapes) operands.push_back({dtype, dims});
        jax_sdpa::AttributeValues values;
        for (const auto& [name, value] : attributes) {
          if (const double* number = std::get_if<double>(&value)) {
            values.numbers[name] = *number;
          } else {
            values.strings[name] = std::get<std::string>(value);
          }
        }
        auto bytes = jax_sdpa::PlannedWorkspaceBytes(target, device, operands, values);
        if (!bytes.has_value()) throw std::runtime_error(bytes.error().message());
        return *bytes;
      },
      nb::arg("target"), nb::arg("device"), nb::arg("operands"), nb::arg("attributes"),
      "The cuDNN workspace (bytes) of a call of `target`: operands as (dtype name, dims) in the "
      "target's order, attributes by name (numbers as floats, and strings). Builds the call's graph on `device` (or finds it "
      "cached).");
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
