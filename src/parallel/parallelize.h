// src/parallel/: parallelism applied to a model from outside it. parallelize() (this file) turns the
// whole model and a layout into this rank's model (tensor shard, pipeline stage and executor);
// DistOptimizer (dist_optimizer.h) is the one step path of every layout, host and device: bucketed
// gradient reduction (grad_sync.h), ZeRO shards (flat_shards.h), the global norm and the update;
// tensor_parallel.h holds the shard rules and the collectives (host groups, or NCCL:
// tensor_parallel_device.cpp); pipeline_*.h the schedules and their executor; plan.h `lathe plan`.
//
// One rank's model from the whole model and the layout (issue 24 item 3): `parallelize` cuts the
// rank's tensor shard of its pipeline stage, gives it its weights, attaches the tensor-parallel
// collectives and the pipeline executor, and returns the RankModel the trainer computes with (the
// whole model rebuilt lazily, only while a checkpoint, an HF directory or a rollback needs it).
// Like torchtitan's parallelize_llama, the parts are applied in one documented order (parallelize).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/recipe.h"
#include "dist/comm.h"
#include "models/model.h"
#include "parallel/expert_parallel.h"
#include "parallel/model_parallel.h"
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_stage.h"

namespace lathe::parallel {

// This rank's coordinates and groups (model_parallel.h: tensor fastest, then data, then pipeline,
// so a tensor group is tp consecutive ranks: one host when ranks fill hosts in order). Made
// collectively over the world. The degrees must divide the world (train/session.cpp checks it with
// the recipe's names first).
struct Topology {
  Topology(dist::Communicator& world, const Recipe::Parallel& p);
  dist::Communicator& world;
  const RankLayout lay;
  ProcessGroups groups;
  int rank() const { return world.rank(); }
  bool rank0() const { return world.rank() == 0; }
  // The data-parallel group (the whole world without tensor or pipeline parallelism).
  dist::Communicator& data() const { return groups.dp ? *groups.dp : world; }
  // The ranks of one replica (tensor x pipeline): the gradient norm's group without ZeRO, and the
  // barrier after a checkpoint. Null without model parallelism.
  dist::Communicator* replica() const { return groups.model_group(); }
};

// What parallelize needs of the recipe: its parallel section and the few settings around it.
struct ParallelConfig {
  Recipe::Parallel parallel;  // degrees, sequence, virtual_stages, stage_layers
  int64_t micro_batches = 1;  // training.grad_accum_steps: the pipeline schedule's micro-batches
  std::string recompute;      // the recipe's recompute (parsed under model parallelism)
  std::string source;         // the recipe's name, for errors
  // Replaces attach_tensor_parallel (null: that one, on the host group): the device backends'
  // collectives (attach_tensor_parallel_on_device, tensor_parallel.h); returns a group that must
  // outlive the model's passes.
  std::function<std::unique_ptr<dist::Communicator>(Model&, dist::Communicator& tp_host)> attach_tp;
  bool stage_through_host = false;  // the pipeline's device staging on the CPU (parallel/dist_optimizer.h's test hook)
  static ParallelConfig of(const Recipe& r);  // everything but attach_tp / stage_through_host
};

// Where the rank's weights come from. `whole_has_weights`: the whole model holds its weights (a
// whole-model run, or init_from: every rank loaded the whole HF model) and each rank takes its share
// of them; otherwise the whole model is only a table, and the rank's weights are read by
// `load_shard` (a checkpoint: only the runs this rank holds) or, without it, drawn tensor by tensor
// as init_weights(seed) draws the whole model's and sliced (init_shard). `fresh`: a new run's
// weights (init_weights(seed) on a whole model that holds its weights).
struct InitialWeights {
  bool whole_has_weights = true;
  bool fresh = false;
  uint64_t seed = 0;
  std::function<void(const ParamTable& whole, Model& local, int tp_rank, int tp)> load_shard;
};

class RankModel;

// The order, for a layout of tensor degree tp and pipeline degree pp (tp = pp = 1: only step 0 and
// 6; the whole model is the rank's model, its activations allocated by the caller):
//   0. weights of the whole model: init_weights(seed) when fresh and it holds its weights;
//   1. PP cut: this rank's pipeline stage (pipeline_layout; pp > 1);
//   2. TP cut: the stage's tensor shard (build_shard_model; with parallel.sequence the
//      sequence-parallel TensorShard) -> build_rank_model, and the RankShare that moves whole-layout
//      buffers to and from it;
//   3. the shard's weights (scatter, load_shard or init_shard), uploaded to the backend;
//   4. TP + SP collectives on the shard (attach_tensor_parallel or cfg.attach_tp; tp > 1);
//   5. PP: the pipeline executor (one activation arena per micro-batch in flight) or, without a
//      pipeline, the model's activations for B x T; both with the recipe's recompute;
//   6. the whole model released (rebuilt lazily by ensure_whole / current_whole), the compute
//      weights refreshed.
// Takes the whole model (preflight's: with weights, or only its table under model parallelism).
std::unique_ptr<RankModel> parallelize(std::unique_ptr<Model> whole, Topology& topo, const ParallelConfig& cfg,
                                       const InitialWeights& weights, int64_t B, int64_t T);

class RankModel {
 public:
  Model& model() { return *model_; }
  const Model& model() const { return *model_; }
  bool sharded() const { return sharded_; }  // tensor or pipeline parallelism
  int tp() const { return tp_; }             // the tensor-parallel degree and this rank's place in it
  int tp_rank() const { return tp_rank_; }
  PipelineExecutor* pipe() { return pipe_.get(); }
  const PipelineLayout& stage() const { return stage_; }  // pipeline parallelism only
  const RankShare& share() const { return *share_; }      // sharded only
  // The elements of the gradient buffer this rank counts in the tensor-parallel gradient norm.
  const std::vector<std::pair<size_t, size_t>>& owned() const { return owned_; }

  const ModelConfig& whole_config() const { return whole_cfg_; }
  size_t whole_params() const { return whole_params_; }
  double whole_flops_per_token() const { return whole_flops_per_token_; }

  // The whole model's structure (weights not current) for reading a checkpoint into it.
  Model& ensure_whole();
  // Frees the whole model between uses, so per-rank memory falls with the tensor and pipeline
  // degrees as `lathe plan` counts it. No-op without model parallelism.
  void release_whole();
  // The whole model with this replica's current weights (collective over the replica).
  Model& current_whole();
  // A buffer laid out like the whole model's parameters from each rank's local one (collective
  // over the replica), and this rank's part of such a buffer.
  void gather(const float* local, float* whole) const { share_->gather(local, whole); }
  void scatter(const float* whole, float* local) const { share_->scatter(whole, local); }

 private:
  friend std::unique_ptr<RankModel> parallelize(std::unique_ptr<Model>, Topology&, const ParallelConfig&,
                                                const InitialWeights&, int64_t, int64_t);
  RankModel() = default;

  std::unique_ptr<Model> model_, whole_;
  std::unique_ptr<dist::Communicator> tp_device_;  // cfg.attach_tp's group (the device's NCCL group)
  ExpertAttachment ep_;                            // parallel.expert > 1: the expert group and its hooks
  PipelineLayout stage_;
  std::unique_ptr<PipelineExecutor> pipe_;
  std::unique_ptr<RankShare> share_;
  std::vector<std::pair<size_t, size_t>> owned_;
  bool sharded_ = false;
  int tp_ = 1, tp_rank_ = 0;
  ModelConfig whole_cfg_;
  size_t whole_params_ = 0;
  double whole_flops_per_token_ = 0;
};

// The layouts a device (device: cuda) runs: one process, or data and tensor parallelism over NCCL
// (any ZeRO stage) in a build with NCCL, and pipeline parallelism (host-staged messages); with
// tensor parallelism neither LAMB nor training.eval_tasks. Throws naming the recipe key, the reason
// and the fix otherwise (lathe check and train call it through preflight; nothing for device: cpu).
void check_device_layout(const Recipe& r, int world_size);

}  // namespace lathe::parallel

namespace lathe {
// The trainer's parts (src/train) name them unqualified.
using parallel::RankModel;
using parallel::Topology;
}  // namespace lathe
