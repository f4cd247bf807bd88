#include "train/rank_model.h"

#include "parallel/tensor_parallel.h"
#include "train/checkpoint.h"
#include "train/device_step.h"
#include "train/device_tp.h"
#include "train/reshard.h"

namespace lathe {

namespace {

// Checks the degrees against the number of processes first (resolve_layout, by the recipe's names).
parallel::RankLayout layout_of(dist::Communicator& world, const Recipe& r) {
  return parallel::RankLayout::of(world.rank(), world.size(), static_cast<int>(r.parallel.tensor),
                                  static_cast<int>(r.parallel.pipeline));
}

}  // namespace

Topology::Topology(dist::Communicator& w, const Recipe& r)
    : world(w), lay(layout_of(w, r)), groups(parallel::make_process_groups(w, lay)) {}

RankModel::RankModel(const Recipe& r, Preflight& pf, Topology& topo, int64_t B, int64_t T)
    : model_(std::move(pf.model)), tp_(topo.lay.tp), tp_rank_(topo.lay.tp_rank) {
  const std::string& ckpt = pf.ckpt;
  const auto& lay = topo.lay;
  const int tp = lay.tp, pp = lay.pp, tp_rank = lay.tp_rank;
  if (ckpt.empty() && r.init_from.empty() && !pf.table_only)
    model_->init_weights(static_cast<uint64_t>(r.training.seed));
  // Tensor and/or pipeline parallelism: preflight's model is the whole model (init, init_from or
  // checkpoint weights, activations not allocated); each rank computes with its tensor shard of
  // its pipeline stage, the pipeline's stages run by the schedule's executor.
  sharded_ = tp > 1 || pp > 1;
  if (sharded_) {
    whole_ = std::move(model_);
    if (pp > 1)
      stage_ =
          parallel::pipeline_layout(r, whole_->config().num_hidden_layers, whole_->arch().tied_lm_head, lay.pp_rank);
    model_ = parallel::build_rank_model(*whole_, tp, tp_rank, r.parallel.sequence, pp > 1 ? &stage_ : nullptr);
    share_ = std::make_unique<parallel::RankShare>(whole_->params(), model_->params(), pp > 1 ? &stage_ : nullptr,
                                                   tp_rank, tp, topo.groups.tp.get(), topo.groups.pp.get());
    if (!pf.table_only)  // init_from: every rank loaded the whole HF model
      share_->scatter(whole_->param_data(), model_->param_data());
    else if (!ckpt.empty())  // only this rank's runs of each weight (train/reshard.h)
      load_weights_sharded(CheckpointPieces(ckpt), whole_->params(), model_->params(), tp_rank, tp,
                           model_->param_data());
    else  // the values init_weights gives the whole model, drawn tensor by tensor and sliced
      parallel::init_shard(*model_, whole_->params(), tp_rank, tp, static_cast<uint64_t>(r.training.seed));
    model_->upload_params();  // device: cuda: the shard's weights (no-op on the CPU)
    // parallel::attach_tensor_parallel on the CPU; device: cuda the hooks on an NCCL group.
    if (tp > 1) tp_device_ = attach_tensor_parallel_on_device(*model_, *topo.groups.tp);
    const Recompute rc = parse_recompute(r.recompute, r.source + ": recompute");
    if (pp > 1)  // one activation arena per micro-batch the schedule holds at once
      pipe_ = std::make_unique<parallel::PipelineExecutor>(*model_, stage_, *topo.groups.pp, B, T, 2, rc);
    else
      model_->allocate(B, T, 2, rc);
    if (pipe_ && device_path_on_host())  // test hook (train/device_step.h): the device staging on the CPU
      pipe_->set_stage_through_host(true);
    owned_ = share_->owned_ranges();
  }
  const Model& whole = whole_ ? *whole_ : *model_;
  whole_cfg_ = whole.config();
  whole_params_ = whole.num_params();
  whole_flops_per_token_ = whole.flops_per_token(T);
  release_whole();                    // the shards hold the weights now; a resume rebuilds it to read the moments
  model_->refresh_compute_weights();  // the weights are final (init, init_from or checkpoint)
}

Model& RankModel::ensure_whole() {
  if (!whole_) whole_ = build_model(whole_cfg_, ComputeSpec{&model_->backend(), model_->compute_dtype(), false});
  return *whole_;
}

void RankModel::release_whole() {
  if (sharded_) whole_.reset();
}

Model& RankModel::current_whole() {
  if (!sharded_) {
    model_->download_params();  // device: cuda: the host staging copy of the weights (no-op on the CPU)
    return *model_;
  }
  Model& w = ensure_whole();
  model_->download_params();  // device: cuda (no-op on the CPU)
  gather(model_->param_data(), w.param_data());
  w.upload_params();
  return w;
}

}  // namespace lathe
