#include "parallel/parallelize.h"

#include <fmt/format.h>

#include "dist/nccl_comm.h"
#include "models/recompute.h"
#include "parallel/context_parallel.h"
#include "parallel/tensor_parallel.h"

namespace lathe::parallel {

Topology::Topology(dist::Communicator& w, const Recipe::Parallel& p)
    : world(w),
      lay(RankLayout::of(w.rank(), w.size(), static_cast<int>(p.tensor), static_cast<int>(p.pipeline),
                         static_cast<int>(p.context))),
      groups(make_process_groups(w, lay)) {}

ParallelConfig ParallelConfig::of(const Recipe& r) {
  ParallelConfig c;
  c.parallel = r.parallel;
  c.micro_batches = r.training.grad_accum_steps;
  c.recompute = r.recompute;
  c.source = r.source;
  return c;
}

std::unique_ptr<RankModel> parallelize(std::unique_ptr<Model> whole, Topology& topo, const ParallelConfig& cfg,
                                       const InitialWeights& weights, int64_t B, int64_t T) {
  std::unique_ptr<RankModel> rm(new RankModel());
  RankModel& m = *rm;
  const RankLayout& lay = topo.lay;
  const int tp = lay.tp, pp = lay.pp, tp_rank = lay.tp_rank;
  m.model_ = std::move(whole);
  m.tp_ = tp;
  m.tp_rank_ = tp_rank;
  // 0. A fresh run's weights, on the whole model when it holds them.
  if (weights.fresh && weights.whole_has_weights) m.model_->init_weights(weights.seed);
  m.sharded_ = tp > 1 || pp > 1;
  if (m.sharded_) {
    m.whole_ = std::move(m.model_);
    Model& w = *m.whole_;
    // 1. PP: this rank's pipeline stage.
    if (pp > 1)
      m.stage_ = pipeline_layout(cfg.parallel, cfg.micro_batches, cfg.source, w.config().num_hidden_layers,
                                 w.arch().tied_lm_head, lay.pp_rank);
    const PipelineLayout* stage = pp > 1 ? &m.stage_ : nullptr;
    // 2. TP (+ SP config): the stage's tensor shard, and its share of whole-layout buffers.
    m.model_ = build_rank_model(w, tp, tp_rank, cfg.parallel.sequence, stage);
    m.share_ = std::make_unique<RankShare>(w.params(), m.model_->params(), stage, tp_rank, tp, topo.groups.tp.get(),
                                           topo.groups.pp.get());
    // 3. The shard's weights.
    if (weights.whole_has_weights)
      m.share_->scatter(w.param_data(), m.model_->param_data());
    else if (weights.load_shard)  // only this rank's runs of each weight
      weights.load_shard(w.params(), *m.model_, tp_rank, tp);
    else  // the values init_weights gives the whole model, drawn tensor by tensor and sliced
      init_shard(*m.model_, w.params(), tp_rank, tp, weights.seed);
    m.model_->upload_params();  // device: the shard's weights (no-op on the CPU)
    // 4. TP + SP collectives.
    if (tp > 1) {
      if (cfg.attach_tp)
        m.tp_device_ = cfg.attach_tp(*m.model_, *topo.groups.tp);
      else
        attach_tensor_parallel(*m.model_, *topo.groups.tp);
    }
    // 5. PP: the executor, one activation arena per micro-batch the schedule holds at once.
    // Context (tensor x context): the shard's attention across the context group, T / cp rows.
    const Recompute rc = parse_recompute(cfg.recompute, cfg.source + ": recompute");
    if (lay.cp > 1)
      attach_context_parallel(*m.model_, *topo.groups.cp, parse_context_impl(cfg.parallel.context_impl), B, T);
    if (pp > 1)
      m.pipe_ = std::make_unique<PipelineExecutor>(*m.model_, m.stage_, *topo.groups.pp, B, T / lay.cp, 2, rc);
    else
      m.model_->allocate(B, T / lay.cp, 2, rc);
    if (m.pipe_ && cfg.stage_through_host) m.pipe_->set_stage_through_host(true);
    m.owned_ = m.share_->owned_ranges();
  }
  if (lay.cp > 1 && !m.sharded_) {  // context: this rank's rows of every sample; attention across the group
    attach_context_parallel(*m.model_, *topo.groups.cp, parse_context_impl(cfg.parallel.context_impl), B, T);
    m.model_->allocate(B, T / lay.cp, 0, parse_recompute(cfg.recompute, cfg.source + ": recompute"));
  }
  const Model& w = m.whole_ ? *m.whole_ : *m.model_;
  m.whole_cfg_ = w.config();
  m.whole_params_ = w.num_params();
  m.whole_flops_per_token_ = w.flops_per_token(T);
  // 6. The shards hold the weights now; a resume rebuilds the whole model to read the moments.
  m.release_whole();
  m.model_->refresh_compute_weights();  // the weights are final (init, init_from or checkpoint)
  // 7. Expert parallelism (data parallelism alone; preflight refuses the rest): the MoE blocks'
  // experts over groups of parallel.expert consecutive data ranks.
  if (cfg.parallel.expert > 1)
    m.ep_ = attach_expert_parallel(*m.model_, topo.data(), static_cast<int>(cfg.parallel.expert));
  return rm;
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
    model_->download_params();  // device: the host staging copy of the weights (no-op on the CPU)
    return *model_;
  }
  Model& w = ensure_whole();
  model_->download_params();  // device (no-op on the CPU)
  gather(model_->param_data(), w.param_data());
  w.upload_params();
  return w;
}

void check_device_layout(const Recipe& r, int world_size) {
  if (r.device == "cpu") return;
  auto refuse = [&](const std::string& what, const std::string& why) {
    throw_error(
        "{}: device: {} does not run {} yet: {} (device: {} runs one process, or data and tensor "
        "parallelism over NCCL with any parallel.zero; use device: cpu for this layout)",
        r.source, r.device, what, why, r.device);
  };
  if (r.parallel.tensor > 1 && r.optimizer.name == "lamb")
    refuse(fmt::format("optimizer.name = lamb with parallel.tensor = {}", r.parallel.tensor),
           "LAMB's per-tensor norms under tensor parallelism are not gathered over the tensor group by the device "
           "optimizer (use adamw)");
  if (r.parallel.tensor > 1 && !r.training.eval_tasks.empty())
    refuse(fmt::format("training.eval_tasks with parallel.tensor = {}", r.parallel.tensor),
           "the device model's logits are not vocab parallel (remove training.eval_tasks, or score the model "
           "afterwards with lathe eval)");
  if (world_size > 1 && !dist::have_nccl())
    refuse(fmt::format("this job has {} processes (data or tensor parallelism)", world_size),
           "this lathe was built without NCCL (nccl.h and libnccl were not found when it was configured: install "
           "NCCL and rebuild with -DLATHE_CUDA=ON)");
}

}  // namespace lathe::parallel
