// Fuzz target: a Hugging Face config.json (ModelConfig::from_hf_json) on arbitrary bytes, read as
// lathe reads it (io::parse_json: depth-checked), in both modes (config.json files: unknown keys
// ignored; recipes: strict, "model." prefix), then validation and the memory estimate for a small
// batch (no model is allocated). A config that parses must round-trip through to_hf_json().
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "config/model_config.h"
#include "fuzz_target.h"
#include "io/json.h"
#include "models/memory.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lathe::fuzz::expect_clean([&] {
    const nlohmann::json j = lathe::io::parse_json(lathe::fuzz::as_text(data, size), "config.json");
    lathe::fuzz::expect_clean([&] { (void)lathe::ModelConfig::from_hf_json(j, "recipe.yaml", "model.", true); });
    const lathe::ModelConfig c = lathe::ModelConfig::from_hf_json(j, "config.json", false);
    lathe::ModelConfig back;
    try {
      back = lathe::ModelConfig::from_hf_json(c.to_hf_json(), "to_hf_json", false);
    } catch (const lathe::Error& e) {
      std::fprintf(stderr, "fuzz: to_hf_json() of a valid config does not reload: %s\n", e.what());
      std::abort();
    }
    if (!(back == c)) {
      std::fprintf(stderr, "fuzz: to_hf_json() reloads differently: %s\n", c.to_hf_json().dump().c_str());
      std::abort();
    }
    const int64_t T = std::min<int64_t>(c.max_position_embeddings, 64);
    const auto est = lathe::estimate_memory(c, 1, T, 2);
    if (est.num_params != c.num_parameters()) std::abort();
    lathe::check_memory_fits(est, c, "config.json");
  });
  return 0;
}
