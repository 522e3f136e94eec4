// The developer tools' Python module (jax_sdpa._sdpa_devtools), kept out of the product
// extension: benchmarks/plans.py times every cuDNN plan of one SDPA graph alone through it,
// tests read and write graph files (graph_files.h) without a GPU and run our targets with
// poisoned results (poisoned_targets.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "graph/graph_files.h"
#include "devtools/kernel_timing.h"
#include "devtools/poisoned_targets.h"

namespace nb = nanobind;

namespace {

// benchmarks/plans.py's entry: every plan of one unmasked or causal SDPA graph (dense, or
// the ragged layout of packed documents), timed alone.
nb::list TimePlans(const std::string& direction, const std::string& dtype, int64_t batch,
                   int64_t q_seq_len, int64_t kv_seq_len, int64_t q_heads, int64_t kv_heads,
                   int64_t head_dim, int64_t head_dim_v, bool causal, float scale,
                   int64_t iterations, int64_t input_sets,
                   const std::vector<std::vector<uintptr_t>>& buffers, int32_t device,
                   const std::vector<int32_t>& document_lengths, int64_t total_tokens,
                   const std::string& implementation) {
  jax_sdpa::SdpaConfig c;
  if ((direction != "forward" && direction != "backward") ||
      (dtype != "float16" && dtype != "bfloat16") ||
      (implementation != "auto" && implementation != "composite" &&
       implementation != "unified") ||
      (direction == "backward" && implementation != "auto")) {
    throw std::invalid_argument(
        "direction must be forward|backward, dtype float16|bfloat16 and implementation "
        "auto|composite|unified (forward only), got " + direction + ", " + dtype + ", " +
        implementation);
  }
  jax_sdpa::ForwardImplementation forced =
      implementation == "unified"     ? jax_sdpa::ForwardImplementation::kUnified
      : implementation == "composite" ? jax_sdpa::ForwardImplementation::kComposite
                                      : jax_sdpa::ForwardImplementation::kAuto;
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
  if (!document_lengths.empty()) {  // the ragged layout: batch counts entries (documents)
    c.padding = c.ragged = true;
    c.total_q_tokens = c.total_kv_tokens = total_tokens;
  }
  std::vector<jax_sdpa::BufferSet> given;
  for (const auto& set : buffers) {
    given.emplace_back();
    for (uintptr_t pointer : set) given.back().push_back(reinterpret_cast<void*>(pointer));
  }
  std::vector<jax_sdpa::PlanTiming> timings;
  xla::ffi::Error status;
  {
    nb::gil_scoped_release released;  // seconds of GPU work
    status = jax_sdpa::TimePlans(c, forced, iterations, input_sets, given, document_lengths,
                                 &timings);
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

// Our targets' poisoned twins: {name + "_poisoned": stages}, each running the product's
// instantiate stage and, after poisoning the results, its execute stage.
nb::dict PoisonedRegistrations(const nb::dict& product) {
  if (product.size() > static_cast<size_t>(jax_sdpa::kPoisonedSlots)) {
    throw std::invalid_argument("more targets than poisoned slots");
  }
  nb::dict result;
  int slot = 0;
  for (auto [name, stages] : product) {
    nb::dict given = nb::cast<nb::dict>(stages);
    auto* execute =
        reinterpret_cast<XLA_FFI_Handler*>(nb::cast<nb::capsule>(given["execute"]).data());
    jax_sdpa::SetPoisonedTarget(slot, execute);
    nb::dict poisoned;
    poisoned["instantiate"] = given["instantiate"];
    poisoned["execute"] =
        nb::capsule(reinterpret_cast<void*>(jax_sdpa::PoisonedHandler(slot++)));
    result[nb::str((nb::cast<std::string>(name) + "_poisoned").c_str())] = poisoned;
  }
  return result;
}

NB_MODULE(_sdpa_devtools, m) {
  m.def("poisoned_registrations", &PoisonedRegistrations, nb::arg("registrations"),
        "Tests: the product's FFI registrations (_sdpa_ffi.registrations()) wrapped so that "
        "every result is NaN-filled before the handler runs, under name + '_poisoned'.");
  m.def("time_plans", &TimePlans, nb::arg("direction"), nb::arg("dtype"), nb::arg("batch"),
        nb::arg("q_seq_len"), nb::arg("kv_seq_len"), nb::arg("q_heads"), nb::arg("kv_heads"),
        nb::arg("head_dim"), nb::arg("head_dim_v"), nb::arg("causal"), nb::arg("scale"),
        nb::arg("iterations"), nb::arg("input_sets"),
        nb::arg("buffers") = std::vector<std::vector<uintptr_t>>(), nb::arg("device") = 0,
        nb::arg("document_lengths") = std::vector<int32_t>(), nb::arg("total_tokens") = 0,
        nb::arg("implementation") = "auto",
        "Times every cuDNN plan of one SDPA graph alone (CUDA events, a private stream): a "
        "list of {plan, name, workspace_bytes, ms, host_us, error}, the heuristics' order. "
        "buffers: per input set, device pointers q, k, v, o, stats[, d_o, dq, dk, dv] the "
        "caller owns; without them, input_sets sets of random values. document_lengths (one "
        "per entry, batch entries; random inputs only) makes it the ragged layout's graph, "
        "its arrays [total_tokens, heads, dim] with the documents packed from token 0. "
        "implementation: the frontend's SDPA forward implementation (auto, composite, "
        "unified; set_implementation).");
  m.def(
      "write_graph_file",
      [](const std::string& directory, const std::string& key, const nb::bytes& payload) {
        const auto* data = static_cast<const uint8_t*>(payload.data());
        return jax_sdpa::GraphFiles(directory).Write(
            key, std::vector<uint8_t>(data, data + payload.size()));
      },
      "Writes payload under key in a graph files directory; False on failure.");
  m.def(
      "read_graph_file",
      [](const std::string& directory, const std::string& key) -> std::optional<nb::bytes> {
        auto payload = jax_sdpa::GraphFiles(directory).Read(key);
        if (!payload) return std::nullopt;
        return nb::bytes(reinterpret_cast<const char*>(payload->data()), payload->size());
      },
      "The payload under key, or None when no usable file holds it.");
  m.def(
      "graph_file_path",
      [](const std::string& directory, const std::string& key) {
        return jax_sdpa::GraphFiles(directory).PathOf(key);
      },
      "The file a key is stored in.");
}
