#include "config/recipe_diff.h"

#include <map>
#include <set>
#include <utility>
#include <vector>

#include "config/model_keys.h"
#include "config/recipe_schema.h"

namespace lathe {

using json = nlohmann::json;

namespace {
// model.rope_scaling is one value (its keys only mean something together; a run that turns it on
// names one change, not one per key).
void flatten(const json& j, const std::string& prefix, std::map<std::string, json>* out) {
  if (j.is_object() && prefix != "model.rope_scaling") {
    for (auto it = j.begin(); it != j.end(); ++it)
      flatten(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
    if (j.empty() && !prefix.empty()) (*out)[prefix] = j;
    return;
  }
  (*out)[prefix] = j;
}

bool loss_scaling_on(const std::map<std::string, json>& flat) {
  auto it = flat.find("precision.loss_scale.enabled");
  return it != flat.end() && it->second == json(true);
}

}  // namespace

// Samples per optimizer step: micro_batch_size x grad_accum_steps x parallel.data (a recipe written
// before the parallel section had one process).
int64_t recipe_global_batch(const json& recipe) {
  const json& t = recipe.contains("training") ? recipe["training"] : json::object();
  const json& p = recipe.contains("parallel") ? recipe["parallel"] : json::object();
  auto get = [](const json& o, const char* k) {
    return o.contains(k) && o[k].is_number_integer() ? std::max<int64_t>(1, o[k].get<int64_t>()) : int64_t{1};
  };
  return get(t, "micro_batch_size") * get(t, "grad_accum_steps") * get(p, "data");
}

std::vector<RecipeChange> diff_recipes(const json& before, const json& after) {
  std::map<std::string, json> a, b;
  flatten(before, "", &a);
  flatten(after, "", &b);
  for (auto* m : {&a, &b})
    for (const auto& [k, v] : schema::later_defaults()) m->emplace(k, v);
  // The loss scale's settings matter only where scaling is on (fp16, or enabled explicitly).
  const bool scaling = loss_scaling_on(a) || loss_scaling_on(b);
  std::set<std::string> keys;
  for (auto& [k, v] : a) keys.insert(k);
  for (auto& [k, v] : b) keys.insert(k);
  // Splitting the same global batch differently over processes and accumulation steps (e.g. data
  // 2 -> 4 with grad_accum_steps 4 -> 2) is allowed: every step still sees the same samples.
  const bool same_global_batch = recipe_global_batch(before) == recipe_global_batch(after);
  std::vector<RecipeChange> out;
  for (const auto& k : keys) {
    auto ia = a.find(k), ib = b.find(k);
    const json va = ia == a.end() ? json() : ia->second, vb = ib == b.end() ? json() : ib->second;
    if (va == vb) continue;
    auto str = [](const json& v, bool present) { return present ? v.dump() : std::string("(absent)"); };
    const schema::OnResume effect = schema::on_resume(k);
    const bool breaks = effect == schema::OnResume::Breaks ||
                        (effect == schema::OnResume::BatchSplit && !same_global_batch) ||
                        (effect == schema::OnResume::LossScale && scaling);
    const bool shape = k.rfind("model.", 0) == 0 && is_model_shape_key(std::string_view(k).substr(6));
    out.push_back({k, str(va, ia != a.end()), str(vb, ib != b.end()), breaks || shape, shape});
  }
  return out;
}

}  // namespace lathe
