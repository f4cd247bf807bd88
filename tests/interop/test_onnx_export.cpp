// save_onnx's refusals, each naming what is missing and leaving no file behind (the graphs it does
// write are run with onnxruntime in tests/io/test_onnx_export.py); and the initializers it writes
// for llama-debug come from the ParamTable by role: every tensor once, q|k|v and gate|up split.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>

#include "config/model_config.h"
#include "error_of.h"
#include "interop/onnx_export.h"
#include "io/fs.h"
#include "models/model.h"

using namespace lathe;
namespace fs = std::filesystem;

namespace {

std::string tmp_path(const std::string& name) {
  static std::string d = [] {
    auto p = fs::temp_directory_path() / ("lathe_onnx_export_test_" + std::to_string(::getpid()));
    fs::create_directories(p);
    return p.string();
  }();
  return d + "/" + name;
}

using lathe::test::error_of;

void expect_refused(const Model& m, const OnnxExportOptions& o, std::initializer_list<const char*> must) {
  const std::string path = tmp_path("refused.onnx");
  const std::string msg = error_of([&] { save_onnx(m, path, o); });
  ASSERT_FALSE(msg.empty()) << "expected a refusal";
  for (const char* s : must) EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' missing from: " << msg;
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".data"));
}

}  // namespace

TEST(OnnxExport, RefusesAFamilyWithoutAGraphBuilder) {
  ModelConfig c = ModelConfig::preset("llama-debug");
  c.model_type = "mamba";
  c.family = "ssm";
  auto m = build_llama(c);
  expect_refused(
      *m, {},
      {"model_type 'mamba'", "family 'ssm'", "supported: gpt2, llama, qwen2, mistral, qwen3, phi3, gemma2, gpt_neox"});
}

TEST(OnnxExport, RefusesAnActivationTheGraphDoesNotBuild) {
  ModelConfig c = ModelConfig::preset("gpt2-debug");
  c.hidden_act = "relu";
  auto m = build_gpt2(c);
  expect_refused(*m, {}, {"hidden_act 'relu'", "gelu_new"});
}

TEST(OnnxExport, RefusesBf16AndAStaticLengthBeyondThePositions) {
  auto m = build_model(ModelConfig::preset("qwen2-debug"));
  OnnxExportOptions o;
  o.dtype = DType::BF16;
  expect_refused(*m, o, {"fp32 or fp16", "BF16"});
  o.dtype = DType::F32;
  o.static_seq_len = 129;
  expect_refused(*m, o, {"--static-seq-len 129", "max_position_embeddings = 128"});
}

TEST(OnnxExport, Fp16RefusesAWeightOutsideTheRange) {
  auto m = build_model(ModelConfig::preset("llama-debug"));
  m->init_weights(1);
  m->param("model.layers.1.mlp.down_proj.weight")[5] = 1e6f;
  OnnxExportOptions o;
  o.dtype = DType::F16;
  expect_refused(*m, o, {"model.layers.1.mlp.down_proj.weight", "element [0, 5] is 1000000", "--dtype fp32"});
  o.dtype = DType::F32;  // fp32 holds it
  const std::string path = tmp_path("big_weight.onnx");
  EXPECT_NE(save_onnx(*m, path, o).find("wrote"), std::string::npos);
  EXPECT_TRUE(fs::exists(path));
}

TEST(OnnxExport, InitializersAreTheParamTableByRole) {
  ModelConfig c = ModelConfig::preset("llama-debug");  // untied: lm_head present; q|k|v, gate|up fused in the buffer
  auto m = build_model(c);
  m->init_weights(2);
  const std::string path = tmp_path("llama.onnx");
  save_onnx(*m, path, {});
  const std::string file = io::read_file(path);
  // Every tensor of the table is an initializer under its own name (llama's q/k/v and gate/up are
  // separate tensors, so the splits take their names), plus the RoPE tables.
  for (const ParamSpec& s : m->params().specs()) EXPECT_NE(file.find(s.name), std::string::npos) << s.name;
  EXPECT_NE(file.find("rope.cos"), std::string::npos);
  // The k_proj weight of layer 0 stored transposed [C, KV*D]: element (i, j) = W[j, i].
  const ParamSpec& k = m->params().at("model.layers.0.self_attn.k_proj.weight");
  const int64_t rows = k.shape[0], cols = k.shape[1];
  std::vector<float> t(static_cast<size_t>(rows * cols));
  const float* w = m->param_data() + k.offset;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t col = 0; col < cols; ++col) t[static_cast<size_t>(col * rows + r)] = w[r * cols + col];
  const std::string raw(reinterpret_cast<const char*>(t.data()), t.size() * 4);
  EXPECT_NE(file.find(raw), std::string::npos) << "k_proj not found transposed in the file";
}
