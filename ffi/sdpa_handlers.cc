#include "sdpa_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <string>

#include "call_state.h"
#include "check.h"
#include "cudnn_handles.h"
#include "graph_cache.h"
#include "sdpa_config.h"
#include "sdpa_graphs.h"

namespace jax_sdpa {
namespace {

// The attributes both handlers take.
struct Options {
  float scale;
  int64_t window_left;
  int64_t window_right;
  bool bottom_right;
  bool has_bias;
  bool has_lengths;
  bool bias_grad;
  bool deterministic;
  float dropout;
  bool dump_dropout_mask;
  bool poison_outputs;
  bool command_buffer;  // registered as command-buffer compatible: the call owns its workspace
};

std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

ffi::Error BadArgument(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_sdpa: " + message);
}

ffi::Error ReadElementType(const ffi::AnyBuffer& buffer, const char* name, ElementType* type) {
  switch (buffer.element_type()) {
    case ffi::DataType::F16:
      *type = ElementType::kFloat16;
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      *type = ElementType::kBFloat16;
      return ffi::Error::Success();
    default:
      return BadArgument(std::string(name) + " must be float16 or bfloat16");
  }
}

// How one call maps onto a cached graph: the config, and how many times the graph runs, each
// time on the next 1/repeats of every operand.
struct CallPlan {
  SdpaConfig config;
  int64_t repeats = 1;
};

// The optional inputs after the fixed ones: [bias], [q_lengths, kv_lengths], [dropout_seed].
struct OptionalInputs {
  std::optional<ffi::AnyBuffer> bias, q_lengths, kv_lengths, dropout_seed;
};

ffi::Error PlanCall(Direction direction, int32_t device, const ffi::AnyBuffer& q,
                    const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                    const OptionalInputs& optional, const Options& options, CallPlan* plan) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  size_t rank = qd.size();
  if (rank < 4 || kd.size() != rank || vd.size() != rank) {
    return BadArgument("query, key and value must share one rank >= 4, got " + DimsToString(qd) +
                       ", " + DimsToString(kd) + ", " + DimsToString(vd));
  }
  int64_t vmapped = 1;  // product of the leading (vmap) axes
  for (size_t i = 0; i + 4 < rank; ++i) {
    if (qd[i] != kd[i]) return BadArgument("query and key leading axes differ");
    vmapped *= qd[i];
  }
  int64_t batch = qd[rank - 4];
  SdpaConfig& c = plan->config;
  c.direction = direction;
  c.device = device;
  JAX_SDPA_RETURN_IF_ERROR(ReadElementType(q, "query", &c.element_type));
  ElementType k_type, v_type;
  JAX_SDPA_RETURN_IF_ERROR(ReadElementType(k, "key", &k_type));
  JAX_SDPA_RETURN_IF_ERROR(ReadElementType(v, "value", &v_type));
  bool same_kv = true;  // key and value agree on every axis but head_dim
  for (size_t i = 0; i + 1 < rank; ++i) same_kv &= kd[i] == vd[i];
  if (k_type != c.element_type || v_type != c.element_type || !same_kv ||
      kd[rank - 4] != batch || kd[rank - 1] != qd[rank - 1] || kd[rank - 2] == 0 ||
      qd[rank - 2] % kd[rank - 2] != 0) {
    return BadArgument("query " + DimsToString(qd) + ", key " + DimsToString(kd) + " and value " +
                       DimsToString(vd) + " do not form one attention problem");
  }
  c.q_seq_len = qd[rank - 3];
  c.kv_seq_len = kd[rank - 3];
  c.q_heads = qd[rank - 2];
  c.kv_heads = kd[rank - 2];
  c.head_dim = qd[rank - 1];
  c.head_dim_v = vd[rank - 1];
  c.scale = options.scale;
  c.window_left = options.window_left;
  c.window_right = options.window_right;
  c.bottom_right = options.bottom_right;
  c.deterministic = direction == Direction::kBackward && options.deterministic;
  c.padding = optional.q_lengths.has_value();
  if (c.padding) {
    for (const ffi::AnyBuffer* lengths : {&*optional.q_lengths, &*optional.kv_lengths}) {
      if (lengths->element_type() != ffi::DataType::S32 ||
          static_cast<int64_t>(lengths->element_count()) != vmapped * batch) {
        return BadArgument("sequence lengths must be int32 [batch], got " +
                           DimsToString(lengths->dimensions()));
      }
    }
  }
  c.dropout = options.dropout;
  c.dump_dropout_mask = direction == Direction::kForward && options.dump_dropout_mask;
  if (c.dropout > 0) {
    const ffi::AnyBuffer& seed = *optional.dropout_seed;
    if (seed.element_type() != ffi::DataType::U32 ||
        static_cast<int64_t>(seed.element_count()) != vmapped * 4) {
      return BadArgument("the dropout seed must be uint32 [4], got " +
                         DimsToString(seed.dimensions()));
    }
  }
  // The graph runs once per vmapped slice when a slice's operands cannot be folded into one
  // batch: a bias shared by the slice's batch (no single batch stride says that), or a dropout
  // seed per slice.
  bool shared_bias = optional.bias && optional.bias->dimensions()[rank - 4] == 1 && batch > 1;
  bool per_slice = vmapped > 1 && (shared_bias || c.dropout > 0);
  plan->repeats = per_slice ? vmapped : 1;
  c.batch = per_slice ? batch : vmapped * batch;
  if (optional.bias) {
    auto bd = optional.bias->dimensions();
    ElementType bias_type;
    JAX_SDPA_RETURN_IF_ERROR(ReadElementType(*optional.bias, "bias", &bias_type));
    int64_t bias_vmapped = 1;
    for (size_t i = 0; bd.size() == rank && i + 4 < rank; ++i) bias_vmapped *= bd[i];
    if (bd.size() != rank || bias_type != c.element_type || bias_vmapped != vmapped ||
        (bd[rank - 4] != 1 && bd[rank - 4] != batch) ||
        (bd[rank - 3] != 1 && bd[rank - 3] != c.q_heads) || bd[rank - 2] != c.q_seq_len ||
        bd[rank - 1] != c.kv_seq_len) {
      return BadArgument("bias " + DimsToString(bd) + " must be [1|batch, 1|heads, q_seq, "
                         "kv_seq] in the inputs' dtype, for query " + DimsToString(qd));
    }
    c.bias_heads = bd[rank - 3];
    c.bias_batch = per_slice ? bd[rank - 4] : bd[rank - 4] * vmapped;
    c.bias_grad = direction == Direction::kBackward && options.bias_grad;
  }
  return ffi::Error::Success();
}

ffi::Error ExpectShape(const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& like, const char* name) {
  if (buffer.element_type() != like.element_type() ||
      buffer.element_count() != like.element_count()) {
    return BadArgument(std::string(name) + " " + DimsToString(buffer.dimensions()) +
                       " does not match " + DimsToString(like.dimensions()));
  }
  return ffi::Error::Success();
}

// The output (and its cotangent): the query's shape with the value's head_dim.
ffi::Error ExpectOutputShape(const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& q,
                             const CallPlan& plan, const char* name) {
  const SdpaConfig& c = plan.config;
  if (buffer.element_type() != q.element_type() ||
      static_cast<int64_t>(buffer.element_count()) !=
          plan.repeats * c.batch * c.q_seq_len * c.q_heads * c.head_dim_v) {
    return BadArgument(std::string(name) + " " + DimsToString(buffer.dimensions()) +
                       " is not the query's shape with head_dim " + std::to_string(c.head_dim_v));
  }
  return ffi::Error::Success();
}

ffi::Error ExpectStats(const ffi::AnyBuffer& stats, const CallPlan& plan) {
  const SdpaConfig& c = plan.config;
  if (stats.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(stats.element_count()) !=
          plan.repeats * c.batch * c.q_heads * c.q_seq_len) {
    return BadArgument("stats must be float32 [batch, q_heads, q_seq], got " +
                       DimsToString(stats.dimensions()) + " for " + c.ToString());
  }
  return ffi::Error::Success();
}

// Fills an output before cuDNN runs: zeros where padding leaves elements unwritten by cuDNN, or
// all-ones bytes (NaN in every float type) when a test asks to prove every element is written.
ffi::Error Prefill(cudaStream_t stream, const SdpaConfig& config, const Options& options,
                   ffi::AnyBuffer buffer) {
  if (config.padding) {
    JAX_SDPA_CUDA_CHECK(cudaMemsetAsync(buffer.untyped_data(), 0, buffer.size_bytes(), stream));
  } else if (options.poison_outputs) {
    JAX_SDPA_CUDA_CHECK(
        cudaMemsetAsync(buffer.untyped_data(), 0xFF, buffer.size_bytes(), stream));
  }
  return ffi::Error::Success();
}

ffi::Error AllocateWorkspace(ffi::ScratchAllocator& scratch, const SdpaGraph& graph,
                             void** workspace) {
  *workspace = nullptr;
  if (graph.workspace_size() == 0) return ffi::Error::Success();
  // Allocate(size) with the default alignment: XLA's allocations are 256-byte aligned anyway,
  // and an explicit alignment argument returned nothing on JAX 0.11.2 (shared/DEVICE.md).
  std::optional<void*> memory = scratch.Allocate(static_cast<size_t>(graph.workspace_size()));
  if (!memory.has_value() || *memory == nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jax_sdpa: could not allocate " + std::to_string(graph.workspace_size()) +
                          " bytes of cuDNN workspace for " + graph.config().ToString());
  }
  *workspace = *memory;
  return ffi::Error::Success();
}

// Finds the call's graph (in its executable's state, else the cache, else builds it) and its
// workspace, holding the device's handle. In a command buffer the call's kernels replay after
// this call returns, so the workspace must outlive it: the call's own (call_state.h).
ffi::Error PrepareGraph(cudaStream_t stream, ffi::ScratchAllocator& scratch, CallState& state,
                        const CallPlan& plan, const Options& options, CudnnHandleLease* lease,
                        std::shared_ptr<SdpaGraph>* graph, void** workspace) {
  JAX_SDPA_RETURN_IF_ERROR(AcquireCudnnHandle(plan.config.device, stream, lease));
  GraphCache& cache = GraphCache::Global();
  cache.SweepIfPending(plan.config.device, stream);
  *graph = state.Find(plan.config);
  if (*graph) {
    cache.CountHit();
  } else {
    JAX_SDPA_RETURN_IF_ERROR(cache.GetOrBuild(plan.config, lease->handle, graph));
    state.Remember(*graph);
  }
  if (options.command_buffer) return state.OwnWorkspace(**graph, workspace);
  return AllocateWorkspace(scratch, **graph, workspace);
}

// Pointer to the r-th of `repeats` equal slices of a buffer.
const void* Slice(const ffi::AnyBuffer& buffer, int64_t r, int64_t repeats) {
  return static_cast<const char*>(buffer.untyped_data()) + r * (buffer.size_bytes() / repeats);
}
void* MutableSlice(ffi::AnyBuffer buffer, int64_t r, int64_t repeats) {
  return static_cast<char*>(buffer.untyped_data()) + r * (buffer.size_bytes() / repeats);
}

ffi::Error ReadOptionalInputs(const ffi::RemainingArgs& rest, const Options& options,
                              OptionalInputs* inputs) {
  bool has_dropout = options.dropout > 0;
  size_t expected = (options.has_bias ? 1 : 0) + (options.has_lengths ? 2 : 0) +
                    (has_dropout ? 1 : 0);
  if (rest.size() != expected) {
    return BadArgument("expected " + std::to_string(expected) + " optional operands, got " +
                       std::to_string(rest.size()));
  }
  size_t index = 0;
  auto next = [&](std::optional<ffi::AnyBuffer>* slot) -> ffi::Error {
    auto buffer = rest.get<ffi::AnyBuffer>(index++);
    if (!buffer.has_value()) return buffer.error();
    *slot = *buffer;
    return ffi::Error::Success();
  };
  if (options.has_bias) JAX_SDPA_RETURN_IF_ERROR(next(&inputs->bias));
  if (options.has_lengths) {
    JAX_SDPA_RETURN_IF_ERROR(next(&inputs->q_lengths));
    JAX_SDPA_RETURN_IF_ERROR(next(&inputs->kv_lengths));
  }
  if (has_dropout) JAX_SDPA_RETURN_IF_ERROR(next(&inputs->dropout_seed));
  return ffi::Error::Success();
}

// What both handlers do first: read the optional operands and map the call onto a graph config.
ffi::Error StartCall(Direction direction, int32_t device, const ffi::AnyBuffer& q,
                     const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                     const ffi::RemainingArgs& rest, const Options& options,
                     OptionalInputs* optional, CallPlan* plan) {
  JAX_SDPA_RETURN_IF_ERROR(ReadOptionalInputs(rest, options, optional));
  return PlanCall(direction, device, q, k, v, *optional, options, plan);
}

AttentionInputs InputsSlice(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                            const ffi::AnyBuffer& v, const OptionalInputs& optional, int64_t r,
                            int64_t repeats) {
  AttentionInputs in;
  in.q = Slice(q, r, repeats);
  in.k = Slice(k, r, repeats);
  in.v = Slice(v, r, repeats);
  if (optional.bias) in.bias = Slice(*optional.bias, r, repeats);
  if (optional.q_lengths) {
    in.q_lengths = Slice(*optional.q_lengths, r, repeats);
    in.kv_lengths = Slice(*optional.kv_lengths, r, repeats);
  }
  if (optional.dropout_seed) in.dropout_seed = Slice(*optional.dropout_seed, r, repeats);
  return in;
}

ffi::Error SdpaForward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                       CallState* state, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> stats, ffi::RemainingRets extra_results,
                       Options options) {
  try {
    OptionalInputs optional;
    CallPlan plan;
    JAX_SDPA_RETURN_IF_ERROR(
        StartCall(Direction::kForward, device, q, k, v, rest, options, &optional, &plan));
    const SdpaConfig& c = plan.config;
    JAX_SDPA_RETURN_IF_ERROR(ExpectOutputShape(*o, q, plan, "output"));
    JAX_SDPA_RETURN_IF_ERROR(ExpectStats(*stats, plan));
    std::optional<ffi::AnyBuffer> dropout_mask;
    if (c.dump_dropout_mask) {
      auto result = extra_results.get<ffi::AnyBuffer>(0);
      if (!result.has_value()) return result.error();
      dropout_mask = **result;
      if (dropout_mask->element_type() != ffi::DataType::F32 ||
          static_cast<int64_t>(dropout_mask->element_count()) !=
              plan.repeats * c.batch * c.q_heads * c.q_seq_len * c.kv_seq_len) {
        return BadArgument("the dropout mask must be float32 [batch, q_heads, q_seq, kv_seq]");
      }
      JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, c, options, *dropout_mask));
    }
    JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, c, options, *o));
    JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, c, options, *stats));
    CudnnHandleLease lease;
    std::shared_ptr<SdpaGraph> graph;
    void* workspace;
    JAX_SDPA_RETURN_IF_ERROR(PrepareGraph(stream, scratch, *state, plan, options, &lease, &graph, &workspace));
    for (int64_t r = 0; r < plan.repeats; ++r) {
      ForwardBuffers buffers;
      buffers.in = InputsSlice(q, k, v, optional, r, plan.repeats);
      buffers.o = MutableSlice(*o, r, plan.repeats);
      buffers.stats = MutableSlice(*stats, r, plan.repeats);
      if (dropout_mask) buffers.dropout_mask = MutableSlice(*dropout_mask, r, plan.repeats);
      JAX_SDPA_RETURN_IF_ERROR(graph->ExecuteForward(lease.handle, buffers, workspace));
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_sdpa forward: ") + e.what());
  }
}

ffi::Error SdpaBackward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                        CallState* state, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                        ffi::AnyBuffer stats, ffi::AnyBuffer d_o, ffi::RemainingArgs rest,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::RemainingRets extra_results,
                        Options options) {
  try {
    OptionalInputs optional;
    CallPlan plan;
    JAX_SDPA_RETURN_IF_ERROR(
        StartCall(Direction::kBackward, device, q, k, v, rest, options, &optional, &plan));
    JAX_SDPA_RETURN_IF_ERROR(ExpectOutputShape(o, q, plan, "output"));
    JAX_SDPA_RETURN_IF_ERROR(ExpectOutputShape(d_o, q, plan, "output cotangent"));
    JAX_SDPA_RETURN_IF_ERROR(ExpectShape(*dq, q, "query gradient"));
    JAX_SDPA_RETURN_IF_ERROR(ExpectShape(*dk, k, "key gradient"));
    JAX_SDPA_RETURN_IF_ERROR(ExpectShape(*dv, v, "value gradient"));
    JAX_SDPA_RETURN_IF_ERROR(ExpectStats(stats, plan));
    std::optional<ffi::AnyBuffer> dbias;
    if (plan.config.bias_grad) {
      auto result = extra_results.get<ffi::AnyBuffer>(0);
      if (!result.has_value()) return result.error();
      dbias = **result;
      JAX_SDPA_RETURN_IF_ERROR(ExpectShape(*dbias, *optional.bias, "bias gradient"));
      JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, plan.config, options, *dbias));
    }
    for (ffi::AnyBuffer out : {*dq, *dk, *dv}) {
      JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, plan.config, options, out));
    }
    CudnnHandleLease lease;
    std::shared_ptr<SdpaGraph> graph;
    void* workspace;
    JAX_SDPA_RETURN_IF_ERROR(PrepareGraph(stream, scratch, *state, plan, options, &lease, &graph, &workspace));
    for (int64_t r = 0; r < plan.repeats; ++r) {
      BackwardBuffers buffers;
      buffers.in = InputsSlice(q, k, v, optional, r, plan.repeats);
      buffers.o = Slice(o, r, plan.repeats);
      buffers.d_o = Slice(d_o, r, plan.repeats);
      buffers.stats = Slice(stats, r, plan.repeats);
      buffers.dq = MutableSlice(*dq, r, plan.repeats);
      buffers.dk = MutableSlice(*dk, r, plan.repeats);
      buffers.dv = MutableSlice(*dv, r, plan.repeats);
      if (dbias) buffers.dbias = MutableSlice(*dbias, r, plan.repeats);
      JAX_SDPA_RETURN_IF_ERROR(graph->ExecuteBackward(lease.handle, buffers, workspace));
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_sdpa backward: ") + e.what());
  }
}

}  // namespace
}  // namespace jax_sdpa

// Attributes decode into one struct, by name.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_sdpa::Options, ::xla::ffi::StructMember<float>("scale"),
    ::xla::ffi::StructMember<int64_t>("window_left"),
    ::xla::ffi::StructMember<int64_t>("window_right"),
    ::xla::ffi::StructMember<bool>("bottom_right"), ::xla::ffi::StructMember<bool>("has_bias"),
    ::xla::ffi::StructMember<bool>("has_lengths"), ::xla::ffi::StructMember<bool>("bias_grad"),
    ::xla::ffi::StructMember<bool>("deterministic"), ::xla::ffi::StructMember<float>("dropout"),
    ::xla::ffi::StructMember<bool>("dump_dropout_mask"),
    ::xla::ffi::StructMember<bool>("poison_outputs"),
    ::xla::ffi::StructMember<bool>("command_buffer"));

namespace jax_sdpa {

// Every call's context and fixed inputs; the backward adds o, stats and d_o.
auto AttentionBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::ScratchAllocator>()
      .Ctx<ffi::State<CallState>>()
      .Arg<ffi::AnyBuffer>()   // q
      .Arg<ffi::AnyBuffer>()   // k
      .Arg<ffi::AnyBuffer>();  // v
}

auto ForwardBinding() {
  return AttentionBinding()
      .RemainingArgs()        // [bias], [q_lengths, kv_lengths], [seed]
      .Ret<ffi::AnyBuffer>()  // o
      .Ret<ffi::AnyBuffer>()  // stats
      .RemainingRets()        // [dropout_mask] (tests)
      .Attrs<Options>();
}

auto BackwardBinding() {
  return AttentionBinding()
      .Arg<ffi::AnyBuffer>()  // o
      .Arg<ffi::AnyBuffer>()  // stats
      .Arg<ffi::AnyBuffer>()  // d_o
      .RemainingArgs()        // [bias], [q_lengths, kv_lengths], [seed]
      .Ret<ffi::AnyBuffer>()  // dq
      .Ret<ffi::AnyBuffer>()  // dk
      .Ret<ffi::AnyBuffer>()  // dv
      .RemainingRets()        // [dbias]
      .Attrs<Options>();
}

// XLA calls this once per custom call when it loads an executable; the state lives as long as
// the executable (call_state.h).
ffi::ErrorOr<std::unique_ptr<CallState>> InstantiateCallState() {
  return std::make_unique<CallState>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CallStateInstantiateHandler, InstantiateCallState,
                              ffi::Ffi::BindInstantiate());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForwardHandler, SdpaForward, ForwardBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardHandler, SdpaBackward, BackwardBinding());
// The same handlers, which XLA may record into its command buffers (CUDA graphs).
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForwardCommandBufferHandler, SdpaForward, ForwardBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardCommandBufferHandler, SdpaBackward, BackwardBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_sdpa
