// model.attention_kernel (issue 12: cuDNN SDPA as an option): lathe (default) | cudnn, parsed from
// the model section (not an HF field), refused with the key, the value and the fix where it cannot
// run (a bad value, device cpu, fp32 compute), noted with document-masked attention, and written
// back by to_json only when not the default (so older recipes and checkpoints compare equal).
#include <gtest/gtest.h>

#include <string>

#include "config/recipe.h"
#include "core/error.h"
#include "error_of.h"

using namespace lathe;

namespace {

std::string recipe(const std::string& model_extra, const std::string& top = "device: cuda\n",
                   const std::string& compute = "bf16", const std::string& data_extra = "") {
  return top + "model: {preset: gpt2-debug" + model_extra + "}\ndata: {train: x" + data_extra +
         "}\nprecision: {compute: " + compute + "}\n";
}

std::string error_of(const std::string& text) {
  return lathe::test::error_of([&] { parse_recipe(text, "r.yaml"); });
}

TEST(AttentionKernelKey, DefaultsToLatheAndAcceptsCudnnOnCudaInHalfPrecision) {
  EXPECT_EQ(parse_recipe(recipe(""), "r.yaml").attention_kernel, "lathe");
  EXPECT_EQ(parse_recipe(recipe(", attention_kernel: lathe", "", "fp32"), "r.yaml").attention_kernel, "lathe");
  const Recipe r = parse_recipe(recipe(", attention_kernel: cudnn"), "r.yaml");
  EXPECT_EQ(r.attention_kernel, "cudnn");
  EXPECT_EQ(parse_recipe(recipe(", attention_kernel: cudnn", "device: cuda\n", "fp16"), "r.yaml").attention_kernel,
            "cudnn");
  // Not an HF field: the model config is the preset's.
  EXPECT_EQ(r.model.to_hf_json(), parse_recipe(recipe(""), "r.yaml").model.to_hf_json());
  EXPECT_EQ(r.to_json()["model"]["attention_kernel"], "cudnn");
  EXPECT_FALSE(parse_recipe(recipe(""), "r.yaml").to_json()["model"].contains("attention_kernel"));
}

TEST(AttentionKernelKey, OverrideFromTheCommandLine) {
  const Recipe r = parse_recipe(recipe(""), "r.yaml", {"model.attention_kernel=cudnn"});
  EXPECT_EQ(r.attention_kernel, "cudnn");
}

TEST(AttentionKernelKey, RefusalsNameTheKeyTheValueAndTheFix) {
  std::string e = error_of(recipe(", attention_kernel: flash"));
  EXPECT_NE(e.find("r.yaml: model.attention_kernel"), std::string::npos) << e;
  EXPECT_NE(e.find("must be one of lathe, cudnn (default lathe), got 'flash'"), std::string::npos) << e;

  e = error_of(recipe(", attention_kernel: cudnn", ""));  // device cpu (the default)
  EXPECT_NE(e.find("model.attention_kernel"), std::string::npos) << e;
  EXPECT_NE(e.find("cudnn runs on GPUs only and this recipe's device is cpu"), std::string::npos) << e;
  EXPECT_NE(e.find("set device: cuda, or model.attention_kernel: lathe"), std::string::npos) << e;

  e = error_of(recipe(", attention_kernel: cudnn", "device: cuda\n", "fp32"));
  EXPECT_NE(e.find("model.attention_kernel"), std::string::npos) << e;
  EXPECT_NE(e.find("bf16 or fp16 only and precision.compute is fp32"), std::string::npos) << e;
  EXPECT_NE(e.find("set precision.compute: bf16"), std::string::npos) << e;

  e = error_of(recipe(", attention_kernel: 3"));
  EXPECT_NE(e.find("got '3'"), std::string::npos) << e;
}

TEST(AttentionKernelKey, DocumentMaskedAttentionIsNotedToStayOnLathesKernel) {
  const Recipe r =
      parse_recipe(recipe(", attention_kernel: cudnn", "device: cuda\n", "bf16", ", attention: document"), "r.yaml");
  bool noted = false;
  for (const std::string& n : r.notes) noted |= n.find("document-masked passes run lathe's attention kernel") != n.npos;
  EXPECT_TRUE(noted);
  const Recipe plain = parse_recipe(recipe(", attention_kernel: cudnn"), "r.yaml");
  for (const std::string& n : plain.notes) EXPECT_EQ(n.find("document-masked"), n.npos) << n;
}

}  // namespace
