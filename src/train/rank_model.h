// Where this rank stands in the run (world, layout, process groups) and the model it computes
// with: the whole model, or with tensor and/or pipeline parallelism its tensor shard of its
// pipeline stage, run by the pipeline executor, with the whole model rebuilt only while a
// checkpoint, an HF directory or a rollback needs it. Internal to src/train until one
// parallel::parallelize() entry point takes the setup over (issue 24 item 3).
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "config/recipe.h"
#include "dist/comm.h"
#include "models/model.h"
#include "parallel/model_parallel.h"
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_stage.h"
#include "train/preflight.h"

namespace lathe {

// This rank's coordinates and groups (parallel/model_parallel.h: tensor fastest, then data, then
// pipeline, so a tensor group is tp consecutive ranks: one host when ranks fill hosts in order).
struct Topology {
  Topology(dist::Communicator& world, const Recipe& r);
  dist::Communicator& world;
  const parallel::RankLayout lay;
  parallel::ProcessGroups groups;
  int rank() const { return world.rank(); }
  bool rank0() const { return world.rank() == 0; }
  // The data-parallel group (the whole world without tensor or pipeline parallelism).
  dist::Communicator& data() const { return groups.dp ? *groups.dp : world; }
  // The ranks of one replica (tensor x pipeline): the gradient norm's group without ZeRO, and the
  // barrier after a checkpoint. Null without model parallelism.
  dist::Communicator* replica() const { return groups.model_group(); }
};

class RankModel {
 public:
  // From preflight's model (whole; its weights from init_from or the checkpoint, or only its table
  // under tensor/pipeline parallelism): initialises a fresh run's weights, cuts this rank's shard
  // and stage, allocates activations for micro-batches of B x T, and attaches the tensor-parallel
  // hooks and the pipeline executor.
  RankModel(const Recipe& r, Preflight& pf, Topology& topo, int64_t B, int64_t T);

  Model& model() { return *model_; }
  const Model& model() const { return *model_; }
  bool sharded() const { return sharded_; }  // tensor or pipeline parallelism
  int tp() const { return tp_; }             // the tensor-parallel degree and this rank's place in it
  int tp_rank() const { return tp_rank_; }
  parallel::PipelineExecutor* pipe() { return pipe_.get(); }
  const parallel::PipelineLayout& stage() const { return stage_; }  // pipeline parallelism only
  const parallel::RankShare& share() const { return *share_; }      // sharded only
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
  std::unique_ptr<Model> model_, whole_;
  std::unique_ptr<dist::Communicator> tp_device_;  // device: cuda: the hooks' NCCL group (train/device_tp.h)
  parallel::PipelineLayout stage_;
  std::unique_ptr<parallel::PipelineExecutor> pipe_;
  std::unique_ptr<parallel::RankShare> share_;
  std::vector<std::pair<size_t, size_t>> owned_;
  bool sharded_ = false;
  int tp_ = 1, tp_rank_ = 0;
  ModelConfig whole_cfg_;
  size_t whole_params_ = 0;
  double whole_flops_per_token_ = 0;
};

}  // namespace lathe
