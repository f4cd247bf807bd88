// Fuzz target: recipe YAML (config::parse_recipe) on arbitrary bytes, with the path name fixed.
// A first line "#set KEY=VALUE" (a YAML comment) is also applied as a --set override, so the
// override parser is fuzzed with the same inputs. A recipe that parses must reload from its own
// to_yaml() with the same resolved values (what the trainer writes as recipe.yaml and `--resume`
// reads back), and its memory estimate must be computable (nothing is allocated).
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "fuzz_target.h"
#include "models/memory.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(lathe::fuzz::as_text(data, size));
  std::vector<std::string> sets;
  if (text.rfind("#set ", 0) == 0) sets.push_back(text.substr(5, text.find('\n') - 5));
  lathe::fuzz::expect_clean([&] {
    const lathe::Recipe r = lathe::parse_recipe(text, "fuzz.yaml", sets);
    lathe::Recipe again;
    try {
      again = lathe::parse_recipe(r.to_yaml(), "fuzz.resolved.yaml");
    } catch (const lathe::Error& e) {
      std::fprintf(stderr, "fuzz: a valid recipe's to_yaml() does not reload: %s\n", e.what());
      std::abort();
    }
    if (again.to_json() != r.to_json()) {
      std::fprintf(stderr, "fuzz: to_yaml() reloads differently:\n%s\n", r.to_yaml().c_str());
      std::abort();
    }
    const auto est = lathe::estimate_memory(r.model, r.training.micro_batch_size, r.training.seq_len, 2);
    if (est.total_bytes() < est.param_bytes) std::abort();
  });
  return 0;
}
