// diff_recipes (declared in train/checkpoint.h): what changed between a checkpoint's recipe and the
// recipe of the run resuming from it, and whether the change breaks exactness.
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "config/recipe.h"
#include "train/checkpoint.h"

namespace lathe {

using json = nlohmann::json;

namespace {
void flatten(const json& j, const std::string& prefix, std::map<std::string, json>* out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      flatten(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
    if (j.empty() && !prefix.empty()) (*out)[prefix] = j;
    return;
  }
  (*out)[prefix] = j;
}

// Samples per optimizer step: micro_batch_size x grad_accum_steps x parallel.data (a recipe written
// before the parallel section had one process).
int64_t global_batch(const json& recipe) {
  const json& t = recipe.contains("training") ? recipe["training"] : json::object();
  const json& p = recipe.contains("parallel") ? recipe["parallel"] : json::object();
  auto get = [](const json& o, const char* k) {
    return o.contains(k) && o[k].is_number_integer() ? std::max<int64_t>(1, o[k].get<int64_t>()) : int64_t{1};
  };
  return get(t, "micro_batch_size") * get(t, "grad_accum_steps") * get(p, "data");
}

// Keys added after checkpoints were first written, with the value an older recipe implied: an
// absent key compares as this default (a checkpoint from before the precision section computed in
// fp32 without loss scaling), so resuming it is not a change.
const std::vector<std::pair<std::string, json>>& later_defaults() {
  static const std::vector<std::pair<std::string, json>> d = {{"precision.compute", "fp32"},
                                                              {"precision.loss_scale.enabled", false},
                                                              {"precision.loss_scale.initial", 65536.0},
                                                              {"precision.loss_scale.growth_interval", 2000},
                                                              {"precision.loss_scale.backoff", 0.5},
                                                              {"precision.loss_scale.growth", 2.0},
                                                              {"precision.loss_scale.min", 1.0},
                                                              {"training.max_skipped_steps", 20},
                                                              {"data.attention", "causal"},
                                                              {"data.reset_position_ids", false},
                                                              {"data.mask_loss_after_eod", false},
                                                              {"data.eod_token", -1},
                                                              {"device", "cpu"},
                                                              {"parallel.virtual_stages", 1},
                                                              {"parallel.stage_layers", json::array()}};
  static const std::vector<std::pair<std::string, json>> all = [] {
    auto v = d;
    // training.anomaly (train/anomaly.h): a checkpoint from before it ran without the policy.
    const Recipe::Training::Anomaly a;
    for (const auto& [k, x] :
         std::vector<std::pair<std::string, json>>{{"enabled", a.enabled},
                                                   {"warmup_steps", a.warmup_steps},
                                                   {"ema_decay", a.ema_decay},
                                                   {"loss_z_threshold", a.loss_z_threshold},
                                                   {"grad_norm_z_threshold", a.grad_norm_z_threshold},
                                                   {"min_rel_std", a.min_rel_std},
                                                   {"skip", a.skip},
                                                   {"lr_factor", a.lr_factor},
                                                   {"lr_steps", a.lr_steps},
                                                   {"rollback_after", a.rollback_after},
                                                   {"rollback_window", a.rollback_window},
                                                   {"skip_samples", a.skip_samples},
                                                   {"max_rollbacks", a.max_rollbacks}})
      v.emplace_back("training.anomaly." + k, x);
    return v;
  }();
  return all;
}

bool loss_scaling_on(const std::map<std::string, json>& flat) {
  auto it = flat.find("precision.loss_scale.enabled");
  return it != flat.end() && it->second == json(true);
}

bool harmless_key(const std::string& k) {
  // max_skipped_steps only decides when a run of skipped steps stops the run.
  static const std::set<std::string> keys = {
      "training.steps",   "training.eval_interval", "training.eval_batches",     "training.log_interval",
      "training.threads", "training.peak_gflops",   "training.resume",           "data.tokenizer",
      "data.prefetch",    "model.init_from",        "training.max_skipped_steps", "training.eval_tasks",
      "training.eval_tasks_interval",  // evaluation only reads the weights
      "recompute",   // recompute changes memory, not results (bit-identical: tests/models)
      "device"};     // checkpoints are host fp32 whatever the device: a GPU run resumes on CPU and back
  // The layout of processes changes neither the data order nor the math beyond float summation
  // order (the loader's order is global: train/trainer.cpp), so it may change on resume.
  // training.anomaly.* decides what happens on an anomaly, not how a normal step computes.
  return keys.count(k) || k.rfind("output.", 0) == 0 || k.rfind("parallel.", 0) == 0 ||
         k.rfind("training.anomaly.", 0) == 0;
}
}  // namespace

std::vector<RecipeChange> diff_recipes(const json& before, const json& after) {
  std::map<std::string, json> a, b;
  flatten(before, "", &a);
  flatten(after, "", &b);
  for (auto* m : {&a, &b})
    for (const auto& [k, v] : later_defaults()) m->emplace(k, v);
  // The loss scale's settings matter only where scaling is on (fp16, or enabled explicitly).
  const bool scaling = loss_scaling_on(a) || loss_scaling_on(b);
  std::set<std::string> keys;
  for (auto& [k, v] : a) keys.insert(k);
  for (auto& [k, v] : b) keys.insert(k);
  // Splitting the same global batch differently over processes and accumulation steps (e.g. data
  // 2 -> 4 with grad_accum_steps 4 -> 2) is allowed: every step still sees the same samples.
  const bool same_global_batch = global_batch(before) == global_batch(after);
  std::vector<RecipeChange> out;
  for (const auto& k : keys) {
    auto ia = a.find(k), ib = b.find(k);
    const json va = ia == a.end() ? json() : ia->second, vb = ib == b.end() ? json() : ib->second;
    if (va == vb) continue;
    auto str = [](const json& v, bool present) { return present ? v.dump() : std::string("(absent)"); };
    const bool batch_split =
        same_global_batch && (k == "training.micro_batch_size" || k == "training.grad_accum_steps");
    const bool ignored_scale_key = !scaling && k.rfind("precision.loss_scale.", 0) == 0;
    out.push_back(
        {k, str(va, ia != a.end()), str(vb, ib != b.end()), !harmless_key(k) && !batch_split && !ignored_scale_key});
  }
  return out;
}

}  // namespace lathe
