// One rank's place in a data x tensor x pipeline job and its share of the model (issue 10, item 4):
// the process groups it belongs to, the model it computes with (its tensor shard of its pipeline
// stage), and moving the whole model's flat buffers (weights, moments) to and from that share.
//
// Ranks are ordered tensor fastest, then data, then pipeline (Megatron's order):
//   world rank = (pp_rank * dp + dp_rank) * tp + tp_rank,
// so a tensor group is tp consecutive ranks (one host when ranks fill hosts in order), and a
// replica (one data rank: tp x pp ranks) holds the whole model once.
//
// A rank's model is built in two cuts of the whole table, both keeping the global names:
//   pipeline: the stage's tensors (pipeline_stage.h; global shapes, local layer numbers);
//   tensor:   each of those tensors' shard (tensor_parallel.h; shard rules and sections).
// Either cut alone is the tp = 1 or pp = 1 case of the same code. The model itself knows nothing of
// either: the stage is an Arch without embedding / head, the shard a config with fewer heads.
#pragma once
#include <memory>
#include <utility>
#include <vector>

#include "config/recipe.h"
#include "dist/comm.h"
#include "models/model.h"
#include "parallel/pipeline_stage.h"

namespace lathe::parallel {

struct RankLayout {
  int tp = 1, dp = 1, pp = 1;
  int tp_rank = 0, dp_rank = 0, pp_rank = 0;
  // Context parallelism (parallel/context_parallel.h; tensor = pipeline = 1 for now): the ranks are
  // ordered tensor, context, data, pipeline, and the context ranks of one data rank hold the same
  // samples' rows. dp / dp_rank above count the gradient group (data x context ranks: replicated
  // weights' gradients are reduced over it); samples_dp() / samples_dp_rank() the data ranks proper
  // (which samples a rank reads).
  int cp = 1, cp_rank = 0;
  int samples_dp() const { return dp / cp; }
  int samples_dp_rank() const { return dp_rank / cp; }
  // The layout of world rank `rank` of `world` ranks with tensor degree tp and pipeline degree pp
  // (world must be a multiple of tp * pp: train/session.cpp checks it with the recipe's names).
  static RankLayout of(int rank, int world, int tp, int pp, int cp = 1);
  bool model_parallel() const { return tp > 1 || pp > 1; }
};

// The groups of one rank; made collectively over the world (every rank splits in the same order).
// A group this layout does not need is null.
struct ProcessGroups {
  std::unique_ptr<dist::Communicator> tp;       // tensor group: same data and pipeline rank (tp > 1)
  std::unique_ptr<dist::Communicator> pp;       // pipeline group: same data and tensor rank (pp > 1)
  std::unique_ptr<dist::Communicator> dp;       // data group: same tensor and pipeline rank (tp or pp > 1)
  std::unique_ptr<dist::Communicator> replica;  // the tp x pp ranks of one data rank (tp > 1 and pp > 1)
  std::unique_ptr<dist::Communicator> cp;       // context group: the context ranks of one data rank (cp > 1)
  // Tensor rank 0 on pipeline rank 0 of each replica, keyed by data rank (tp or pp > 1): they
  // write the whole-model checkpoints and share the writing of the moments.
  std::unique_ptr<dist::Communicator> ckpt_writers;
  // The group that holds one replica's whole model: tp, pp or replica; null without model parallelism.
  dist::Communicator* model_group() const { return replica ? replica.get() : tp ? tp.get() : pp.get(); }
};
ProcessGroups make_process_groups(dist::Communicator& world, const RankLayout& l);

// This rank's model: the tensor shard (build_shard_model(whole, tp, sequence, tp_rank)) of pipeline
// stage `stage` (null: the whole depth), computing like `whole`, weights not set (scatter_to_rank).
// Activations are not allocated (the trainer or the pipeline executor does).
std::unique_ptr<Model> build_rank_model(const Model& whole, int tp, int tp_rank, bool sequence,
                                        const PipelineLayout* stage);

// Moves buffers laid out like the whole model's parameters (weights, moments) between the whole
// layout and one rank's model. Holds copies of the tables; the groups must outlive it.
class RankShare {
 public:
  // `whole`: the whole model's table; `local`: this rank's model's table; `stage`: the pipeline
  // layout (null without a pipeline); tp_group / pp_group as in ProcessGroups.
  RankShare(const ParamTable& whole, const ParamTable& local, const PipelineLayout* stage, int tp_rank, int tp,
            dist::Communicator* tp_group, dist::Communicator* pp_group);

  // This rank's values of every local tensor from the whole buffer `g` into the local buffer `l`.
  void scatter(const float* g, float* l) const;
  // The whole buffer `g` on every rank of the replica from each rank's local buffer `l`
  // (collective over the tensor group, then the pipeline group).
  void gather(const float* l, float* g) const;
  // [begin, end) ranges of the local buffer this rank counts in global sums over its replica
  // (gradient norm): split tensors on every tensor rank, replicated ones on tensor rank 0, a tied
  // wte on pipeline rank 0 only. Merged where adjacent.
  std::vector<std::pair<size_t, size_t>> owned_ranges() const;

  const ParamTable& whole() const { return whole_; }
  const ParamTable& local() const { return local_; }
  int tp_rank() const { return tp_rank_; }
  int tp() const { return tp_; }

 private:
  ParamTable whole_, local_;
  ParamTable stage_;  // global shapes of the stage's tensors (the whole table without a pipeline)
  std::unique_ptr<PipelineLayout> layout_;
  int tp_rank_ = 0, tp_ = 1;
  dist::Communicator *tp_group_ = nullptr, *pp_group_ = nullptr;
};

}  // namespace lathe::parallel
