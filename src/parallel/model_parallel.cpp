#include "parallel/model_parallel.h"

#include "core/error.h"
#include "parallel/tensor_parallel.h"

namespace lathe::parallel {

RankLayout RankLayout::of(int rank, int world, int tp, int pp, int cp) {
  LATHE_CHECK(tp >= 1 && pp >= 1 && world % (tp * pp) == 0 && rank >= 0 && rank < world,
              "internal: rank {} of {} with tensor {} x pipeline {}", rank, world, tp, pp);
  LATHE_CHECK(cp >= 1 && (world / (tp * pp)) % cp == 0, "internal: context {} does not divide the {} data ranks", cp,
              world / (tp * pp));
  RankLayout l;
  l.cp = cp;
  l.cp_rank = (rank / tp) % cp;
  l.tp = tp;
  l.pp = pp;
  l.dp = world / (tp * pp);
  l.tp_rank = rank % tp;
  l.dp_rank = (rank / tp) % l.dp;
  l.pp_rank = rank / (tp * l.dp);
  return l;
}

ProcessGroups make_process_groups(dist::Communicator& world, const RankLayout& l) {
  ProcessGroups g;
  // Context: the cp consecutive (after tensor) ranks of one data rank.
  if (l.cp > 1) g.cp = world.split((l.pp_rank * l.dp + l.dp_rank) / l.cp * l.tp + l.tp_rank, l.cp_rank, "cp");
  if (!l.model_parallel()) return g;  // the world is the data group
  // Colors number the groups; keys order a group's ranks by the coordinate that varies in it.
  if (l.tp > 1) g.tp = world.split(l.pp_rank * l.dp + l.dp_rank, l.tp_rank, "tp");
  if (l.pp > 1) g.pp = world.split(l.dp_rank * l.tp + l.tp_rank, l.pp_rank, "pp");
  g.dp = world.split(l.pp_rank * l.tp + l.tp_rank, l.dp_rank, "dp");
  if (l.tp > 1 && l.pp > 1) g.replica = world.split(l.dp_rank, l.pp_rank * l.tp + l.tp_rank, "replica");
  g.ckpt_writers = world.split(l.tp_rank == 0 && l.pp_rank == 0 ? 0 : -1, l.dp_rank, "ckpt");
  return g;
}

std::unique_ptr<Model> build_rank_model(const Model& whole, int tp, int tp_rank, bool sequence,
                                        const PipelineLayout* stage) {
  const ComputeSpec spec = whole.compute_spec();
  if (tp == 1) return stage ? build_stage_model(whole, *stage) : build_model(whole.config(), spec);
  if (!stage) return build_shard_model(whole.config(), tp, sequence, tp_rank, spec);
  // The stage of the tensor shard: the shard's table (the family's builder makes it) cut to the
  // stage's tensors. The whole-depth shard is a table only (no parameters), dropped at once.
  ComputeSpec table_only = spec;
  table_only.gradients = table_only.parameters = false;
  const std::unique_ptr<Model> shard = build_shard_model(whole.config(), tp, sequence, tp_rank, table_only);
  return build_stage_model(*shard, *stage);  // computes like the shard's spec, with parameters and gradients
}

RankShare::RankShare(const ParamTable& whole, const ParamTable& local, const PipelineLayout* stage, int tp_rank, int tp,
                     dist::Communicator* tp_group, dist::Communicator* pp_group)
    : whole_(whole),
      local_(local),
      stage_(stage ? stage_table(whole, *stage) : whole),
      layout_(stage ? std::make_unique<PipelineLayout>(*stage) : nullptr),
      tp_rank_(tp_rank),
      tp_(tp),
      tp_group_(tp_group),
      pp_group_(pp_group) {
  LATHE_CHECK(tp == 1 || tp_group != nullptr, "internal: tensor degree {} without a tensor group", tp);
  LATHE_CHECK(!stage || pp_group != nullptr, "internal: a pipeline stage without a pipeline group");
}

void RankShare::scatter(const float* g, float* l) const {
  // Both cuts at once: each local tensor's shard runs, read from the whole tensor of the same name.
  scatter_shard(whole_, g, local_, l, tp_rank_, tp_);
}

void RankShare::gather(const float* l, float* g) const {
  if (!layout_) {  // tensor parallelism only
    if (tp_ > 1)
      gather_global(*tp_group_, whole_, local_, l, g);
    else
      std::copy(l, l + whole_.total(), g);
    return;
  }
  if (tp_ == 1) {
    gather_stages(*pp_group_, *layout_, whole_, local_, l, g);
    return;
  }
  // The stage's whole tensors from the tensor group's shards, then the whole model from the stages.
  std::vector<float> stage(stage_.total());
  gather_global(*tp_group_, stage_, local_, l, stage.data());
  gather_stages(*pp_group_, *layout_, whole_, stage_, stage.data(), g);
}

std::vector<std::pair<size_t, size_t>> RankShare::owned_ranges() const {
  return local_.ranges([&](const ParamSpec& s) {
    const bool split =
        tp_ > 1 && (s.shard == ShardRule::Column || s.shard == ShardRule::Row || s.shard == ShardRule::Vocab);
    if (!split && tp_rank_ != 0) return false;                                       // replicated: tensor rank 0's
    return !(layout_ && layout_->tied && s.role == Role::Wte && !layout_->first());  // tied wte: stage 0's
  });
}

}  // namespace lathe::parallel
