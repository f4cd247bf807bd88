#include <gtest/gtest.h>

#include "config/model_config.h"
#include "models/model.h"

using namespace lathe;

namespace {
std::unique_ptr<Model> dummy_builder(const ModelConfig& c) { return build_gpt2(c); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(ModelRegistry, DuplicateNameNamesBothRegistrants) {
  ModelRegistry r;
  r.add("gpt2", dummy_builder, "first.cpp");
  std::string msg = error_of([&] { r.add("gpt2", dummy_builder, "second.cpp"); });
  EXPECT_NE(msg.find("gpt2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("first.cpp"), std::string::npos) << msg;
  EXPECT_NE(msg.find("second.cpp"), std::string::npos) << msg;
}

TEST(ModelRegistry, BuiltinsAndUnknownType) {
  auto names = model_registry().names();
  for (const char* t : {"gpt2", "llama", "qwen2", "mistral"})
    EXPECT_NE(std::find(names.begin(), names.end(), t), names.end()) << t;
  ModelConfig c = ModelConfig::preset("gpt2-debug");
  c.model_type = "bert";
  std::string msg = error_of([&] { model_registry().build(c); });
  EXPECT_NE(msg.find("'bert'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("llama"), std::string::npos) << msg;  // lists the known ones
}

TEST(ModelRegistry, EveryFamilyBuildsItsDebugPreset) {
  for (const char* p : {"gpt2-debug", "llama-debug", "qwen2-debug", "mistral-debug"}) {
    ModelConfig c = ModelConfig::preset(p);
    auto m = build_model(c);
    EXPECT_EQ(static_cast<int64_t>(m->num_params()), c.num_parameters()) << p;
  }
}
