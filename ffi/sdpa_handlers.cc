#include "sdpa_handlers.h"

#include <cuda_runtime_api.h>

#include <exception>
#include <string>

#include "check.h"
#include "cudnn_handles.h"
#include "graph_cache.h"
#include "sdpa_config.h"
#include "sdpa_graphs.h"

namespace jax_sdpa {
namespace {

// Shape of one [batch..., seq, heads, dim] buffer, leading axes folded into batch.
struct BshdShape {
  int64_t batch = 1;
  int64_t seq = 0;
  int64_t heads = 0;
  int64_t dim = 0;
  bool operator==(const BshdShape& o) const {
    return batch == o.batch && seq == o.seq && heads == o.heads && dim == o.dim;
  }
};

std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

ffi::Error ReadBshd(const ffi::AnyBuffer& buffer, const char* name, BshdShape* shape) {
  auto dims = buffer.dimensions();
  if (dims.size() < 4) {
    return ffi::Error::InvalidArgument(std::string(name) + " must have rank >= 4 ([batch..., seq, "
                                       "heads, head_dim]), got " + DimsToString(dims));
  }
  size_t rank = dims.size();
  shape->batch = 1;
  for (size_t i = 0; i + 3 < rank; ++i) shape->batch *= dims[i];
  shape->seq = dims[rank - 3];
  shape->heads = dims[rank - 2];
  shape->dim = dims[rank - 1];
  return ffi::Error::Success();
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
      return ffi::Error::InvalidArgument(std::string(name) + " must be float16 or bfloat16");
  }
}

ffi::Error ExpectSame(const ffi::AnyBuffer& buffer, const char* name, ElementType expected_type,
                      const BshdShape& expected_shape) {
  ElementType type;
  JAX_SDPA_RETURN_IF_ERROR(ReadElementType(buffer, name, &type));
  BshdShape shape;
  JAX_SDPA_RETURN_IF_ERROR(ReadBshd(buffer, name, &shape));
  if (type != expected_type || !(shape == expected_shape)) {
    return ffi::Error::InvalidArgument(std::string(name) + " has dtype or shape " +
                                       DimsToString(buffer.dimensions()) +
                                       " that does not match its counterpart");
  }
  return ffi::Error::Success();
}

ffi::Error ExpectStats(const ffi::AnyBuffer& stats, const SdpaConfig& c) {
  if (stats.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(stats.element_count()) != c.batch * c.q_heads * c.q_seq_len) {
    return ffi::Error::InvalidArgument("stats must be float32 [batch..., q_heads, q_seq], got " +
                                       DimsToString(stats.dimensions()) + " for " + c.ToString());
  }
  return ffi::Error::Success();
}

// Builds the config from q, k, v and checks that they describe one attention problem.
ffi::Error ReadConfig(Direction direction, int32_t device, const ffi::AnyBuffer& q,
                      const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, float scale,
                      bool causal, SdpaConfig* config) {
  BshdShape qs, ks;
  JAX_SDPA_RETURN_IF_ERROR(ReadBshd(q, "query", &qs));
  JAX_SDPA_RETURN_IF_ERROR(ReadBshd(k, "key", &ks));
  ElementType type;
  JAX_SDPA_RETURN_IF_ERROR(ReadElementType(q, "query", &type));
  JAX_SDPA_RETURN_IF_ERROR(ExpectSame(k, "key", type, ks));
  JAX_SDPA_RETURN_IF_ERROR(ExpectSame(v, "value", type, ks));
  if (qs.batch != ks.batch || qs.dim != ks.dim || ks.heads == 0 || qs.heads % ks.heads != 0) {
    return ffi::Error::InvalidArgument("query " + DimsToString(q.dimensions()) + " and key " +
                                       DimsToString(k.dimensions()) +
                                       " do not form an attention problem");
  }
  config->direction = direction;
  config->device = device;
  config->element_type = type;
  config->batch = qs.batch;
  config->q_seq_len = qs.seq;
  config->kv_seq_len = ks.seq;
  config->q_heads = qs.heads;
  config->kv_heads = ks.heads;
  config->head_dim = qs.dim;
  config->scale = scale;
  config->causal = causal;
  return ffi::Error::Success();
}

// Fills an output with all-ones bytes (NaN in every float type) before cuDNN writes it, so that a
// test can prove every element was written.
ffi::Error Poison(cudaStream_t stream, ffi::AnyBuffer buffer) {
  JAX_SDPA_CUDA_CHECK(cudaMemsetAsync(buffer.untyped_data(), 0xFF, buffer.size_bytes(), stream));
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
                      "could not allocate " + std::to_string(graph.workspace_size()) +
                          " bytes of cuDNN workspace for " + graph.config().ToString());
  }
  *workspace = *memory;
  return ffi::Error::Success();
}

ffi::Error SdpaForward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                       ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> stats,
                       float scale, bool is_causal, bool poison_outputs) {
  try {
    SdpaConfig config;
    JAX_SDPA_RETURN_IF_ERROR(
        ReadConfig(Direction::kForward, device, q, k, v, scale, is_causal, &config));
    BshdShape qs;
    JAX_SDPA_RETURN_IF_ERROR(ReadBshd(q, "query", &qs));
    JAX_SDPA_RETURN_IF_ERROR(ExpectSame(*o, "output", config.element_type, qs));
    JAX_SDPA_RETURN_IF_ERROR(ExpectStats(*stats, config));
    if (poison_outputs) {
      JAX_SDPA_RETURN_IF_ERROR(Poison(stream, *o));
      JAX_SDPA_RETURN_IF_ERROR(Poison(stream, *stats));
    }
    CudnnHandleLease lease;
    JAX_SDPA_RETURN_IF_ERROR(AcquireCudnnHandle(device, stream, &lease));
    std::shared_ptr<SdpaGraph> graph;
    JAX_SDPA_RETURN_IF_ERROR(GraphCache::Global().GetOrBuild(config, lease.handle, &graph));
    void* workspace;
    JAX_SDPA_RETURN_IF_ERROR(AllocateWorkspace(scratch, *graph, &workspace));
    ForwardBuffers buffers{q.untyped_data(), k.untyped_data(), v.untyped_data(),
                           o->untyped_data(), stats->untyped_data()};
    return graph->ExecuteForward(lease.handle, buffers, workspace);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_sdpa forward: ") + e.what());
  }
}

ffi::Error SdpaBackward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                        ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                        ffi::AnyBuffer stats, ffi::AnyBuffer d_o,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, float scale, bool is_causal,
                        bool poison_outputs) {
  try {
    SdpaConfig config;
    JAX_SDPA_RETURN_IF_ERROR(
        ReadConfig(Direction::kBackward, device, q, k, v, scale, is_causal, &config));
    BshdShape qs, ks;
    JAX_SDPA_RETURN_IF_ERROR(ReadBshd(q, "query", &qs));
    JAX_SDPA_RETURN_IF_ERROR(ReadBshd(k, "key", &ks));
    JAX_SDPA_RETURN_IF_ERROR(ExpectSame(o, "output", config.element_type, qs));
    JAX_SDPA_RETURN_IF_ERROR(ExpectSame(d_o, "output cotangent", config.element_type, qs));
    JAX_SDPA_RETURN_IF_ERROR(ExpectSame(*dq, "query gradient", config.element_type, qs));
    JAX_SDPA_RETURN_IF_ERROR(ExpectSame(*dk, "key gradient", config.element_type, ks));
    JAX_SDPA_RETURN_IF_ERROR(ExpectSame(*dv, "value gradient", config.element_type, ks));
    JAX_SDPA_RETURN_IF_ERROR(ExpectStats(stats, config));
    if (poison_outputs) {
      JAX_SDPA_RETURN_IF_ERROR(Poison(stream, *dq));
      JAX_SDPA_RETURN_IF_ERROR(Poison(stream, *dk));
      JAX_SDPA_RETURN_IF_ERROR(Poison(stream, *dv));
    }
    CudnnHandleLease lease;
    JAX_SDPA_RETURN_IF_ERROR(AcquireCudnnHandle(device, stream, &lease));
    std::shared_ptr<SdpaGraph> graph;
    JAX_SDPA_RETURN_IF_ERROR(GraphCache::Global().GetOrBuild(config, lease.handle, &graph));
    void* workspace;
    JAX_SDPA_RETURN_IF_ERROR(AllocateWorkspace(scratch, *graph, &workspace));
    BackwardBuffers buffers{q.untyped_data(),  k.untyped_data(),     v.untyped_data(),
                            o.untyped_data(),  d_o.untyped_data(),   stats.untyped_data(),
                            dq->untyped_data(), dk->untyped_data(), dv->untyped_data()};
    return graph->ExecuteBackward(lease.handle, buffers, workspace);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_sdpa backward: ") + e.what());
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForwardHandler, SdpaForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::AnyBuffer>()  // stats
                                  .Attr<float>("scale")
                                  .Attr<bool>("is_causal")
                                  .Attr<bool>("poison_outputs"));

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
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Attr<float>("scale")
                                  .Attr<bool>("is_causal")
                                  .Attr<bool>("poison_outputs"));

}  // namespace jax_sdpa
