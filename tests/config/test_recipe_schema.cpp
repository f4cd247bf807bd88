// The recipe schema (config/recipe_schema.h): every row is a known key that parses, bounds-checks,
// appears in to_json and re-loads; the optimizer, schedule and loss-scale sections are optim's
// configs with one set of defaults; each key's resume class.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

#include "config/recipe.h"
#include "config/recipe_diff.h"
#include "config/recipe_schema.h"
#include "core/error.h"

using namespace lathe;
using json = nlohmann::json;

namespace {

const char* kBase = "model: {preset: gpt2-debug}\ndata: {train: data/x, valid_fraction: 0.1}\n";

std::string pointer(std::string_view path) {
  std::string p(1, '/');
  p.append(path);
  for (auto& c : p)
    if (c == '.') c = '/';
  return p;
}

std::string error_of(const std::vector<std::string>& ovs) {
  try {
    parse_recipe(kBase, "recipe.yaml", ovs);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(RecipeSchema, EveryRowIsKnownWrittenAndSuggested) {
  const Recipe r = parse_recipe(kBase, "recipe.yaml");
  const json j = r.to_json();
  for (const schema::Field& f : schema::fields()) {
    SCOPED_TRACE(std::string(f.path));
    if (f.json_if.empty()) {
      ASSERT_TRUE(j.contains(json::json_pointer(pointer(f.path))));
      EXPECT_EQ(j.at(json::json_pointer(pointer(f.path))), schema::value_json(f, r));
    }
    // The model section's keys are ModelConfig's; a typo of a top-level value is an unknown section.
    if (f.section() == "model" || f.section().empty()) continue;
    const auto keys = schema::keys_of(f.section());
    EXPECT_NE(std::find(keys.begin(), keys.end(), f.name()), keys.end());
    const std::string typo = std::string(f.path) + "x";
    EXPECT_NE(error_of({typo + "=1"}).find("did you mean '" + std::string(f.path) + "'"), std::string::npos)
        << error_of({typo + "=1"});
  }
}

TEST(RecipeSchema, TypeErrorsNameTheKey) {
  for (const schema::Field& f : schema::fields()) {
    if (f.section() == "model" || f.kind == schema::Kind::Text) continue;  // Text takes numbers as text
    SCOPED_TRACE(std::string(f.path));
    const std::string m = error_of({std::string(f.path) + "={a: 1}"});
    EXPECT_NE(m.find(std::string(f.path) + ": "), std::string::npos) << m;
    EXPECT_NE(m.find("a mapping"), std::string::npos) << m;
  }
}

TEST(RecipeSchema, SectionsAreTheOptimConfigs) {
  const Recipe r;
  // One default each (the WSD decay fraction was 0.1 in optim/schedule.h and 0.2 in the recipe;
  // every run used the recipe's).
  EXPECT_EQ(schedule_config(r).decay_fraction, 0.2);
  EXPECT_EQ(optim::ScheduleConfig{}.decay_fraction, 0.2);
  EXPECT_EQ(&optimizer_config(r), &r.optimizer);
  EXPECT_EQ(optim::LossScaleConfig{}.max_skipped_steps, r.training.max_skipped_steps);
  Recipe s = parse_recipe(kBase, "recipe.yaml",
                          {"optimizer.lr=0.002", "training.steps=50", "schedule.name=wsd", "training.max_skipped_steps=7",
                           "precision.loss_scale.enabled=true", "precision.loss_scale.initial=1024"});
  const optim::ScheduleConfig sc = schedule_config(s);
  EXPECT_EQ(sc.lr, 0.002);
  EXPECT_EQ(sc.total_steps, 50);
  EXPECT_EQ(sc.name, "wsd");
  const optim::LossScaleConfig lc = loss_scale_config(s);
  EXPECT_TRUE(lc.enabled);
  EXPECT_EQ(lc.initial, 1024);
  EXPECT_EQ(lc.max_skipped_steps, 7);
}

TEST(RecipeSchema, ResumeClasses) {
  using E = schema::OnResume;
  EXPECT_EQ(schema::on_resume("optimizer.lr"), E::Breaks);
  EXPECT_EQ(schema::on_resume("training.steps"), E::Harmless);
  EXPECT_EQ(schema::on_resume("training.micro_batch_size"), E::BatchSplit);
  EXPECT_EQ(schema::on_resume("precision.loss_scale.growth"), E::LossScale);
  // Keys without a row: the class of their nearest section when its rows agree.
  EXPECT_EQ(schema::on_resume("model.n_layer"), E::Breaks);
  EXPECT_EQ(schema::on_resume("output.some.future_key"), E::Harmless);
  EXPECT_EQ(schema::on_resume("training.anomaly.future_key"), E::Harmless);
  EXPECT_EQ(schema::on_resume("training.future_key"), E::Breaks);
  EXPECT_EQ(schema::on_resume("future_section"), E::Breaks);
  // An absent key added later compares as its default: no change.
  const json a = parse_recipe(kBase, "recipe.yaml").to_json();
  json old = a;
  old["training"]["anomaly"].erase("ema_decay");
  old["precision"].erase("compute");
  EXPECT_TRUE(diff_recipes(old, a).empty());
  old["optimizer"].erase("lr");
  const auto d = diff_recipes(old, a);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].key, "optimizer.lr");
  EXPECT_TRUE(d[0].breaks_exactness);
}

// Every row's bounds and choices are checked (config/recipe.cpp calls check_bounds per section).
TEST(RecipeSchema, EveryBoundIsChecked) {
  int checked = 0;
  for (const schema::Field& f : schema::fields()) {
    std::string value;
    const bool integer = f.kind == schema::Kind::Int || f.kind == schema::Kind::Int32;
    if (integer && f.min > INT32_MIN)
      value = fmt::format("{}", f.min - 1);
    else if (f.kind == schema::Kind::Float && !std::isinf(f.lo))
      value = fmt::format("{}", f.lo_open ? f.lo : f.lo - 1);
    else if (f.kind == schema::Kind::Text && !f.choices.empty())
      value = "zzz";
    else
      continue;
    SCOPED_TRACE(std::string(f.path) + "=" + value);
    const std::string m = error_of({std::string(f.path) + "=" + value});
    EXPECT_NE(m.find(std::string(f.path) + ": "), std::string::npos) << m;
    ++checked;
  }
  EXPECT_GT(checked, 40);
}
