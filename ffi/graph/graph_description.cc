#include "graph/graph_description.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "graph/fp8_scales.h"
#include "graph/score_mod.h"

namespace jax_sdpa {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

fe::DataType_t FrontendType(ElementType type) {
  switch (type) {
    case ElementType::kFloat16:
      return fe::DataType_t::HALF;
    case ElementType::kBFloat16:
      return fe::DataType_t::BFLOAT16;
    case ElementType::kFloat8E4M3:
      return fe::DataType_t::FP8_E4M3;
    case ElementType::kFloat8E5M2:
      return fe::DataType_t::FP8_E5M2;
  }
  return fe::DataType_t::NOT_SET;
}

// Which [batch, seq, heads, dim] tensor: query-side (Q, O, dO, dQ) or key-side, and its dim.
struct BshdShape {
  int64_t heads, seq, dim;
};
BshdShape QuerySide(const SdpaConfig& c, int64_t dim) { return {c.q_heads, c.q_seq_len, dim}; }
BshdShape KeySide(const SdpaConfig& c, int64_t dim) { return {c.kv_heads, c.kv_seq_len, dim}; }

// Logical BHSD dims of a tensor stored as BSHD (JAX's [batch, seq, heads, dim]). In the ragged
// layout the batch stride is unused: each document starts at its own offset.
void SetBshdLayout(fe::graph::Tensor_attributes& tensor, const SdpaConfig& c, BshdShape shape,
                   const TensorPtr& ragged_offsets) {
  tensor.set_dim({c.batch, shape.heads, shape.seq, shape.dim})
      .set_stride({shape.seq * shape.heads * shape.dim, shape.dim, shape.heads * shape.dim, 1});
  if (c.ragged) tensor.set_ragged_offset(ragged_offsets);
}

TensorPtr AddBshdTensor(fe::graph::Graph& graph, const char* name, int64_t uid,
                        const SdpaConfig& c, BshdShape shape, const TensorPtr& ragged_offsets) {
  auto tensor = graph.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid));
  SetBshdLayout(*tensor, c, shape, ragged_offsets);
  return tensor;
}

// A paged cache: logical [pages, kv_heads, page_size, dim] over [pages, page_size, kv_heads,
// dim] memory (each page is a small BSHD block, as the caller's cache is laid out).
TensorPtr AddPagedCache(fe::graph::Graph& graph, const char* name, int64_t uid,
                        const SdpaConfig& c, int64_t dim) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({c.num_pages, c.kv_heads, c.page_size, dim})
                          .set_stride({c.page_size * c.kv_heads * dim, dim, c.kv_heads * dim, 1}));
}

// The keys' (or values') tensor: the batch's [batch, seq, heads, dim] rows or a page pool.
TensorPtr AddKeySide(fe::graph::Graph& graph, const char* name, int64_t uid, const SdpaConfig& c,
                     int64_t dim, const TensorPtr& ragged_offsets) {
  if (c.page_size > 0) return AddPagedCache(graph, name, uid, c, dim);
  return AddBshdTensor(graph, name, uid, c, KeySide(c, dim), ragged_offsets);
}

void SetBshdOutput(const TensorPtr& tensor, int64_t uid, const SdpaConfig& c, BshdShape shape,
                   const TensorPtr& ragged_offsets) {
  tensor->set_output(true).set_uid(uid);
  SetBshdLayout(*tensor, c, shape, ragged_offsets);
}

// Stats: float32 [batch, heads, q_seq, 1]. Dense: contiguous, JAX sees [batch, heads, q_seq].
// Ragged: token-major ([total_q_tokens, heads] in memory), each document at its offset; a
// dense call's token-major stats alike, [batch, q_seq, heads].
void SetStatsLayout(fe::graph::Tensor_attributes& stats, const SdpaConfig& c,
                    const TensorPtr& ragged_offsets) {
  stats.set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(
      {c.batch, c.q_heads, c.q_seq_len, 1});
  if (c.ragged || c.stats_token_major) {
    stats.set_stride({c.q_seq_len * c.q_heads, 1, c.q_heads, 1});
    if (c.ragged) stats.set_ragged_offset(ragged_offsets);
  } else {
    stats.set_stride({c.q_heads * c.q_seq_len, c.q_seq_len, 1, 1});
  }
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

// An int32 [count, 1, 1, 1] tensor: per-batch lengths, or ragged offsets (count = batch + 1).
TensorPtr AddInt32Vector(fe::graph::Graph& graph, const char* name, int64_t uid, int64_t count) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({count, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT32));
}

// A [1, 1, 1, 1] device scalar: the dropout seed and offset (int64), an FP8 call's scale
// factors and amaxes (float32).
TensorPtr AddScalar(fe::graph::Graph& graph, const char* name, int64_t uid,
                    fe::DataType_t type) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({1, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(type));
}

// The ragged layout's offset tensors (null tensors when the layout is dense).
struct OffsetTensors {
  TensorPtr q, k, v, o, stats;
};

OffsetTensors AddOffsets(fe::graph::Graph& graph, const SdpaConfig& c) {
  if (!c.ragged) return {};
  int64_t count = c.batch + 1;
  return {AddInt32Vector(graph, "q_offsets", kQOffsets, count),
          AddInt32Vector(graph, "k_offsets", kKOffsets, count),
          AddInt32Vector(graph, "v_offsets", kVOffsets, count),
          AddInt32Vector(graph, "o_offsets", kOOffsets, count),
          AddInt32Vector(graph, "stats_offsets", kStatsOffsets, count)};
}

namespace score_modifiers = fe::graph::attn::score_modifiers;

// Soft-capping as cuDNN's score modifier: one Softcap object per graph, because the backward's
// bprop modifier reads the pre-tanh scores its forward modifier saved. No cap: both null.
struct SoftCap {
  std::shared_ptr<score_modifiers::Softcap> modifier;
  TensorPtr cap;
};

// cuDNN's left band bound is exclusive (keys j > i - left); SdpaConfig's is inclusive.
int64_t CudnnLeftBound(int64_t inclusive_left) { return inclusive_left + 1; }

SoftCap AddSoftCap(fe::graph::Graph& graph, const SdpaConfig& c) {
  if (c.logits_soft_cap <= 0) return {};
  return {std::make_shared<score_modifiers::Softcap>(), graph.tensor(c.logits_soft_cap)};
}

// The score modifiers of a graph, applied in this order: soft-capping, then the user's
// score_mod (score_mod.h: its programs read its tables; its derivative reads the score its
// forward program read, which the backward graph's forward modifier saves here).
struct Modifiers {
  SoftCap soft_cap;
  std::vector<TensorPtr> tables;
  std::shared_ptr<TensorPtr> user_score;

  bool any(const SdpaConfig& c) const { return soft_cap.modifier || !c.score_mod.empty(); }
  // A derivative other than the identity (the frontend passes dS through without a bprop, as
  // it does for the masks alone; an additive modifier such as ALiBi's has none).
  bool derivative(const SdpaConfig& c) const {
    return soft_cap.modifier ||
           (!c.score_mod.empty() && c.score_mod_bprop != kIdentityDerivative);
  }
  static constexpr const char* kIdentityDerivative = "=g";
};

Modifiers AddModifiers(fe::graph::Graph& graph, const SdpaConfig& c) {
  return {AddSoftCap(graph, c),
          AddScoreModTables(graph, c.q_heads, ScoreModTablesRead(c), kScoreModTables),
          std::make_shared<TensorPtr>()};
}

TensorPtr ModifyScores(const std::shared_ptr<fe::graph::Graph>& graph, TensorPtr scores,
                       const SdpaConfig& c, const Modifiers& m) {
  if (m.soft_cap.modifier) scores = m.soft_cap.modifier->forward(graph, scores, m.soft_cap.cap);
  if (c.score_mod.empty()) return scores;
  *m.user_score = scores;
  return ApplyScoreMod(graph, c.score_mod, ScoreModInputs{scores, nullptr, m.tables});
}

// The derivative of ModifyScores: the gradient of the modified scores to that of the scores.
TensorPtr ModifyGradient(const std::shared_ptr<fe::graph::Graph>& graph, TensorPtr d_scores,
                         const SdpaConfig& c, const Modifiers& m) {
  if (!c.score_mod.empty() && c.score_mod_bprop != Modifiers::kIdentityDerivative) {
    d_scores = ApplyScoreMod(graph, c.score_mod_bprop,
                             ScoreModInputs{*m.user_score, d_scores, m.tables});
  }
  if (m.soft_cap.modifier) {
    d_scores = m.soft_cap.modifier->backward(graph, d_scores, m.soft_cap.cap);
  }
  return d_scores;
}

// The band and the padding as graph nodes on the scores: what cuDNN's built-in masks do, which
// a score modifier turns off.
TensorPtr MaskScores(const std::shared_ptr<fe::graph::Graph>& graph, TensorPtr scores,
                     const SdpaConfig& c, const TensorPtr& q_lengths,
                     const TensorPtr& kv_lengths) {
  if (c.padding) scores = score_modifiers::padding_mask(graph, scores, kv_lengths, q_lengths);
  if (c.window_left < 0 && c.window_right < 0) return scores;
  std::optional<int64_t> left, right;
  if (c.window_left >= 0) left = CudnnLeftBound(c.window_left);
  if (c.window_right >= 0) right = c.window_right;
  return score_modifiers::sliding_window_mask(
      graph, scores,
      c.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT : fe::DiagonalAlignment_t::TOP_LEFT,
      left, right, c.q_seq_len, c.kv_seq_len, c.padding ? q_lengths : nullptr,
      c.padding ? kv_lengths : nullptr);
}

// Segment ids: int32 [batch, 1, q_seq, 1] for the queries; the keys' [batch, kv_seq] are
// described as [batch, 1, q_seq, kv_seq] with stride 0 along the queries. (As [batch, 1, 1,
// kv_seq], cuDNN 9.19's backward reads them wrongly: dQ off 37x where a key-side limit is
// probed; the stride-0 tile gives the reference's gradients. docs/DEVELOPING.md.)
struct SegmentIds {
  TensorPtr q, kv;
};

SegmentIds AddSegmentIds(fe::graph::Graph& graph, const SdpaConfig& c) {
  if (!c.segment_mask) return {};
  auto ids = [&](const char* name, int64_t uid, std::vector<int64_t> dims,
                 std::vector<int64_t> strides) {
    return graph.tensor(fe::graph::Tensor_attributes()
                            .set_name(name)
                            .set_uid(uid)
                            .set_dim(std::move(dims))
                            .set_stride(std::move(strides))
                            .set_data_type(fe::DataType_t::INT32));
  };
  return {ids("q_segment_ids", kQSegmentIds, {c.batch, 1, c.q_seq_len, 1},
              {c.q_seq_len, c.q_seq_len, 1, 1}),
          ids("kv_segment_ids", kKvSegmentIds, {c.batch, 1, c.q_seq_len, c.kv_seq_len},
              {c.kv_seq_len, c.kv_seq_len, 0, 1})};
}

// Scores of keys whose segment id is not the query's become -inf. Each node takes a
// scores-shaped operand (the ids are spread over a [.., q_seq, kv_seq] tile of ones first),
// the form cuDNN's fused kernels take; int32 arithmetic, so that any two ids stay distinct.
TensorPtr MaskOtherSegments(const std::shared_ptr<fe::graph::Graph>& graph, TensorPtr scores,
                            const SegmentIds& ids) {
  auto node = [&](TensorPtr a, TensorPtr b, fe::PointwiseMode_t mode, const char* name) {
    auto out = graph->pointwise(a, b, fe::graph::Pointwise_attributes()
                                          .set_name(name)
                                          .set_mode(mode)
                                          .set_compute_data_type(fe::DataType_t::INT32));
    out->set_data_type(fe::DataType_t::INT32);
    return out;
  };
  auto column = graph->pointwise(scores, fe::graph::Pointwise_attributes()
                                             .set_name("segment_column")
                                             .set_mode(fe::PointwiseMode_t::GEN_INDEX)
                                             .set_axis(3)
                                             .set_compute_data_type(fe::DataType_t::INT32));
  column->set_data_type(fe::DataType_t::INT32);
  auto ones = node(column, column, fe::PointwiseMode_t::CMP_LE, "segment_ones");
  auto q_ids = node(ones, ids.q, fe::PointwiseMode_t::MUL, "segment_q_ids");
  auto kv_ids = node(ones, ids.kv, fe::PointwiseMode_t::MUL, "segment_kv_ids");
  auto same = node(q_ids, kv_ids, fe::PointwiseMode_t::CMP_EQ, "segment_same");
  auto negative_inf =
      std::make_shared<fe::graph::Tensor_attributes>(score_modifiers::get_negative_inf_value());
  return graph->pointwise(scores, negative_inf, same,
                          fe::graph::Pointwise_attributes()
                              .set_name("segment_select")
                              .set_mode(fe::PointwiseMode_t::BINARY_SELECT));
}

// The masking, soft-cap, bias and dropout options common to SDPA_attributes and
// SDPA_backward_attributes.
template <typename Options>
void SetMasking(fe::graph::Graph& graph, const SdpaConfig& c, const Modifiers& modifiers,
                Options& options) {
  TensorPtr q_lengths, kv_lengths;
  if (c.padding) {
    q_lengths = AddInt32Vector(graph, "q_lengths", kQLengths, c.batch);
    kv_lengths = AddInt32Vector(graph, "kv_lengths", kKvLengths, c.batch);
    options.set_seq_len_q(q_lengths).set_seq_len_kv(kv_lengths);
  }
  if (modifiers.any(c) || c.segment_mask) {
    SegmentIds ids = AddSegmentIds(graph, c);
    options.set_score_mod([modifiers, c, q_lengths, kv_lengths, ids](
                              std::shared_ptr<fe::graph::Graph> sub, TensorPtr scores) {
      scores = ModifyScores(sub, scores, c, modifiers);
      scores = MaskScores(sub, scores, c, q_lengths, kv_lengths);
      return c.segment_mask ? MaskOtherSegments(sub, scores, ids) : scores;
    });
  } else {
    if (c.window_right >= 0 || c.window_left >= 0) {
      options.set_diagonal_alignment(c.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                                    : fe::DiagonalAlignment_t::TOP_LEFT);
    }
    if (c.window_right >= 0) {
      options.set_diagonal_band_right_bound(static_cast<int>(c.window_right));
    }
    if (c.window_left >= 0) {
      options.set_diagonal_band_left_bound(static_cast<int>(CudnnLeftBound(c.window_left)));
    }
    if (c.padding) options.set_padding_mask(true);
  }
  if (c.bias_batch > 0) options.set_bias(AddBias(graph, c, "bias", kBias));
  if (c.dropout > 0) {
    options.set_dropout(c.dropout,
                        AddScalar(graph, "dropout_seed", kDropoutSeed, fe::DataType_t::INT64),
                        AddScalar(graph, "dropout_offset", kDropoutOffset, fe::DataType_t::INT64));
  }
}

// Paged K/V: each sequence's pages through one table (as [batch, 1, pages, 1]) for K and V.
template <typename Options>
void SetPageTables(fe::graph::Graph& graph, const SdpaConfig& c, Options& options) {
  if (c.page_size == 0) return;
  int64_t pages = c.kv_seq_len / c.page_size;
  auto table = [&](const char* name, int64_t uid) {
    return graph.tensor(fe::graph::Tensor_attributes()
                            .set_name(name)
                            .set_uid(uid)
                            .set_dim({c.batch, 1, pages, 1})
                            .set_stride({pages, pages, 1, 1})
                            .set_data_type(fe::DataType_t::INT32));
  };
  options.set_paged_attention_k_table(table("k_page_table", kKPageTable))
      .set_paged_attention_v_table(table("v_page_table", kVPageTable))
      .set_paged_attention_max_seq_len_kv(static_cast<int>(c.kv_seq_len));
}

fe::AttentionImplementation_t FrontendImplementation(ForwardImplementation implementation) {
  return implementation == ForwardImplementation::kUnified ? fe::AttentionImplementation_t::UNIFIED
                                                           : fe::AttentionImplementation_t::COMPOSITE;
}

std::shared_ptr<fe::graph::Graph> DescribeForward(const SdpaConfig& c,
                                                  ForwardImplementation implementation) {
  auto graph = NewGraph(c);
  OffsetTensors offsets = AddOffsets(*graph, c);
  auto q = AddBshdTensor(*graph, "Q", kQ, c, QuerySide(c, c.head_dim), offsets.q);
  auto k = AddKeySide(*graph, "K", kK, c, c.head_dim, offsets.k);
  auto v = AddKeySide(*graph, "V", kV, c, c.head_dim_v, offsets.v);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("jax_sdpa_forward")
                     .set_generate_stats(true)
                     .set_attn_scale(c.scale);
  if (implementation != ForwardImplementation::kAuto) {
    options.set_implementation(FrontendImplementation(implementation));
  }
  SetMasking(*graph, c, AddModifiers(*graph, c), options);
  SetPageTables(*graph, c, options);
  auto [o, stats] = graph->sdpa(q, k, v, options);
  SetBshdOutput(o, kO, c, QuerySide(c, c.head_dim_v), offsets.o);
  stats->set_output(true);
  SetStatsLayout(*stats, c, offsets.stats);
  return graph;
}

std::shared_ptr<fe::graph::Graph> DescribeBackward(const SdpaConfig& c) {
  auto graph = NewGraph(c);
  OffsetTensors offsets = AddOffsets(*graph, c);
  auto q = AddBshdTensor(*graph, "Q", kQ, c, QuerySide(c, c.head_dim), offsets.q);
  auto k = AddBshdTensor(*graph, "K", kK, c, KeySide(c, c.head_dim), offsets.k);
  auto v = AddBshdTensor(*graph, "V", kV, c, KeySide(c, c.head_dim_v), offsets.v);
  auto o = AddBshdTensor(*graph, "O", kO, c, QuerySide(c, c.head_dim_v), offsets.o);
  auto d_o = AddBshdTensor(*graph, "dO", kDO, c, QuerySide(c, c.head_dim_v), offsets.o);
  auto stats = graph->tensor(fe::graph::Tensor_attributes().set_name("Stats"));
  SetStatsLayout(*stats, c, offsets.stats);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("jax_sdpa_backward")
                     .set_attn_scale(c.scale)
                     .set_deterministic_algorithm(c.deterministic);
  Modifiers modifiers = AddModifiers(*graph, c);
  SetMasking(*graph, c, modifiers, options);
  if (modifiers.derivative(c)) {
    options.set_score_mod_bprop(
        [modifiers, c](std::shared_ptr<fe::graph::Graph> sub, TensorPtr d_scores) {
          return ModifyGradient(sub, d_scores, c, modifiers);
        });
  }
  if (c.ragged) {  // sizes the workspace by the tokens, not by documents x longest document
    options.set_max_total_seq_len_q(c.total_q_tokens).set_max_total_seq_len_kv(c.total_kv_tokens);
  }
  if (c.bias_batch > 0 && c.bias_grad) {
    auto dbias = AddBias(*graph, c, "dbias", kDBias);
    dbias->set_output(true);
    options.set_dbias(dbias);
  }
  auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, d_o, stats, options);
  SetBshdOutput(dq, kDQ, c, QuerySide(c, c.head_dim), offsets.q);
  SetBshdOutput(dk, kDK, c, KeySide(c, c.head_dim), offsets.k);
  SetBshdOutput(dv, kDV, c, KeySide(c, c.head_dim_v), offsets.v);
  return graph;
}

void SetAmaxOutput(const TensorPtr& amax, int64_t uid) {
  amax->set_output(true).set_uid(uid).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1})
      .set_data_type(fe::DataType_t::FLOAT);
}

// The causal mask and the lengths, the masking cuDNN's FP8 graphs take (targets/fp8.cc checks).
template <typename Options>
void SetFp8Masking(fe::graph::Graph& graph, const SdpaConfig& c, Options& options) {
  if (c.window_right == 0) options.set_causal_mask(true);
  if (c.padding) {
    options.set_padding_mask(true)
        .set_seq_len_q(AddInt32Vector(graph, "q_lengths", kQLengths, c.batch))
        .set_seq_len_kv(AddInt32Vector(graph, "kv_lengths", kKvLengths, c.batch));
  }
}

// Q, K, V in e4m3 (descaled inside), the softmax weights quantized with scale_s, the output
// quantized to e4m3 with scale_o: on Hopper the output is FP8 (the caller dequantizes).
std::shared_ptr<fe::graph::Graph> DescribeFp8Forward(const SdpaConfig& c) {
  auto graph = NewGraph(c);
  auto q = AddBshdTensor(*graph, "Q", kQ, c, QuerySide(c, c.head_dim), nullptr);
  auto k = AddBshdTensor(*graph, "K", kK, c, KeySide(c, c.head_dim), nullptr);
  auto v = AddBshdTensor(*graph, "V", kV, c, KeySide(c, c.head_dim_v), nullptr);
  auto scale = [&](const char* name, Fp8Scale which) {
    return AddScalar(*graph, name, kFp8Scales + which, fe::DataType_t::FLOAT);
  };
  auto options = fe::graph::SDPA_fp8_attributes()
                     .set_name("jax_sdpa_fp8_forward")
                     .set_generate_stats(true)
                     .set_attn_scale(c.scale);
  SetFp8Masking(*graph, c, options);
  auto [o, stats, amax_s, amax_o] = graph->sdpa_fp8(
      q, k, v, scale("descale_q", kDescaleQ), scale("descale_k", kDescaleK),
      scale("descale_v", kDescaleV), scale("descale_s", kDescaleS), scale("scale_s", kScaleS),
      scale("scale_o", kScaleO), options);
  SetBshdOutput(o, kO, c, QuerySide(c, c.head_dim_v), nullptr);
  o->set_data_type(FrontendType(c.element_type));
  stats->set_output(true);
  SetStatsLayout(*stats, c, nullptr);
  SetAmaxOutput(amax_s, kFp8Amaxes + kAmaxS);
  SetAmaxOutput(amax_o, kFp8Amaxes + kAmaxO);
  return graph;
}

// dO, the internal dS and the gradients in c.gradient_type, each quantized with its scale.
std::shared_ptr<fe::graph::Graph> DescribeFp8Backward(const SdpaConfig& c) {
  auto graph = NewGraph(c);
  auto q = AddBshdTensor(*graph, "Q", kQ, c, QuerySide(c, c.head_dim), nullptr);
  auto k = AddBshdTensor(*graph, "K", kK, c, KeySide(c, c.head_dim), nullptr);
  auto v = AddBshdTensor(*graph, "V", kV, c, KeySide(c, c.head_dim_v), nullptr);
  auto o = AddBshdTensor(*graph, "O", kO, c, QuerySide(c, c.head_dim_v), nullptr);
  auto d_o = AddBshdTensor(*graph, "dO", kDO, c, QuerySide(c, c.head_dim_v), nullptr);
  d_o->set_data_type(FrontendType(c.gradient_type));
  auto stats = graph->tensor(fe::graph::Tensor_attributes().set_name("Stats"));
  SetStatsLayout(*stats, c, nullptr);
  auto scale = [&](const char* name, Fp8Scale which) {
    return AddScalar(*graph, name, kFp8Scales + which, fe::DataType_t::FLOAT);
  };
  auto options = fe::graph::SDPA_fp8_backward_attributes()
                     .set_name("jax_sdpa_fp8_backward")
                     .set_attn_scale(c.scale);
  SetFp8Masking(*graph, c, options);
  auto [dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp] = graph->sdpa_fp8_backward(
      q, k, v, o, d_o, stats, scale("descale_q", kDescaleQ), scale("descale_k", kDescaleK),
      scale("descale_v", kDescaleV), scale("descale_o", kDescaleO),
      scale("descale_do", kDescaleDO), scale("descale_s", kDescaleS),
      scale("descale_dp", kDescaleDP), scale("scale_s", kScaleS), scale("scale_dq", kScaleDQ),
      scale("scale_dk", kScaleDK), scale("scale_dv", kScaleDV), scale("scale_dp", kScaleDP),
      options);
  SetBshdOutput(dq, kDQ, c, QuerySide(c, c.head_dim), nullptr);
  SetBshdOutput(dk, kDK, c, KeySide(c, c.head_dim), nullptr);
  SetBshdOutput(dv, kDV, c, KeySide(c, c.head_dim_v), nullptr);
  for (const TensorPtr& gradient : {dq, dk, dv}) {
    gradient->set_data_type(FrontendType(c.gradient_type));
  }
  SetAmaxOutput(amax_dq, kFp8Amaxes + kAmaxDQ);
  SetAmaxOutput(amax_dk, kFp8Amaxes + kAmaxDK);
  SetAmaxOutput(amax_dv, kFp8Amaxes + kAmaxDV);
  SetAmaxOutput(amax_dp, kFp8Amaxes + kAmaxDP);
  return graph;
}

}  // namespace

std::shared_ptr<fe::graph::Graph> DescribeSdpaGraph(const SdpaConfig& config,
                                                    ForwardImplementation implementation) {
  bool forward = config.direction == Direction::kForward;
  if (IsFp8(config.element_type)) {
    return forward ? DescribeFp8Forward(config) : DescribeFp8Backward(config);
  }
  return forward ? DescribeForward(config, implementation) : DescribeBackward(config);
}

}  // namespace jax_sdpa
