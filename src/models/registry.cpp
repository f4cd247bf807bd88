// model_type -> builder. The built-in families register here, explicitly (no static
// initialisers), so the set of model types is visible in one place.
#include <fmt/format.h>

#include "models/memory.h"
#include "models/model.h"

namespace lathe {

void ModelRegistry::add(const std::string& model_type, ModelBuilder builder, const std::string& registrant) {
  for (auto& [name, e] : entries_)
    LATHE_CHECK(name != model_type, "model_type '{}' registered twice: first by {}, again by {}", model_type,
                e.registrant, registrant);
  entries_.push_back({model_type, Entry{builder, nullptr, registrant}});
}

void ModelRegistry::add(const std::string& model_type, ComputeModelBuilder builder, const std::string& registrant) {
  for (auto& [name, e] : entries_)
    LATHE_CHECK(name != model_type, "model_type '{}' registered twice: first by {}, again by {}", model_type,
                e.registrant, registrant);
  entries_.push_back({model_type, Entry{nullptr, builder, registrant}});
}

std::unique_ptr<Model> ModelRegistry::build(const ModelConfig& cfg, const ComputeSpec& compute) const {
  for (auto& [name, e] : entries_) {
    if (name != cfg.model_type) continue;
    if (e.compute_builder) return e.compute_builder(cfg, compute);
    // A builder without a ComputeSpec makes CPU fp32 models: refuse anything else rather than
    // silently computing in another precision or place than asked.
    const Backend& backend = compute.backend ? *compute.backend : cpu_backend();
    LATHE_CHECK(&backend == &cpu_backend() && compute.dtype == DType::F32,
                "model_type '{}' (registered by {}) builds cpu fp32 models only; {} on {} was asked for", name,
                e.registrant, compute_dtype_name(compute.dtype), backend.name());
    return e.builder(cfg);
  }
  throw_error("model_type '{}' is not supported (known: {})", cfg.model_type, fmt::join(names(), ", "));
}

std::vector<std::string> ModelRegistry::names() const {
  std::vector<std::string> out;
  for (auto& [name, e] : entries_) out.push_back(name);
  return out;
}

ModelRegistry& model_registry() {
  static ModelRegistry reg = [] {
    ModelRegistry r;
    r.add("gpt2", build_gpt2, "src/models/gpt2.cpp");
    r.add("llama", build_llama, "src/models/llama.cpp");
    r.add("qwen2", build_llama, "src/models/llama.cpp (qwen2: q/k/v biases)");
    r.add("mistral", build_llama, "src/models/llama.cpp (mistral)");
    r.add("qwen3", build_llama, "src/models/llama.cpp (qwen3: q/k norms)");
    r.add("gpt_neox", build_gpt_neox, "src/models/gpt_neox.cpp");
    r.add("gemma2", build_gemma2, "src/models/gemma2.cpp");
    r.add("phi3", build_llama, "src/models/llama.cpp (phi3: fused qkv_proj / gate_up_proj)");
    r.add("mixtral", build_mixtral, "src/models/moe_layer.cpp (mixtral: sparse mixture of experts)");
    r.add("olmo2", build_olmo2, "src/models/olmo2.cpp");  // olmo2
    r.add("qwen2_moe", build_qwen2_moe, "src/models/moe_shared.cpp (qwen2_moe: experts + a gated shared expert)");
    return r;
  }();
  return reg;
}

std::unique_ptr<Model> build_model(const ModelConfig& cfg, const ComputeSpec& compute) {
  cfg.validate("model");
  // Parameters and gradients are allocated by the Model constructor: refuse what cannot fit
  // before building the table (a config with n_layer 2^16 of width 2^20 must not be tried).
  check_memory_fits(estimate_memory(cfg, 0, 0, 0, 1, compute.dtype), cfg, "model");
  return model_registry().build(cfg, compute);
}

}  // namespace lathe
