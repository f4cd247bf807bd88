#include "parallel/pipeline_stage.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace lathe::parallel {

int PipelineLayout::rank_of_layer(int64_t layer) const {
  int64_t start = 0;
  for (size_t k = 0; k < vstage_layers.size(); ++k) {
    if (layer < start + vstage_layers[k]) return static_cast<int>(static_cast<int64_t>(k) % spec.stages);
    start += vstage_layers[k];
  }
  throw_error("internal: decoder layer {} is beyond the {} layers of the pipeline stages", layer, start);
}

int PipelineLayout::owner(const ParamSpec& s) const {
  if (s.layer >= 0) return rank_of_layer(s.layer);
  if (s.role == Role::Wte || s.role == Role::Wpe) return 0;
  return static_cast<int>(spec.stages - 1);  // final norm, lm head
}

bool PipelineLayout::holds(const ParamSpec& s, int r) const {
  return owner(s) == r || (tied && s.role == Role::Wte && r == spec.stages - 1);
}

PipelineLayout pipeline_layout(const Recipe& r, int64_t layers, bool tied, int rank) {
  return pipeline_layout(r.parallel, r.training.grad_accum_steps, r.source, layers, tied, rank);
}

PipelineLayout pipeline_layout(const Recipe::Parallel& par, int64_t micro_batches, const std::string& source,
                               int64_t layers, bool tied, int rank) {
  PipelineLayout l;
  const int64_t p = par.pipeline, v = par.virtual_stages;
  l.spec.kind = v > 1 ? pipeline::Kind::Interleaved : pipeline::Kind::OneFOneB;
  l.spec.stages = p;
  l.spec.micro_batches = micro_batches;
  l.spec.virtual_stages = v;
  pipeline::validate(l.spec, source);
  LATHE_CHECK(!par.stage_layers.empty() || layers % (p * v) == 0,
              "{}: parallel.pipeline {} x parallel.virtual_stages {} = {} stages do not divide the model's {} layers "
              "(num_hidden_layers): give parallel.stage_layers (one count per stage, summing to {}) or a degree that "
              "divides {}",
              source, p, v, p * v, layers, layers, layers);
  l.vstage_layers = pipeline::assign_layers(layers, p, v, par.stage_layers, source);
  l.rank = rank;
  l.tied = tied;
  int64_t global = 0;
  std::vector<int64_t> starts;
  for (int64_t n : l.vstage_layers) starts.push_back(global), global += n;
  for (int64_t c = 0; c < v; ++c) {
    const auto k = static_cast<size_t>(c * p + rank);
    l.chunks.push_back({starts[k], l.local_layers, l.vstage_layers[k]});
    l.local_layers += l.vstage_layers[k];
  }
  return l;
}

std::string describe_pipeline(const PipelineLayout& l) {
  const auto sched = pipeline::make_schedule(l.spec);
  const pipeline::SimResult sim = pipeline::simulate(l.spec, sched);
  std::string layers;
  for (int64_t n : l.vstage_layers) layers += (layers.empty() ? "" : ", ") + std::to_string(n);
  return fmt::format(
      "pipeline parallel: {} stages x {} virtual ({}, {} micro-batches per step), layers per stage [{}]{}; bubble "
      "{:.1f}% of the step ((p-1)/(v m + p-1); simulated with backward = 2 x forward: {:.1f}%), at most {} "
      "micro-batch activation sets held per rank",
      l.spec.stages, l.spec.virtual_stages, pipeline::kind_name(l.spec.kind), l.spec.micro_batches, layers,
      l.tied ? "; tied wte on the first and last stage" : "",
      100 * pipeline::bubble_formula(l.spec.stages, l.spec.micro_batches, l.spec.virtual_stages), 100 * sim.bubble,
      *std::max_element(sim.max_in_flight.begin(), sim.max_in_flight.end()));
}

ParamTable stage_table(const ParamTable& whole, const PipelineLayout& layout) {
  // Global layer -> local layer of this rank (chunks in order).
  auto local_layer = [&](int64_t g) -> int64_t {
    for (const auto& c : layout.chunks)
      if (g >= c.global_first && g < c.global_first + c.count) return c.local_first + (g - c.global_first);
    return -1;
  };
  ParamTable t;
  for (const ParamSpec& s : whole.specs()) {
    if (!layout.holds(s, layout.rank)) continue;
    ParamSpec& l = t.add(s.name, s.shape, s.init, s.init_std, s.shard, s.decay, s.hf_transposed)
                       .as(s.role, s.layer >= 0 ? local_layer(s.layer) : -1);
    l.sections = s.sections;
    l.section_units = s.section_units;
  }
  return t;
}

std::unique_ptr<Model> build_stage_model(const Model& whole, const PipelineLayout& layout) {
  ModelConfig cfg = whole.config();
  cfg.num_hidden_layers = layout.local_layers;
  // Per-layer sliding windows (qwen2 max_window_layers, layer_types, Gemma 2's alternation) follow
  // their layers into the stage: local layer c.local_first + i is global layer c.global_first + i.
  if (!cfg.sliding_layers.empty()) {
    const std::vector<uint8_t> global = cfg.sliding_layers;
    cfg.sliding_layers.assign(static_cast<size_t>(layout.local_layers), 0);
    for (const auto& c : layout.chunks)
      for (int64_t i = 0; i < c.count; ++i)
        cfg.sliding_layers[static_cast<size_t>(c.local_first + i)] = global[static_cast<size_t>(c.global_first + i)];
  }
  Arch arch = whole.arch();
  arch.embedding = layout.first();
  arch.head = layout.last();
  auto m = std::make_unique<Model>(cfg, arch, stage_table(whole.params(), layout), whole.compute_spec());
  m->set_tensor_shard(whole.tensor_shard());  // a tensor shard's stage is a shard too
  return m;
}

void scatter_stage(const ParamTable& global, const float* g, const ParamTable& local, float* l) {
  for (const ParamSpec& s : local.specs()) {
    const ParamSpec& gs = global.at(s.name);
    LATHE_CHECK(gs.numel() == s.numel(), "internal: stage tensor '{}' has {} values, the whole model's {}", s.name,
                s.numel(), gs.numel());
    std::memcpy(l + s.offset, g + gs.offset, static_cast<size_t>(s.numel()) * sizeof(float));
  }
}

void gather_stages(dist::Communicator& pp, const PipelineLayout& layout, const ParamTable& global,
                   const ParamTable& local, const float* l, float* g) {
  const int p = pp.size();
  LATHE_CHECK(p == layout.stages(), "internal: pipeline group of {} ranks for {} stages", p, layout.stages());
  // Each rank contributes its owned tensors in the global table's order; every rank can tell the
  // others' from the layout.
  std::vector<size_t> counts(static_cast<size_t>(p), 0);
  for (const ParamSpec& s : global.specs())
    counts[static_cast<size_t>(layout.owner(s))] += static_cast<size_t>(s.numel());
  std::vector<float> send;
  send.reserve(counts[static_cast<size_t>(pp.rank())]);
  for (const ParamSpec& s : global.specs())
    if (layout.owner(s) == pp.rank()) {
      const float* src = l + local.at(s.name).offset;
      send.insert(send.end(), src, src + s.numel());
    }
  std::vector<float> all(global.total());
  pp.all_gather(send.data(), all.data(), counts, DType::F32);
  std::vector<size_t> at(static_cast<size_t>(p), 0);
  for (int r = 1; r < p; ++r)
    at[static_cast<size_t>(r)] = at[static_cast<size_t>(r) - 1] + counts[static_cast<size_t>(r) - 1];
  for (const ParamSpec& s : global.specs()) {
    size_t& pos = at[static_cast<size_t>(layout.owner(s))];
    std::memcpy(g + s.offset, all.data() + pos, static_cast<size_t>(s.numel()) * sizeof(float));
    pos += static_cast<size_t>(s.numel());
  }
}

}  // namespace lathe::parallel
