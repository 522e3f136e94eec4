#include "sdpa_graphs.h"

#include <cudnn_frontend.h>


#include <exception>
#include <unordered_map>
#include <vector>

namespace jax_sdpa {
namespace {

namespace fe = cudnn_frontend;

enum TensorUid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kBias,
  kDBias,
  kQLengths,
  kKvLengths,
  kDropoutSeed,
  kDropoutOffset,
  kDropoutMask,
};

fe::DataType_t FrontendType(ElementType type) {
  return type == ElementType::kFloat16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

// Logical BHSD dims of a tensor stored as BSHD (JAX's [batch, seq, heads, dim]).
std::vector<int64_t> BhsdDims(int64_t batch, int64_t heads, int64_t seq, int64_t dim) {
  return {batch, heads, seq, dim};
}
std::vector<int64_t> BshdStrides(int64_t heads, int64_t seq, int64_t dim) {
  return {seq * heads * dim, dim, heads * dim, 1};
}

// Stats are float32 [batch, heads, q_seq, 1], contiguous: JAX sees them as [batch, heads, q_seq].
std::vector<int64_t> StatsDims(const SdpaConfig& c) { return {c.batch, c.q_heads, c.q_seq_len, 1}; }
std::vector<int64_t> StatsStrides(const SdpaConfig& c) {
  return {c.q_heads * c.q_seq_len, c.q_seq_len, 1, 1};
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Which [batch, seq, heads, dim] tensor: query-side (Q, O, dO, dQ) or key-side, and its dim.
struct BshdShape {
  int64_t heads, seq, dim;
};
BshdShape QuerySide(const SdpaConfig& c, int64_t dim) { return {c.q_heads, c.q_seq_len, dim}; }
BshdShape KeySide(const SdpaConfig& c, int64_t dim) { return {c.kv_heads, c.kv_seq_len, dim}; }

TensorPtr AddBshdTensor(fe::graph::Graph& graph, const char* name, int64_t uid,
                        const SdpaConfig& c, BshdShape shape) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim(BhsdDims(c.batch, shape.heads, shape.seq, shape.dim))
                          .set_stride(BshdStrides(shape.heads, shape.seq, shape.dim)));
}

void SetBshdOutput(const TensorPtr& tensor, int64_t uid, const SdpaConfig& c, BshdShape shape) {
  tensor->set_output(true)
      .set_uid(uid)
      .set_dim(BhsdDims(c.batch, shape.heads, shape.seq, shape.dim))
      .set_stride(BshdStrides(shape.heads, shape.seq, shape.dim));
}

std::shared_ptr<fe::graph::Graph> NewGraph(const SdpaConfig& c) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(FrontendType(c.element_type))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

TensorPtr AddBias(fe::graph::Graph& graph, const SdpaConfig& c, const char* name, int64_t uid) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({c.bias_batch, c.bias_heads, c.q_seq_len, c.kv_seq_len})
                          .set_stride({c.bias_heads * c.q_seq_len * c.kv_seq_len,
                                       c.q_seq_len * c.kv_seq_len, c.kv_seq_len, 1}));
}

TensorPtr AddLengths(fe::graph::Graph& graph, const SdpaConfig& c, const char* name,
                     int64_t uid) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({c.batch, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT32));
}

TensorPtr AddInt64Scalar(fe::graph::Graph& graph, const char* name, int64_t uid) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({1, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT64));
}

// The masking, bias and dropout options common to SDPA_attributes and
// SDPA_backward_attributes.
template <typename Options>
void SetMasking(fe::graph::Graph& graph, const SdpaConfig& c, Options& options) {
  if (c.window_right >= 0 || c.window_left >= 0) {
    options.set_diagonal_alignment(c.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                                  : fe::DiagonalAlignment_t::TOP_LEFT);
  }
  if (c.window_right >= 0) options.set_diagonal_band_right_bound(static_cast<int>(c.window_right));
  if (c.window_left >= 0) options.set_diagonal_band_left_bound(static_cast<int>(c.window_left));
  if (c.padding) {
    options.set_padding_mask(true)
        .set_seq_len_q(AddLengths(graph, c, "q_lengths", kQLengths))
        .set_seq_len_kv(AddLengths(graph, c, "kv_lengths", kKvLengths));
  }
  if (c.bias_batch > 0) options.set_bias(AddBias(graph, c, "bias", kBias));
  if (c.dropout > 0) {
    options.set_dropout(c.dropout, AddInt64Scalar(graph, "dropout_seed", kDropoutSeed),
                        AddInt64Scalar(graph, "dropout_offset", kDropoutOffset));
  }
}

std::shared_ptr<fe::graph::Graph> DescribeForward(const SdpaConfig& c) {
  auto graph = NewGraph(c);
  auto q = AddBshdTensor(*graph, "Q", kQ, c, QuerySide(c, c.head_dim));
  auto k = AddBshdTensor(*graph, "K", kK, c, KeySide(c, c.head_dim));
  auto v = AddBshdTensor(*graph, "V", kV, c, KeySide(c, c.head_dim_v));
  auto options = fe::graph::SDPA_attributes()
                     .set_name("jax_sdpa_forward")
                     .set_generate_stats(true)
                     .set_attn_scale(c.scale);
  SetMasking(*graph, c, options);
  if (c.dropout > 0 && c.dump_dropout_mask) {
    options.set_rng_dump(graph->tensor(
        fe::graph::Tensor_attributes()
            .set_name("dropout_mask")
            .set_uid(kDropoutMask)
            .set_dim({c.batch, c.q_heads, c.q_seq_len, c.kv_seq_len})
            .set_stride({c.q_heads * c.q_seq_len * c.kv_seq_len, c.q_seq_len * c.kv_seq_len,
                         c.kv_seq_len, 1})
            .set_data_type(fe::DataType_t::FLOAT)));
  }
  auto [o, stats] = graph->sdpa(q, k, v, options);
  SetBshdOutput(o, kO, c, QuerySide(c, c.head_dim_v));
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(StatsDims(c))
      .set_stride(StatsStrides(c));
  return graph;
}

std::shared_ptr<fe::graph::Graph> DescribeBackward(const SdpaConfig& c) {
  auto graph = NewGraph(c);
  auto q = AddBshdTensor(*graph, "Q", kQ, c, QuerySide(c, c.head_dim));
  auto k = AddBshdTensor(*graph, "K", kK, c, KeySide(c, c.head_dim));
  auto v = AddBshdTensor(*graph, "V", kV, c, KeySide(c, c.head_dim_v));
  auto o = AddBshdTensor(*graph, "O", kO, c, QuerySide(c, c.head_dim_v));
  auto d_o = AddBshdTensor(*graph, "dO", kDO, c, QuerySide(c, c.head_dim_v));
  auto stats = graph->tensor(fe::graph::Tensor_attributes()
                                 .set_name("Stats")
                                 .set_uid(kStats)
                                 .set_dim(StatsDims(c))
                                 .set_stride(StatsStrides(c))
                                 .set_data_type(fe::DataType_t::FLOAT));
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("jax_sdpa_backward")
                     .set_attn_scale(c.scale)
                     .set_deterministic_algorithm(c.deterministic);
  SetMasking(*graph, c, options);
  if (c.bias_batch > 0 && c.bias_grad) {
    auto dbias = AddBias(*graph, c, "dbias", kDBias);
    dbias->set_output(true);
    options.set_dbias(dbias);
  }
  auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, d_o, stats, options);
  SetBshdOutput(dq, kDQ, c, QuerySide(c, c.head_dim));
  SetBshdOutput(dk, kDK, c, KeySide(c, c.head_dim));
  SetBshdOutput(dv, kDV, c, KeySide(c, c.head_dim_v));
  return graph;
}

ffi::Error FrontendError(fe::error_t status, const char* step, const SdpaConfig& c) {
  return ffi::Error::Internal(std::string("cuDNN frontend ") + step + " failed for " +
                              c.ToString() + ": " + status.get_message());
}

void AddInputs(const SdpaConfig& c, const AttentionInputs& in,
               std::unordered_map<int64_t, void*>& pack) {
  pack[kQ] = const_cast<void*>(in.q);
  pack[kK] = const_cast<void*>(in.k);
  pack[kV] = const_cast<void*>(in.v);
  if (c.bias_batch > 0) pack[kBias] = const_cast<void*>(in.bias);
  if (c.padding) {
    pack[kQLengths] = const_cast<void*>(in.q_lengths);
    pack[kKvLengths] = const_cast<void*>(in.kv_lengths);
  }
  if (c.dropout > 0) {
    pack[kDropoutSeed] = const_cast<void*>(in.dropout_seed);
    pack[kDropoutOffset] = static_cast<char*>(const_cast<void*>(in.dropout_seed)) + 8;
  }
}

}  // namespace

struct SdpaGraph::Frontend {
  std::shared_ptr<fe::graph::Graph> graph;
};

SdpaGraph::SdpaGraph(const SdpaConfig& config, std::unique_ptr<Frontend> frontend,
                     int64_t workspace_size)
    : config_(config), frontend_(std::move(frontend)), workspace_size_(workspace_size) {}

SdpaGraph::~SdpaGraph() = default;

ffi::Error SdpaGraph::Build(const SdpaConfig& config, cudnnHandle_t handle,
                            std::shared_ptr<SdpaGraph>* out) {
  return BuildWithPlans(config, handle, /*all_plans=*/false, out);
}

ffi::Error SdpaGraph::BuildAllPlans(const SdpaConfig& config, cudnnHandle_t handle,
                                    std::shared_ptr<SdpaGraph>* out) {
  return BuildWithPlans(config, handle, /*all_plans=*/true, out);
}

ffi::Error SdpaGraph::BuildWithPlans(const SdpaConfig& config, cudnnHandle_t handle,
                                     bool all_plans, std::shared_ptr<SdpaGraph>* out) {
  try {
    auto frontend = std::make_unique<Frontend>();
    frontend->graph = config.direction == Direction::kForward ? DescribeForward(config)
                                                              : DescribeBackward(config);
    fe::graph::Graph& graph = *frontend->graph;
    // The steps of Graph::build, one at a time so that an error names the step that failed.
    fe::error_t status = graph.validate();
    if (status.is_bad()) return FrontendError(status, "validate", config);
    status = graph.build_operation_graph(handle);
    if (status.is_bad()) return FrontendError(status, "build_operation_graph", config);
    std::vector<fe::HeurMode_t> modes = {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK};
    if (all_plans) modes = {fe::HeurMode_t::A, fe::HeurMode_t::B, fe::HeurMode_t::FALLBACK};
    status = graph.create_execution_plans(modes);
    if (status.is_bad()) return FrontendError(status, "create_execution_plans", config);
    status = graph.check_support(handle);
    if (status.is_bad()) return FrontendError(status, "check_support", config);
    status = graph.build_plans(handle, all_plans ? fe::BuildPlanPolicy_t::ALL
                                                 : fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
    if (status.is_bad()) return FrontendError(status, "build_plans", config);
    int64_t workspace_size = 0;
    status = graph.get_workspace_size(workspace_size);
    if (status.is_bad()) return FrontendError(status, "get_workspace_size", config);
    out->reset(new SdpaGraph(config, std::move(frontend), workspace_size));
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("cuDNN frontend threw while building ") +
                                config.ToString() + ": " + e.what());
  }
}

int64_t SdpaGraph::plan_count() const { return frontend_->graph->get_execution_plan_count(); }

ffi::Error SdpaGraph::PlanInfo(int64_t index, std::string* name, int64_t* workspace_size) const {
  fe::error_t status = frontend_->graph->get_workspace_size_plan_at_index(index, *workspace_size);
  if (status.is_bad()) return FrontendError(status, "get_workspace_size_plan_at_index", config_);
  status = frontend_->graph->get_plan_name_at_index(index, *name);
  if (status.is_bad()) return FrontendError(status, "get_plan_name_at_index", config_);
  return ffi::Error::Success();
}

ffi::Error SdpaGraph::Execute(cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack,
                              void* workspace, int64_t plan) {
  fe::error_t status = plan == kPreferredPlan
                           ? frontend_->graph->execute(handle, pack, workspace)
                           : frontend_->graph->execute_plan_at_index(handle, pack, workspace, plan);
  if (status.is_bad()) return FrontendError(status, "execute", config_);
  return ffi::Error::Success();
}

ffi::Error SdpaGraph::ExecuteForward(cudnnHandle_t handle, const ForwardBuffers& b,
                                     void* workspace, int64_t plan) {
  std::unordered_map<int64_t, void*> pack = {{kO, b.o}, {kStats, b.stats}};
  AddInputs(config_, b.in, pack);
  if (config_.dropout > 0 && config_.dump_dropout_mask) pack[kDropoutMask] = b.dropout_mask;
  return Execute(handle, pack, workspace, plan);
}

ffi::Error SdpaGraph::ExecuteBackward(cudnnHandle_t handle, const BackwardBuffers& b,
                                      void* workspace, int64_t plan) {
  std::unordered_map<int64_t, void*> pack = {
      {kO, const_cast<void*>(b.o)}, {kDO, const_cast<void*>(b.d_o)},
      {kStats, const_cast<void*>(b.stats)}, {kDQ, b.dq}, {kDK, b.dk}, {kDV, b.dv}};
  AddInputs(config_, b.in, pack);
  if (config_.bias_batch > 0 && config_.bias_grad) pack[kDBias] = b.dbias;
  return Execute(handle, pack, workspace, plan);
}

}  // namespace jax_sdpa
