// The recipe's `device` key (parse, errors, --set, to_yaml round trip), the backend it selects and
// the refusal on a build without CUDA, and the MFU peak: the GPU table's name matching, the
// SM x clock estimate, and the order recipe > table > estimate > CPU probe.
#include <gtest/gtest.h>

#include <string>

#include "config/recipe.h"
#include "core/error.h"
#include "error_of.h"
#include "kernels/backend_select.h"
#include "train/checkpoint.h"
#include "train/peak.h"

using namespace lathe;

namespace {

const char* kRecipe = R"(
model: {preset: gpt2-debug, vocab_size: 256}
data: {train: data/x, valid_fraction: 0.1}
training: {micro_batch_size: 2, seq_len: 16, steps: 4}
)";

using lathe::test::error_of;

TEST(DeviceKey, DefaultsToCpuAndParses) {
  EXPECT_EQ(parse_recipe(kRecipe, "r.yaml").device, "cpu");
  EXPECT_EQ(parse_recipe(std::string(kRecipe) + "device: cuda\n", "r.yaml").device, "cuda");
  EXPECT_EQ(parse_recipe(kRecipe, "r.yaml", {"device=cuda"}).device, "cuda");
  EXPECT_EQ(parse_recipe(std::string(kRecipe) + "device: cuda\n", "r.yaml", {"device=cpu"}).device, "cpu");
}

TEST(DeviceKey, BadValuesNameTheKey) {
  const std::string e1 = error_of([] { parse_recipe(std::string(kRecipe) + "device: tpu\n", "r.yaml"); });
  EXPECT_NE(e1.find("r.yaml: device: must be one of cpu, cuda (default cpu), got 'tpu'"), std::string::npos) << e1;
  const std::string e2 = error_of([] { parse_recipe(kRecipe, "r.yaml", {"device=gpu"}); });
  EXPECT_NE(e2.find("--set device=gpu"), std::string::npos) << e2;
  EXPECT_NE(e2.find("got 'gpu'"), std::string::npos) << e2;
  const std::string e3 = error_of([] { parse_recipe(std::string(kRecipe) + "device: [cuda]\n", "r.yaml"); });
  EXPECT_NE(e3.find("device: must be one of"), std::string::npos) << e3;
  // A misspelt top-level key is suggested the right one.
  const std::string e4 = error_of([] { parse_recipe(std::string(kRecipe) + "devise: cuda\n", "r.yaml"); });
  EXPECT_NE(e4.find("did you mean 'device'?"), std::string::npos) << e4;
}

TEST(DeviceKey, ResolvedRecipeRoundTrips) {
  const Recipe r = parse_recipe(std::string(kRecipe) + "device: cuda\n", "r.yaml");
  EXPECT_EQ(r.to_json()["device"], "cuda");
  const std::string yaml = r.to_yaml();
  EXPECT_NE(yaml.find("\ndevice: cuda\n"), std::string::npos) << yaml;
  EXPECT_EQ(parse_recipe(yaml, "resolved.yaml").device, "cuda");
}

TEST(DeviceKey, ResumeAcrossDevicesIsNotABreakingChange) {
  // Checkpoints are host fp32 whatever the device: cpu <-> cuda only changes float order.
  Recipe a = parse_recipe(kRecipe, "r.yaml"), b = parse_recipe(kRecipe, "r.yaml", {"device=cuda"});
  auto changes = diff_recipes(a.to_json(), b.to_json());
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].key, "device");
  EXPECT_FALSE(changes[0].breaks_exactness);
  // A checkpoint written before the key existed computed on the CPU.
  nlohmann::json old = a.to_json();
  old.erase("device");
  EXPECT_TRUE(diff_recipes(old, a.to_json()).empty());
}

TEST(DeviceSelect, CpuIsTheHostBackend) {
  const Recipe r = parse_recipe(kRecipe, "r.yaml");
  EXPECT_EQ(&select_backend(r.device, r.source), &cpu_backend());
  EXPECT_EQ(backend_unavailable_reason(cpu_backend()), "");
}

TEST(DeviceSelect, CudaWithoutUsableGpuIsRefusedWithReasonAndFix) {
  const Recipe r = parse_recipe(kRecipe, "r.yaml", {"device=cuda"});
  const std::string why = backend_unavailable_reason(backend_by_name("cuda"));
  if (why.empty()) GTEST_SKIP() << "this build has CUDA and a usable GPU: device: cuda is accepted here";
  const std::string e = error_of([&] { select_backend(r.device, r.source); });
  EXPECT_NE(e.find("r.yaml: device: cuda: "), std::string::npos) << e;
  EXPECT_NE(e.find(why), std::string::npos) << e;
  EXPECT_NE(e.find("or set device: cpu"), std::string::npos) << e;
  if (why.find("built without CUDA") != std::string::npos)
    EXPECT_NE(e.find("-DLATHE_CUDA=ON"), std::string::npos) << e;
  else
    EXPECT_NE(e.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << e;
  // No GPU -> no GPU info, so MFU falls back to the recipe / CPU probe.
  EXPECT_FALSE(cuda_backend().device_info().has_value());
  EXPECT_FALSE(cpu_backend().device_info().has_value());  // a host backend has no device facts
}

TEST(GpuPeak, TableMatchesWholeWordsMostSpecificFirst) {
  auto label = [](const char* name) {
    const GpuPeak* p = find_gpu_peak(name);
    return p ? std::string(p->label) : std::string("(none)");
  };
  EXPECT_EQ(label("NVIDIA H100 80GB HBM3"), "H100 SXM");
  EXPECT_EQ(label("NVIDIA H100 PCIe"), "H100 PCIe");
  EXPECT_EQ(label("NVIDIA H100 NVL"), "H100 NVL");
  EXPECT_EQ(label("NVIDIA H200"), "H200 SXM");
  EXPECT_EQ(label("NVIDIA H200 NVL"), "H200 NVL");
  EXPECT_EQ(label("NVIDIA GH200 480GB"), "GH200");
  EXPECT_EQ(label("NVIDIA A100-SXM4-80GB"), "A100");
  EXPECT_EQ(label("NVIDIA A10"), "A10");    // not A100
  EXPECT_EQ(label("NVIDIA A10G"), "A10G");  // not A10
  EXPECT_EQ(label("NVIDIA L4"), "L4");      // not L40
  EXPECT_EQ(label("NVIDIA L40S"), "L40S");
  EXPECT_EQ(label("NVIDIA GeForce RTX 4090"), "RTX 4090");
  EXPECT_EQ(label("NVIDIA GeForce RTX 3090 Ti"), "RTX 3090 Ti");
  EXPECT_EQ(label("NVIDIA RTX 6000 Ada Generation"), "RTX 6000 Ada");
  EXPECT_EQ(label("Tesla V100-SXM2-16GB"), "(none)");
  EXPECT_EQ(label(""), "(none)");
  EXPECT_DOUBLE_EQ(find_gpu_peak("NVIDIA H200")->tensor16_tflops, 989.4);
}

TEST(GpuPeak, EstimateFromSmsAndClock) {
  // The datasheet figures follow from SMs x clock x FLOP/SM/clock of the architecture.
  GpuInfo a100{"NVIDIA A100-SXM4-40GB", 8, 0, 108, 1410000};
  EXPECT_NEAR(estimate_gpu_peak_gflops(a100, DType::BF16), 312e3, 1e3);
  EXPECT_NEAR(estimate_gpu_peak_gflops(a100, DType::F32), 19.5e3, 0.1e3);
  GpuInfo h100{"NVIDIA H100 80GB HBM3", 9, 0, 132, 1830000};
  EXPECT_NEAR(estimate_gpu_peak_gflops(h100, DType::BF16), 989.4e3, 1e3);
  GpuInfo unknown{"Future GPU", 12, 7, 100, 2000000};
  EXPECT_EQ(estimate_gpu_peak_gflops(unknown, DType::BF16), 0.0);
}

double fake_probe() { return 123.0; }

TEST(GpuPeak, ChoiceOrder) {
  GpuInfo h200{"NVIDIA H200", 9, 0, 132, 1980000};
  // The recipe's figure wins over everything.
  PeakChoice c = choose_peak(5000, &h200, DType::BF16, &fake_probe);
  EXPECT_EQ(c.gflops, 5000);
  EXPECT_NE(c.source.find("training.peak_gflops"), std::string::npos);
  // A GPU in the table: its dense peak for the compute dtype.
  c = choose_peak(0, &h200, DType::BF16, &fake_probe);
  EXPECT_DOUBLE_EQ(c.gflops, 989400);
  EXPECT_FALSE(c.estimated);
  EXPECT_NE(c.source.find("H200 SXM dense bf16"), std::string::npos) << c.source;
  c = choose_peak(0, &h200, DType::F32, &fake_probe);
  EXPECT_DOUBLE_EQ(c.gflops, 66900);
  // Not in the table: the estimate, said as such.
  GpuInfo other{"NVIDIA Hopper Engineering Sample", 9, 0, 100, 2000000};
  c = choose_peak(0, &other, DType::BF16, &fake_probe);
  EXPECT_TRUE(c.estimated);
  EXPECT_DOUBLE_EQ(c.gflops, 4096.0 * 100 * 2e9 / 1e9);
  EXPECT_NE(c.source.find("estimated"), std::string::npos) << c.source;
  EXPECT_NE(c.source.find("training.peak_gflops"), std::string::npos) << c.source;
  // Unknown architecture: 0 (MFU not reported) and the fix named.
  GpuInfo alien{"Alien", 42, 0, 100, 2000000};
  c = choose_peak(0, &alien, DType::BF16, &fake_probe);
  EXPECT_EQ(c.gflops, 0);
  EXPECT_NE(c.source.find("MFU is not reported"), std::string::npos) << c.source;
  // No GPU: the CPU probe.
  c = choose_peak(0, nullptr, DType::F32, &fake_probe);
  EXPECT_EQ(c.gflops, 123.0);
  EXPECT_EQ(c.source, "measured by GEMM probe");
}

}  // namespace
