// The Python module: handler capsules for jax.ffi.register_ffi_target, the per-call state's
// type for jax.ffi.register_ffi_type, library versions and the graph cache's counters.
#include <cudnn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "call_state.h"
#include "graph_cache.h"
#include "kernel_timing.h"
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

// benchmarks/plans.py's entry: every plan of one unmasked or causal SDPA graph, timed alone.
nb::list TimePlans(const std::string& direction, const std::string& dtype, int64_t batch,
                   int64_t q_seq_len, int64_t kv_seq_len, int64_t q_heads, int64_t kv_heads,
                   int64_t head_dim, int64_t head_dim_v, bool causal, float scale,
                   int64_t iterations, int64_t input_sets,
                   const std::vector<std::vector<uintptr_t>>& buffers, int32_t device) {
  jax_sdpa::SdpaConfig c;
  if ((direction != "forward" && direction != "backward") ||
      (dtype != "float16" && dtype != "bfloat16")) {
    throw std::invalid_argument("direction must be forward|backward and dtype "
                                "float16|bfloat16, got " + direction + ", " + dtype);
  }
  c.direction = direction == "forward" ? jax_sdpa::Direction::kForward
                                       : jax_sdpa::Direction::kBackward;
  c.element_type = dtype == "float16" ? jax_sdpa::ElementType::kFloat16
                                      : jax_sdpa::ElementType::kBFloat16;
  c.device = device;
  c.batch = batch;
  c.q_seq_len = q_seq_len;
  c.kv_seq_len = kv_seq_len;
  c.q_heads = q_heads;
  c.kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.head_dim_v = head_dim_v;
  c.scale = scale;
  if (causal) c.window_right = 0;
  std::vector<jax_sdpa::BufferSet> given;
  for (const auto& set : buffers) {
    given.emplace_back();
    for (uintptr_t pointer : set) given.back().push_back(reinterpret_cast<void*>(pointer));
  }
  std::vector<jax_sdpa::PlanTiming> timings;
  xla::ffi::Error status;
  {
    nb::gil_scoped_release released;  // seconds of GPU work
    status = jax_sdpa::TimePlans(c, iterations, input_sets, given, &timings);
  }
  if (status.failure()) throw std::runtime_error(status.message());
  nb::list result;
  for (const auto& timing : timings) {
    nb::dict row;
    row["plan"] = timing.plan;
    row["name"] = timing.name;
    row["workspace_bytes"] = timing.workspace_size;
    row["ms"] = timing.ms;
    row["host_us"] = timing.host_us;
    row["error"] = timing.error;
    result.append(row);
  }
  return result;
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
  m.def("time_plans", &TimePlans, nb::arg("direction"), nb::arg("dtype"), nb::arg("batch"),
        nb::arg("q_seq_len"), nb::arg("kv_seq_len"), nb::arg("q_heads"), nb::arg("kv_heads"),
        nb::arg("head_dim"), nb::arg("head_dim_v"), nb::arg("causal"), nb::arg("scale"),
        nb::arg("iterations"), nb::arg("input_sets"),
        nb::arg("buffers") = std::vector<std::vector<uintptr_t>>(), nb::arg("device") = 0,
        "Times every cuDNN plan of one SDPA graph alone (CUDA events, a private stream): a "
        "list of {plan, name, workspace_bytes, ms, host_us, error}, the heuristics' order. "
        "buffers: per input set, device pointers q, k, v, o, stats[, d_o, dq, dk, dv] the "
        "caller owns; without them, input_sets sets of random values.");
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
