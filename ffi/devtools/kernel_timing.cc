#include "devtools/kernel_timing.h"

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>

#include "common/device_memory.h"
#include "graph/graph_description.h"
#include "graph/sdpa_graphs.h"

namespace jax_sdpa {
namespace {

namespace fe = cudnn_frontend;

// What a timing run owns: its device, stream, cuDNN handle and buffers, released in reverse.
class Session {
 public:
  ~Session() {
    buffers_.clear();
    if (handle_ != nullptr) cudnnDestroy(handle_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (previous_device_ >= 0) cudaSetDevice(previous_device_);
  }

  ffi::Error Open(int32_t device) {
    JAX_SDPA_CUDA_CHECK(cudaGetDevice(&previous_device_));
    JAX_SDPA_CUDA_CHECK(cudaSetDevice(device));
    JAX_SDPA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    JAX_SDPA_CUDNN_CHECK(cudnnCreate(&handle_));
    JAX_SDPA_CUDNN_CHECK(cudnnSetStream(handle_, stream_));
    return ffi::Error::Success();
  }

  // A new buffer of `bytes`, filled with `fill` repeated (or zeros when fill is empty).
  ffi::Error Allocate(int64_t bytes, const std::vector<uint16_t>& fill, void** out) {
    buffers_.push_back(std::make_unique<DeviceMemory>());
    JAX_SDPA_RETURN_IF_ERROR(buffers_.back()->Allocate(bytes));
    *out = buffers_.back()->data();
    if (fill.empty()) {
      JAX_SDPA_CUDA_CHECK(cudaMemset(*out, 0, bytes));
      return ffi::Error::Success();
    }
    int64_t chunk = static_cast<int64_t>(fill.size() * sizeof(uint16_t));
    for (int64_t offset = 0; offset < bytes; offset += chunk) {
      JAX_SDPA_CUDA_CHECK(cudaMemcpy(static_cast<char*>(*out) + offset, fill.data(),
                                     std::min(chunk, bytes - offset), cudaMemcpyHostToDevice));
    }
    return ffi::Error::Success();
  }

  // A new buffer holding `bytes` copied from host memory.
  ffi::Error Upload(const void* host, int64_t bytes, void** out) {
    buffers_.push_back(std::make_unique<DeviceMemory>());
    JAX_SDPA_RETURN_IF_ERROR(buffers_.back()->Allocate(bytes));
    *out = buffers_.back()->data();
    JAX_SDPA_CUDA_CHECK(cudaMemcpy(*out, host, bytes, cudaMemcpyHostToDevice));
    return ffi::Error::Success();
  }

  cudaStream_t stream() const { return stream_; }
  cudnnHandle_t handle() const { return handle_; }

 private:
  int previous_device_ = -1;
  cudaStream_t stream_ = nullptr;
  cudnnHandle_t handle_ = nullptr;
  std::vector<std::unique_ptr<DeviceMemory>> buffers_;
};

// Bits of a float in [-2, 2] as IEEE half (values below half's normal range become zero) or
// bfloat16 (truncated): enough for timing inputs.
uint16_t HalfBits(float value, ElementType type) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (type == ElementType::kBFloat16) return static_cast<uint16_t>(bits >> 16);
  uint32_t sign = (bits >> 16) & 0x8000u;
  int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xFF) - 127 + 15;
  if (exponent <= 0) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent) << 10) |
                               ((bits >> 13) & 0x3FFu));
}

// 64 Ki random 16-bit values, repeated to fill each input.
std::vector<uint16_t> RandomPattern(ElementType type) {
  std::mt19937 generator(1234);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  std::vector<uint16_t> pattern(1 << 16);
  for (auto& value : pattern) value = HalfBits(uniform(generator), type);
  return pattern;
}

// One input set: device pointers by tensor uid, for the forward and the backward.
struct InputSet {
  std::unordered_map<int64_t, void*> forward, backward;
};

void AssignSet(void* q, void* k, void* v, void* o, void* stats, InputSet* set) {
  set->forward = {{kQ, q}, {kK, k}, {kV, v}, {kO, o}, {kStats, stats}};
  set->backward = set->forward;
}

void AssignBackward(void* d_o, void* dq, void* dk, void* dv, InputSet* set) {
  set->backward[kDO] = d_o;
  set->backward[kDQ] = dq;
  set->backward[kDK] = dk;
  set->backward[kDV] = dv;
}

// The ragged layout's device tables, shared by every input set: each entry's length (queries
// and keys alike) and the element offsets of its first token in Q, K, V, O and the stats.
struct RaggedTables {
  void* lengths = nullptr;
  RaggedOffsets offsets;
};

ffi::ErrorOr<RaggedTables> UploadRaggedTables(Session& session, const SdpaConfig& c,
                                              const std::vector<int32_t>& lengths) {
  std::vector<int64_t> starts{0};  // token offset of each entry, then the total
  for (int32_t length : lengths) starts.push_back(starts.back() + length);
  if (starts.back() > c.total_q_tokens || starts.back() > c.total_kv_tokens) {
    return Failure{ffi::Error::InvalidArgument(
        "jax_sdpa: the documents hold " + std::to_string(starts.back()) +
        " tokens, more than the config's " + std::to_string(c.total_q_tokens))};
  }
  auto scaled = [&](int64_t per_token) {
    std::vector<int32_t> out;
    for (int64_t start : starts) out.push_back(static_cast<int32_t>(start * per_token));
    return out;
  };
  std::vector<std::vector<int32_t>> tables = {
      scaled(c.q_heads * c.head_dim), scaled(c.kv_heads * c.head_dim),
      scaled(c.kv_heads * c.head_dim_v), scaled(c.q_heads * c.head_dim_v), scaled(c.q_heads)};
  std::vector<void*> device(tables.size());
  for (size_t i = 0; i < tables.size(); ++i) {
    JAX_SDPA_RETURN_IF_ERROR(
        session.Upload(tables[i].data(), tables[i].size() * sizeof(int32_t), &device[i]));
  }
  RaggedTables out;
  JAX_SDPA_RETURN_IF_ERROR(
      session.Upload(lengths.data(), lengths.size() * sizeof(int32_t), &out.lengths));
  out.offsets = {device[0], device[1], device[2], device[3], device[4]};
  return out;
}

void AssignRagged(const RaggedTables& tables, InputSet* set) {
  for (auto* pack : {&set->forward, &set->backward}) {
    (*pack)[kQLengths] = tables.lengths;
    (*pack)[kKvLengths] = tables.lengths;
    (*pack)[kQOffsets] = const_cast<void*>(tables.offsets.q);
    (*pack)[kKOffsets] = const_cast<void*>(tables.offsets.k);
    (*pack)[kVOffsets] = const_cast<void*>(tables.offsets.v);
    (*pack)[kOOffsets] = const_cast<void*>(tables.offsets.o);
    (*pack)[kStatsOffsets] = const_cast<void*>(tables.offsets.stats);
  }
}

// The set's buffers as given: q, k, v, o, stats[, d_o, dq, dk, dv].
ffi::Error GivenSet(const SdpaConfig& c, const BufferSet& given, InputSet* set) {
  size_t expected = c.direction == Direction::kBackward ? 9 : 5;
  if (given.size() != expected) {
    return ffi::Error::InvalidArgument("jax_sdpa: an input set needs " +
                                       std::to_string(expected) + " buffers, got " +
                                       std::to_string(given.size()));
  }
  AssignSet(given[0], given[1], given[2], given[3], given[4], set);
  if (expected == 9) AssignBackward(given[5], given[6], given[7], given[8], set);
  return ffi::Error::Success();
}

ffi::Error AllocateSet(Session& session, const SdpaConfig& c, const std::vector<uint16_t>& random,
                       InputSet* set) {
  const int64_t element = 2;
  // Ragged: every document lives in one [total tokens, heads, dim] array.
  int64_t q_tokens = c.ragged ? c.total_q_tokens : c.batch * c.q_seq_len;
  int64_t kv_tokens = c.ragged ? c.total_kv_tokens : c.batch * c.kv_seq_len;
  int64_t q_bytes = q_tokens * c.q_heads * c.head_dim * element;
  int64_t k_bytes = kv_tokens * c.kv_heads * c.head_dim * element;
  int64_t v_bytes = kv_tokens * c.kv_heads * c.head_dim_v * element;
  int64_t o_bytes = q_tokens * c.q_heads * c.head_dim_v * element;
  int64_t stats_bytes = q_tokens * c.q_heads * 4;
  void *q, *k, *v, *o, *stats;
  JAX_SDPA_RETURN_IF_ERROR(session.Allocate(q_bytes, random, &q));
  JAX_SDPA_RETURN_IF_ERROR(session.Allocate(k_bytes, random, &k));
  JAX_SDPA_RETURN_IF_ERROR(session.Allocate(v_bytes, random, &v));
  JAX_SDPA_RETURN_IF_ERROR(session.Allocate(o_bytes, {}, &o));
  JAX_SDPA_RETURN_IF_ERROR(session.Allocate(stats_bytes, {}, &stats));
  AssignSet(q, k, v, o, stats, set);
  if (c.direction == Direction::kBackward) {
    void *d_o, *dq, *dk, *dv;
    JAX_SDPA_RETURN_IF_ERROR(session.Allocate(o_bytes, random, &d_o));
    JAX_SDPA_RETURN_IF_ERROR(session.Allocate(q_bytes, {}, &dq));
    JAX_SDPA_RETURN_IF_ERROR(session.Allocate(k_bytes, {}, &dk));
    JAX_SDPA_RETURN_IF_ERROR(session.Allocate(v_bytes, {}, &dv));
    AssignBackward(d_o, dq, dk, dv, set);
  }
  return ffi::Error::Success();
}

ffi::Error FrontendError(fe::error_t status, const char* step, const SdpaConfig& c) {
  return ffi::Error::Internal(std::string("cuDNN frontend ") + step + " failed for " +
                              c.ToString() + ": " + status.get_message());
}

// The config's graph with every plan cuDNN's heuristics offer (modes A, B and fallback) built
// where cuDNN can, in the heuristics' order of preference.
ffi::ErrorOr<std::shared_ptr<fe::graph::Graph>> BuildAllPlans(
    const SdpaConfig& c, ForwardImplementation implementation, cudnnHandle_t handle) {
  auto graph = DescribeSdpaGraph(c, implementation);
  fe::error_t status = graph->validate();
  if (status.is_bad()) return Failure{FrontendError(status, "validate", c)};
  status = graph->build_operation_graph(handle);
  if (status.is_bad()) return Failure{FrontendError(status, "build_operation_graph", c)};
  status = graph->create_execution_plans(
      {fe::HeurMode_t::A, fe::HeurMode_t::B, fe::HeurMode_t::FALLBACK});
  if (status.is_bad()) return Failure{FrontendError(status, "create_execution_plans", c)};
  status = graph->check_support(handle);
  if (status.is_bad()) return Failure{FrontendError(status, "check_support", c)};
  status = graph->build_plans(handle, fe::BuildPlanPolicy_t::ALL);
  if (status.is_bad()) return Failure{FrontendError(status, "build_plans", c)};
  return graph;
}

ffi::Error ExecutePlan(fe::graph::Graph& graph, const SdpaConfig& c, Session& session,
                       InputSet& set, void* workspace, int64_t plan) {
  auto& pack = c.direction == Direction::kForward ? set.forward : set.backward;
  fe::error_t status = graph.execute_plan_at_index(session.handle(), pack, workspace, plan);
  if (status.is_bad()) return FrontendError(status, "execute_plan_at_index", c);
  return ffi::Error::Success();
}

// Times one plan: two warm-up executions, then `iterations` between two events.
ffi::Error TimePlan(fe::graph::Graph& graph, const SdpaConfig& c, Session& session,
                    std::vector<InputSet>& sets, void* workspace, int64_t iterations,
                    PlanTiming* timing) {
  for (int64_t i = 0; i < 2; ++i) {
    JAX_SDPA_RETURN_IF_ERROR(
        ExecutePlan(graph, c, session, sets[i % sets.size()], workspace, timing->plan));
  }
  cudaEvent_t start, stop;
  JAX_SDPA_CUDA_CHECK(cudaEventCreate(&start));
  JAX_SDPA_CUDA_CHECK(cudaEventCreate(&stop));
  ffi::Error status = ffi::Error::Success();
  auto host_start = std::chrono::steady_clock::now();
  cudaEventRecord(start, session.stream());
  for (int64_t i = 0; i < iterations && status.success(); ++i) {
    status = ExecutePlan(graph, c, session, sets[i % sets.size()], workspace, timing->plan);
  }
  auto host_stop = std::chrono::steady_clock::now();
  cudaEventRecord(stop, session.stream());
  cudaError_t synced = cudaEventSynchronize(stop);
  float ms = 0;
  if (status.success() && synced == cudaSuccess) cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  JAX_SDPA_RETURN_IF_ERROR(status);
  JAX_SDPA_CUDA_CHECK(synced);
  timing->ms = ms / static_cast<double>(iterations);
  timing->host_us =
      std::chrono::duration<double, std::micro>(host_stop - host_start).count() / iterations;
  return ffi::Error::Success();
}

}  // namespace

ffi::Error TimePlans(const SdpaConfig& config, ForwardImplementation implementation,
                     int64_t iterations, int64_t input_sets, const std::vector<BufferSet>& given,
                     const std::vector<int32_t>& document_lengths,
                     std::vector<PlanTiming>* timings) {
  bool ragged_ok = !config.ragged ||
                   (config.padding && given.empty() &&
                    static_cast<int64_t>(document_lengths.size()) == config.batch);
  if (config.bias_batch > 0 || config.padding != config.ragged || !ragged_ok ||
      config.dropout > 0 || iterations < 1 || input_sets < 1) {
    return ffi::Error::InvalidArgument(
        "jax_sdpa: plan timing takes no bias, lengths (but a ragged layout's, one per entry, "
        "on random inputs) or dropout, and at least one iteration and input set; got " +
        config.ToString());
  }
  Session session;
  JAX_SDPA_RETURN_IF_ERROR(session.Open(config.device));
  RaggedTables ragged;
  if (config.ragged) {
    JAX_SDPA_ASSIGN_OR_RETURN(ragged, UploadRaggedTables(session, config, document_lengths));
  }
  std::vector<InputSet> sets(given.empty() ? static_cast<size_t>(input_sets) : given.size());
  if (given.empty()) {
    std::vector<uint16_t> random = RandomPattern(config.element_type);
    for (InputSet& set : sets) {
      JAX_SDPA_RETURN_IF_ERROR(AllocateSet(session, config, random, &set));
      if (config.ragged) AssignRagged(ragged, &set);
    }
  } else {
    for (size_t i = 0; i < sets.size(); ++i) {
      JAX_SDPA_RETURN_IF_ERROR(GivenSet(config, given[i], &sets[i]));
    }
  }

  if (config.direction == Direction::kBackward) {
    // The backward reads the forward's output and statistics: compute them for every set.
    SdpaConfig forward_config = config;
    forward_config.direction = Direction::kForward;
    forward_config.deterministic = false;
    JAX_SDPA_ASSIGN_OR_RETURN(std::shared_ptr<SdpaGraph> forward,
                              SdpaGraph::Build(forward_config, session.handle()));
    void* workspace = nullptr;
    JAX_SDPA_RETURN_IF_ERROR(session.Allocate(forward->workspace_size(), {}, &workspace));
    for (const InputSet& set : sets) {
      ForwardBuffers buffers;
      buffers.in.q = set.forward.at(kQ);
      buffers.in.k = set.forward.at(kK);
      buffers.in.v = set.forward.at(kV);
      buffers.o = set.forward.at(kO);
      buffers.stats = set.forward.at(kStats);
      if (config.ragged) {
        buffers.in.q_lengths = buffers.in.kv_lengths = ragged.lengths;
        buffers.in.offsets = ragged.offsets;
      }
      JAX_SDPA_RETURN_IF_ERROR(forward->ExecuteForward(session.handle(), buffers, workspace));
    }
  }

  JAX_SDPA_ASSIGN_OR_RETURN(std::shared_ptr<fe::graph::Graph> graph,
                            BuildAllPlans(config, implementation, session.handle()));
  timings->clear();
  for (int64_t plan = 0; plan < graph->get_execution_plan_count(); ++plan) {
    PlanTiming timing;
    timing.plan = plan;
    void* workspace = nullptr;
    ffi::Error status = ffi::Error::Success();
    fe::error_t info = graph->get_workspace_size_plan_at_index(plan, timing.workspace_size);
    if (info.is_good()) info = graph->get_plan_name_at_index(plan, timing.name);
    if (info.is_bad()) status = FrontendError(info, "plan info", config);
    if (status.success()) status = session.Allocate(timing.workspace_size, {}, &workspace);
    if (status.success()) {
      status = TimePlan(*graph, config, session, sets, workspace, iterations, &timing);
    }
    if (status.failure()) timing.error = status.message();
    timings->push_back(timing);
  }
  JAX_SDPA_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  return ffi::Error::Success();
}

}  // namespace jax_sdpa
