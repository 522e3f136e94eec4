#include "graph/sdpa_graphs.h"

#include <cuda_runtime_api.h>

#include <exception>
#include <string>
#include <unordered_map>
#include <vector>

#include "graph/graph_description.h"
#include "graph/score_mod.h"

namespace jax_sdpa {
namespace {

namespace fe = cudnn_frontend;

ffi::Error FrontendError(fe::error_t status, const char* step, const SdpaConfig& c) {
  return ffi::Error::Internal(std::string("cuDNN frontend ") + step + " failed for " +
                              c.ToString() + ": " + status.get_message());
}

void* Mutable(const void* pointer) { return const_cast<void*>(pointer); }

void AddInputs(const SdpaConfig& c, const std::vector<bool>& tables_read,
               const AttentionInputs& in, std::unordered_map<int64_t, void*>& pack) {
  pack[kQ] = Mutable(in.q);
  pack[kK] = Mutable(in.k);
  pack[kV] = Mutable(in.v);
  if (c.bias_batch > 0) pack[kBias] = Mutable(in.bias);
  if (c.padding) {
    pack[kQLengths] = Mutable(in.q_lengths);
    pack[kKvLengths] = Mutable(in.kv_lengths);
  }
  if (c.segment_mask) {
    pack[kQSegmentIds] = Mutable(in.q_segment_ids);
    pack[kKvSegmentIds] = Mutable(in.kv_segment_ids);
  }
  if (c.ragged) {
    pack[kQOffsets] = Mutable(in.offsets.q);
    pack[kKOffsets] = Mutable(in.offsets.k);
    pack[kVOffsets] = Mutable(in.offsets.v);
    pack[kOOffsets] = Mutable(in.offsets.o);
    pack[kStatsOffsets] = Mutable(in.offsets.stats);
  }
  if (c.page_size > 0) {
    pack[kKPageTable] = Mutable(in.page_table);
    pack[kVPageTable] = Mutable(in.page_table);
  }
  if (c.dropout > 0) {
    pack[kDropoutSeed] = Mutable(in.dropout_seed);
    pack[kDropoutOffset] = static_cast<char*>(Mutable(in.dropout_seed)) + 8;
  }
  for (size_t i = 0; i < tables_read.size(); ++i) {  // [batch, tables, heads]: table i's column
    if (tables_read[i]) {
      pack[kScoreModTables + i] =
          static_cast<float*>(Mutable(in.score_mod_tables)) + i * c.q_heads;
    }
  }
}

// An FP8 call's scale factors and amaxes, one row of kFp8ScaleRow floats each.
void AddFp8Buffers(const SdpaConfig& c, const Fp8Buffers& fp8,
                   std::unordered_map<int64_t, void*>& pack) {
  if (!IsFp8(c.element_type)) return;
  for (int64_t i = 0; i < Fp8ScaleCount(c.direction); ++i) {
    pack[kFp8Scales + i] = Mutable(fp8.scales + i * kFp8ScaleRow);
  }
  for (int64_t i = 0; i < Fp8AmaxCount(c.direction); ++i) {
    pack[kFp8Amaxes + i] = fp8.amaxes + i * kFp8ScaleRow;
  }
}

}  // namespace

struct SdpaGraph::Frontend {
  std::shared_ptr<fe::graph::Graph> graph;
};

SdpaGraph::SdpaGraph(const SdpaConfig& config, std::unique_ptr<Frontend> frontend,
                     int64_t workspace_size)
    : config_(config),
      frontend_(std::move(frontend)),
      workspace_size_(workspace_size),
      score_mod_tables_read_(ScoreModTablesRead(config)) {}

SdpaGraph::~SdpaGraph() = default;

ffi::ErrorOr<std::shared_ptr<SdpaGraph>> SdpaGraph::Build(const SdpaConfig& config,
                                                          cudnnHandle_t handle) {
  try {
    auto frontend = std::make_unique<Frontend>();
    frontend->graph = DescribeSdpaGraph(config);
    fe::graph::Graph& graph = *frontend->graph;
    // The steps of Graph::build, one at a time so that an error names the step that failed.
    fe::error_t status = graph.validate();
    if (status.is_bad()) return Failure{FrontendError(status, "validate", config)};
    status = graph.build_operation_graph(handle);
    if (status.is_bad()) return Failure{FrontendError(status, "build_operation_graph", config)};
    status = graph.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (status.is_bad()) return Failure{FrontendError(status, "create_execution_plans", config)};
    status = graph.check_support(handle);
    if (status.is_bad()) return Failure{FrontendError(status, "check_support", config)};
    status = graph.build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
    if (status.is_bad()) return Failure{FrontendError(status, "build_plans", config)};
    int64_t workspace_size = 0;
    status = graph.get_workspace_size(workspace_size);
    if (status.is_bad()) return Failure{FrontendError(status, "get_workspace_size", config)};
    return std::shared_ptr<SdpaGraph>(
        new SdpaGraph(config, std::move(frontend), workspace_size));
  } catch (const std::exception& e) {
    return Failure{ffi::Error::Internal(std::string("cuDNN frontend threw while building ") +
                                        config.ToString() + ": " + e.what())};
  }
}

namespace {

// Unbinds a handle from its stream for a scope. The frontend's deserialize "warms up" the plan
// by capturing an execution into a throwaway CUDA graph on the handle's stream; unbound, it
// does so on a stream of its own instead of XLA's.
class UnboundStream {
 public:
  explicit UnboundStream(cudnnHandle_t handle) : handle_(handle) {
    if (cudnnGetStream(handle_, &stream_) == CUDNN_STATUS_SUCCESS) {
      cudnnSetStream(handle_, nullptr);
    }
  }
  ~UnboundStream() { cudnnSetStream(handle_, stream_); }
  UnboundStream(const UnboundStream&) = delete;
  UnboundStream& operator=(const UnboundStream&) = delete;

 private:
  cudnnHandle_t handle_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

ffi::ErrorOr<std::shared_ptr<SdpaGraph>> SdpaGraph::Load(const SdpaConfig& config,
                                                         cudnnHandle_t handle,
                                                         const std::vector<uint8_t>& bytes) {
  try {
    UnboundStream unbound(handle);
    auto frontend = std::make_unique<Frontend>();
    frontend->graph = std::make_shared<fe::graph::Graph>();
    fe::error_t status = frontend->graph->deserialize(handle, bytes);
    if (status.is_bad()) return Failure{FrontendError(status, "deserialize", config)};
    int64_t workspace_size = 0;
    status = frontend->graph->get_workspace_size(workspace_size);
    if (status.is_bad()) return Failure{FrontendError(status, "get_workspace_size", config)};
    return std::shared_ptr<SdpaGraph>(
        new SdpaGraph(config, std::move(frontend), workspace_size));
  } catch (const std::exception& e) {  // the frontend's JSON parser throws on bad bytes
    return Failure{ffi::Error::Internal(std::string("cuDNN frontend threw while loading ") +
                                        config.ToString() + ": " + e.what())};
  }
}

ffi::ErrorOr<std::vector<uint8_t>> SdpaGraph::Serialize() const {
  try {
    std::vector<uint8_t> bytes;
    fe::error_t status = frontend_->graph->serialize(bytes);
    if (status.is_bad()) return Failure{FrontendError(status, "serialize", config_)};
    return bytes;
  } catch (const std::exception& e) {
    return Failure{ffi::Error::Internal(std::string("cuDNN frontend threw while serializing ") +
                                        config_.ToString() + ": " + e.what())};
  }
}

std::string SdpaGraph::DiskKey(const SdpaConfig& config) {
  cudaDeviceProp properties{};
  std::string gpu = "unknown";
  if (cudaGetDeviceProperties(&properties, config.device) == cudaSuccess) {
    gpu = std::string(properties.name) + " sm" + std::to_string(properties.major) +
          std::to_string(properties.minor) + " x" +
          std::to_string(properties.multiProcessorCount);
  }
  return "config " + config.Key() + " cudnn " + std::to_string(cudnnGetVersion()) +
         " frontend " + std::to_string(CUDNN_FRONTEND_VERSION) + " gpu " + gpu;
}

ffi::Error SdpaGraph::Execute(cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack,
                              void* workspace) const {
  std::lock_guard<std::mutex> guard(execute_mutex_);
  fe::error_t status = frontend_->graph->execute(handle, pack, workspace);
  if (status.is_bad()) return FrontendError(status, "execute", config_);
  return ffi::Error::Success();
}

ffi::Error SdpaGraph::ExecuteForward(cudnnHandle_t handle, const ForwardBuffers& b,
                                     void* workspace) const {
  std::unordered_map<int64_t, void*> pack = {{kO, b.o}, {kStats, b.stats}};
  AddInputs(config_, score_mod_tables_read_, b.in, pack);
  AddFp8Buffers(config_, b.fp8, pack);
  return Execute(handle, pack, workspace);
}

ffi::Error SdpaGraph::ExecuteBackward(cudnnHandle_t handle, const BackwardBuffers& b,
                                      void* workspace) const {
  std::unordered_map<int64_t, void*> pack = {
      {kO, Mutable(b.o)}, {kDO, Mutable(b.d_o)}, {kStats, Mutable(b.stats)},
      {kDQ, b.dq},        {kDK, b.dk},           {kDV, b.dv}};
  AddInputs(config_, score_mod_tables_read_, b.in, pack);
  if (config_.bias_batch > 0 && config_.bias_grad) pack[kDBias] = b.dbias;
  AddFp8Buffers(config_, b.fp8, pack);
  return Execute(handle, pack, workspace);
}

}  // namespace jax_sdpa
