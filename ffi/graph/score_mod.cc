#include "graph/score_mod.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace jax_sdpa {
namespace {

namespace fe = cudnn_frontend;

fe::PointwiseMode_t ModeNamed(const std::string& name) {
  static const std::map<std::string, fe::PointwiseMode_t> kModes = {
      {"ADD", fe::PointwiseMode_t::ADD},
      {"SUB", fe::PointwiseMode_t::SUB},
      {"MUL", fe::PointwiseMode_t::MUL},
      {"DIV", fe::PointwiseMode_t::DIV},
      {"MAX", fe::PointwiseMode_t::MAX},
      {"MIN", fe::PointwiseMode_t::MIN},
      {"POW", fe::PointwiseMode_t::POW},
      {"NEG", fe::PointwiseMode_t::NEG},
      {"EXP", fe::PointwiseMode_t::EXP},
      {"LOG", fe::PointwiseMode_t::LOG},
      {"ABS", fe::PointwiseMode_t::ABS},
      {"SQRT", fe::PointwiseMode_t::SQRT},
      {"RSQRT", fe::PointwiseMode_t::RSQRT},
      {"SIN", fe::PointwiseMode_t::SIN},
      {"COS", fe::PointwiseMode_t::COS},
      {"TAN", fe::PointwiseMode_t::TAN},
      {"FLOOR", fe::PointwiseMode_t::FLOOR},
      {"CEIL", fe::PointwiseMode_t::CEIL},
      {"ERF", fe::PointwiseMode_t::ERF},
      {"TANH_FWD", fe::PointwiseMode_t::TANH_FWD},
      {"SIGMOID_FWD", fe::PointwiseMode_t::SIGMOID_FWD},
      {"IDENTITY", fe::PointwiseMode_t::IDENTITY},
      {"CMP_EQ", fe::PointwiseMode_t::CMP_EQ},
      {"CMP_NEQ", fe::PointwiseMode_t::CMP_NEQ},
      {"CMP_LT", fe::PointwiseMode_t::CMP_LT},
      {"CMP_LE", fe::PointwiseMode_t::CMP_LE},
      {"CMP_GT", fe::PointwiseMode_t::CMP_GT},
      {"CMP_GE", fe::PointwiseMode_t::CMP_GE},
      {"LOGICAL_AND", fe::PointwiseMode_t::LOGICAL_AND},
      {"LOGICAL_OR", fe::PointwiseMode_t::LOGICAL_OR},
      {"BINARY_SELECT", fe::PointwiseMode_t::BINARY_SELECT},
  };
  auto found = kModes.find(name);
  if (found == kModes.end()) throw std::invalid_argument("no pointwise mode " + name);
  return found->second;
}

std::vector<std::string> Split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, separator)) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

// One program's values as it is applied.
class ProgramWriter {
 public:
  ProgramWriter(const std::shared_ptr<fe::graph::Graph>& graph, const ScoreModInputs& inputs)
      : graph_(graph), inputs_(inputs) {}

  ScoreTensor Apply(const std::string& program) {
    std::vector<std::string> items = Split(program, ';');
    if (items.empty() || items.back()[0] != '=') {
      throw std::invalid_argument("a score_mod program ends with its result");
    }
    for (size_t i = 0; i + 1 < items.size(); ++i) values_.push_back(Instruction(items[i], i));
    return Operand(items.back().substr(1));
  }

 private:
  // An instruction computes in its type and gives it, as XLA's score-modifier lowering does:
  // f FLOAT, i INT32, b BOOLEAN; cuDNN's logical AND and OR read INT32, so boolean operands
  // are converted first.
  ScoreTensor Instruction(const std::string& item, size_t index) {
    std::vector<std::string> tokens = Split(item, ' ');
    if (tokens.size() < 3 || tokens[0].size() != 1) {
      throw std::invalid_argument("malformed score_mod instruction: " + item);
    }
    const fe::DataType_t type = TypeNamed(tokens[0][0], item);
    const fe::PointwiseMode_t mode = ModeNamed(tokens[1]);
    const std::string name = "score_mod_" + std::to_string(index);
    const bool logical = mode == fe::PointwiseMode_t::LOGICAL_AND ||
                         mode == fe::PointwiseMode_t::LOGICAL_OR;
    std::vector<ScoreTensor> in;
    for (size_t i = 2; i < tokens.size(); ++i) {
      ScoreTensor operand = Operand(tokens[i]);
      if (logical && operand->get_data_type() == fe::DataType_t::BOOLEAN) {
        operand = Node(name + "_int" + std::to_string(i), fe::PointwiseMode_t::IDENTITY,
                       fe::DataType_t::INT32, {operand});
      }
      in.push_back(operand);
    }
    ScoreTensor out = Node(name, mode, logical ? fe::DataType_t::INT32 : type, in);
    out->set_data_type(type);
    return out;
  }

  static fe::DataType_t TypeNamed(char letter, const std::string& item) {
    switch (letter) {
      case 'f':
        return fe::DataType_t::FLOAT;
      case 'i':
        return fe::DataType_t::INT32;
      case 'b':
        return fe::DataType_t::BOOLEAN;
      default:
        throw std::invalid_argument("a score_mod instruction's type is f, i or b: " + item);
    }
  }

  // A pointwise node computing in compute_type; its output typed the same.
  ScoreTensor Node(const std::string& name, fe::PointwiseMode_t mode,
                   fe::DataType_t compute_type, const std::vector<ScoreTensor>& in) {
    auto attributes = fe::graph::Pointwise_attributes().set_name(name).set_mode(mode)
                          .set_compute_data_type(compute_type);
    ScoreTensor out;
    if (in.size() == 1) {
      out = graph_->pointwise(in[0], attributes);
    } else if (in.size() == 2) {
      out = graph_->pointwise(in[0], in[1], attributes);
    } else if (in.size() == 3) {
      out = graph_->pointwise(in[0], in[1], in[2], attributes);
    } else {
      throw std::invalid_argument("a score_mod instruction takes 1 to 3 operands: " + name);
    }
    out->set_data_type(compute_type);
    return out;
  }

  ScoreTensor Operand(const std::string& token) {
    switch (token[0]) {
      case 's':
        return inputs_.score;
      case 'g':
        if (!inputs_.gradient) throw std::invalid_argument("a forward program reads g");
        return inputs_.gradient;
      case 'q':
        return Index(2, query_index_);
      case 'k':
        return Index(3, key_index_);
      case '%': {
        size_t n = std::stoul(token.substr(1));
        if (n >= values_.size()) throw std::invalid_argument("score_mod reads ahead: " + token);
        return values_[n];
      }
      case 't': {
        size_t n = std::stoul(token.substr(1));
        if (n >= inputs_.tables.size() || !inputs_.tables[n]) {
          throw std::invalid_argument("score_mod reads a missing table: " + token);
        }
        return inputs_.tables[n];
      }
      case 'c': {
        // float.hex's text (or inf / nan): strtof reads both, exactly.
        float value = std::strtof(token.c_str() + 1, nullptr);
        return std::make_shared<fe::graph::Tensor_attributes>(value);
      }
      case 'n':
        return std::make_shared<fe::graph::Tensor_attributes>(
            static_cast<int32_t>(std::stol(token.substr(1))));
      default:
        throw std::invalid_argument("unknown score_mod operand " + token);
    }
  }

  // The query's (axis 2) or key's (axis 3) position, generated once per program: int32, the
  // only type cuDNN's kernels generate positions in (its own masks and ALiBi do so too).
  ScoreTensor Index(int64_t axis, ScoreTensor& cached) {
    if (!cached) {
      ScoreTensor anchor = inputs_.gradient ? inputs_.gradient : inputs_.score;
      cached = graph_->pointwise(anchor, fe::graph::Pointwise_attributes()
                                             .set_name(axis == 2 ? "score_mod_q" : "score_mod_k")
                                             .set_mode(fe::PointwiseMode_t::GEN_INDEX)
                                             .set_axis(axis)
                                             .set_compute_data_type(fe::DataType_t::INT32));
      cached->set_data_type(fe::DataType_t::INT32);
    }
    return cached;
  }

  std::shared_ptr<fe::graph::Graph> graph_;
  const ScoreModInputs& inputs_;
  std::vector<ScoreTensor> values_;
  ScoreTensor query_index_, key_index_;
};

}  // namespace

ScoreTensor ApplyScoreMod(const std::shared_ptr<fe::graph::Graph>& graph,
                          const std::string& program, const ScoreModInputs& inputs) {
  return ProgramWriter(graph, inputs).Apply(program);
}

std::vector<bool> ScoreModTablesRead(const SdpaConfig& c) {
  std::vector<bool> read(static_cast<size_t>(std::max<int64_t>(c.score_mod_tables, 0)), false);
  auto mark = [&read](const std::string& program) {
    for (const std::string& item : Split(program, ';')) {
      for (const std::string& token : Split(item, ' ')) {
        if (token[0] != 't') continue;
        size_t n = std::stoul(token.substr(1));
        if (n < read.size()) read[n] = true;
      }
    }
  };
  mark(c.score_mod);
  if (c.direction == Direction::kBackward) mark(c.score_mod_bprop);
  return read;
}

std::vector<ScoreTensor> AddScoreModTables(fe::graph::Graph& graph, int64_t q_heads,
                                           const std::vector<bool>& read, int64_t first_uid) {
  const int64_t count = static_cast<int64_t>(read.size());
  std::vector<ScoreTensor> tables(read.size());
  for (int64_t i = 0; i < count; ++i) {
    if (!read[i]) continue;
    tables[i] = graph.tensor(fe::graph::Tensor_attributes()
                                 .set_name("score_mod_table_" + std::to_string(i))
                                 .set_uid(first_uid + i)
                                 .set_dim({1, q_heads, 1, 1})
                                 .set_stride({count * q_heads, 1, 1, 1})
                                 .set_data_type(fe::DataType_t::FLOAT));
  }
  return tables;
}

}  // namespace jax_sdpa
