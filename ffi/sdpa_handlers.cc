#include "sdpa_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <string>

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
  bool has_bias;
  bool has_lengths;
  bool bias_grad;
  bool deterministic;
  bool poison_outputs;
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

ffi::Error PlanCall(Direction direction, int32_t device, const ffi::AnyBuffer& q,
                    const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const ffi::AnyBuffer* bias,
                    const ffi::AnyBuffer* q_lengths, const ffi::AnyBuffer* kv_lengths,
                    const Options& options, CallPlan* plan) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  size_t rank = qd.size();
  if (rank < 4 || kd.size() != rank || v.dimensions().size() != rank) {
    return BadArgument("query, key and value must share one rank >= 4, got " + DimsToString(qd) +
                       ", " + DimsToString(kd) + ", " + DimsToString(v.dimensions()));
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
  bool same_kv = true;
  for (size_t i = 0; i < rank; ++i) same_kv &= kd[i] == v.dimensions()[i];
  if (k_type != c.element_type || v_type != c.element_type || !same_kv ||
      kd[rank - 4] != batch || kd[rank - 1] != qd[rank - 1] || kd[rank - 2] == 0 ||
      qd[rank - 2] % kd[rank - 2] != 0) {
    return BadArgument("query " + DimsToString(qd) + ", key " + DimsToString(kd) + " and value " +
                       DimsToString(v.dimensions()) + " do not form one attention problem");
  }
  c.q_seq_len = qd[rank - 3];
  c.kv_seq_len = kd[rank - 3];
  c.q_heads = qd[rank - 2];
  c.kv_heads = kd[rank - 2];
  c.head_dim = qd[rank - 1];
  c.scale = options.scale;
  c.window_left = options.window_left;
  c.window_right = options.window_right;
  c.deterministic = direction == Direction::kBackward && options.deterministic;
  c.padding = q_lengths != nullptr;
  if (c.padding) {
    for (const ffi::AnyBuffer* lengths : {q_lengths, kv_lengths}) {
      if (lengths->element_type() != ffi::DataType::S32 ||
          static_cast<int64_t>(lengths->element_count()) != vmapped * batch) {
        return BadArgument("sequence lengths must be int32 [batch], got " +
                           DimsToString(lengths->dimensions()));
      }
    }
  }
  plan->repeats = 1;
  c.batch = vmapped * batch;
  if (bias != nullptr) {
    auto bd = bias->dimensions();
    ElementType bias_type;
    JAX_SDPA_RETURN_IF_ERROR(ReadElementType(*bias, "bias", &bias_type));
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
    c.bias_batch = bd[rank - 4] * vmapped;
    c.bias_grad = direction == Direction::kBackward && options.bias_grad;
    if (bd[rank - 4] == 1 && batch > 1 && vmapped > 1) {
      // One bias per vmapped slice, shared by its batch: no single batch stride says that, so
      // the graph runs once per slice.
      plan->repeats = vmapped;
      c.batch = batch;
      c.bias_batch = 1;
    }
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

// Looks up (or builds) the graph and allocates its workspace, holding the device's handle.
ffi::Error PrepareGraph(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                        const CallPlan& plan, CudnnHandleLease* lease,
                        std::shared_ptr<SdpaGraph>* graph, void** workspace) {
  JAX_SDPA_RETURN_IF_ERROR(AcquireCudnnHandle(plan.config.device, stream, lease));
  JAX_SDPA_RETURN_IF_ERROR(GraphCache::Global().GetOrBuild(plan.config, lease->handle, graph));
  return AllocateWorkspace(scratch, **graph, workspace);
}

// Pointer to the r-th of `repeats` equal slices of a buffer.
const void* Slice(const ffi::AnyBuffer& buffer, int64_t r, int64_t repeats) {
  return static_cast<const char*>(buffer.untyped_data()) + r * (buffer.size_bytes() / repeats);
}
void* MutableSlice(ffi::AnyBuffer buffer, int64_t r, int64_t repeats) {
  return static_cast<char*>(buffer.untyped_data()) + r * (buffer.size_bytes() / repeats);
}

// The optional inputs after the fixed ones: [bias], [q_lengths, kv_lengths].
struct OptionalInputs {
  std::optional<ffi::AnyBuffer> bias, q_lengths, kv_lengths;
};

ffi::Error ReadOptionalInputs(const ffi::RemainingArgs& rest, const Options& options,
                              OptionalInputs* inputs) {
  size_t expected = (options.has_bias ? 1 : 0) + (options.has_lengths ? 2 : 0);
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
  return ffi::Error::Success();
}

const ffi::AnyBuffer* Ptr(const std::optional<ffi::AnyBuffer>& buffer) {
  return buffer.has_value() ? &*buffer : nullptr;
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
  return in;
}

ffi::Error SdpaForward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                       ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> stats, Options options) {
  try {
    OptionalInputs optional;
    JAX_SDPA_RETURN_IF_ERROR(ReadOptionalInputs(rest, options, &optional));
    CallPlan plan;
    JAX_SDPA_RETURN_IF_ERROR(PlanCall(Direction::kForward, device, q, k, v, Ptr(optional.bias),
                                      Ptr(optional.q_lengths), Ptr(optional.kv_lengths), options,
                                      &plan));
    JAX_SDPA_RETURN_IF_ERROR(ExpectShape(*o, q, "output"));
    JAX_SDPA_RETURN_IF_ERROR(ExpectStats(*stats, plan));
    JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, plan.config, options, *o));
    JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, plan.config, options, *stats));
    CudnnHandleLease lease;
    std::shared_ptr<SdpaGraph> graph;
    void* workspace;
    JAX_SDPA_RETURN_IF_ERROR(PrepareGraph(stream, scratch, plan, &lease, &graph, &workspace));
    for (int64_t r = 0; r < plan.repeats; ++r) {
      ForwardBuffers buffers;
      buffers.in = InputsSlice(q, k, v, optional, r, plan.repeats);
      buffers.o = MutableSlice(*o, r, plan.repeats);
      buffers.stats = MutableSlice(*stats, r, plan.repeats);
      JAX_SDPA_RETURN_IF_ERROR(graph->ExecuteForward(lease.handle, buffers, workspace));
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_sdpa forward: ") + e.what());
  }
}

ffi::Error SdpaBackward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                        ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                        ffi::AnyBuffer stats, ffi::AnyBuffer d_o, ffi::RemainingArgs rest,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::RemainingRets extra_results,
                        Options options) {
  try {
    OptionalInputs optional;
    JAX_SDPA_RETURN_IF_ERROR(ReadOptionalInputs(rest, options, &optional));
    CallPlan plan;
    JAX_SDPA_RETURN_IF_ERROR(PlanCall(Direction::kBackward, device, q, k, v, Ptr(optional.bias),
                                      Ptr(optional.q_lengths), Ptr(optional.kv_lengths), options,
                                      &plan));
    JAX_SDPA_RETURN_IF_ERROR(ExpectShape(o, q, "output"));
    JAX_SDPA_RETURN_IF_ERROR(ExpectShape(d_o, q, "output cotangent"));
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
    JAX_SDPA_RETURN_IF_ERROR(PrepareGraph(stream, scratch, plan, &lease, &graph, &workspace));
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
    ::xla::ffi::StructMember<bool>("has_bias"), ::xla::ffi::StructMember<bool>("has_lengths"),
    ::xla::ffi::StructMember<bool>("bias_grad"), ::xla::ffi::StructMember<bool>("deterministic"),
    ::xla::ffi::StructMember<bool>("poison_outputs"));

namespace jax_sdpa {

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForwardHandler, SdpaForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .RemainingArgs()        // [bias], [q_lengths, kv_lengths]
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::AnyBuffer>()  // stats
                                  .Attrs<Options>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardHandler, SdpaBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // o
                                  .Arg<ffi::AnyBuffer>()  // stats
                                  .Arg<ffi::AnyBuffer>()  // d_o
                                  .RemainingArgs()        // [bias], [q_lengths, kv_lengths]
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .RemainingRets()        // [dbias]
                                  .Attrs<Options>());

}  // namespace jax_sdpa
