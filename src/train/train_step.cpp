#include "train/train_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "core/error.h"
#include "core/timer.h"
#include "core/trace.h"
#include "optim/clip.h"
#include "parallel/context_parallel.h"

namespace lathe {

namespace {

// FaultPlan::nonfinite_steps: one element of this rank's part of the reduced gradient becomes +Inf.
bool inject_non_finite(const FaultPlan& f, int64_t step) {
  return std::find(f.nonfinite_steps.begin(), f.nonfinite_steps.end(), step) != f.nonfinite_steps.end();
}

// FaultPlan::loss_spike_steps: the factor for `step` (1 = none). Each listed step spikes once: it
// leaves the list, so the same step re-run after a rollback trains normally.
double inject_loss_spike(FaultPlan& f, int64_t step) {
  auto it = std::find(f.loss_spike_steps.begin(), f.loss_spike_steps.end(), step);
  if (it == f.loss_spike_steps.end()) return 1.0;
  f.loss_spike_steps.erase(it);
  return f.loss_spike_factor;
}

}  // namespace

StepStats train_step(StepContext& c, int64_t step, const StepStats& prev) {
  Model& model = c.rm.model();
  parallel::PipelineExecutor* pipe = c.rm.pipe();
  parallel::DistOptimizer& opt = c.opt;
  dist::Communicator& data = c.data;
  StepStats st;
  const double t0 = now_seconds();
  trace::Scope step_span("step", trace::Cat::Step, step + 1);
  data.set_step(step + 1);
  const int64_t B = c.geo.B, T = c.geo.T, accum = c.geo.accum;
  // Mean over the global batch's tokens, times the loss scale (a power of two by default: exact).
  st.step = step + 1;
  st.loss_scale = c.scaler.scale();
  double loss_sum = 0;
  double moe_aux_sum = 0;  // mixture of experts: sum over micro-batches of aux x their targets
  opt.zero_grads();  // ZeRO 2: only the shard (the rest was released as zeros)
  const parallel::ParamGather* gather = opt.param_gather();
  const size_t gathered0 = gather ? gather->gathered_bytes() : 0;
  {
    trace::Scope span("data wait", trace::Cat::Data);
    st.data_wait_s = c.loader.next(c.inputs.data(), c.targets.data());
  }
  // The loss is the mean over the global batch's trained targets: all G x T of them, or with
  // data.mask_loss_after_eod those left after masking (counted over every rank: Megatron's mean).
  int64_t targets_kept = c.geo.G * T;
  if (c.docs.mask_loss) {
    double kept =
        static_cast<double>(mask_loss_after_eod(c.inputs.data(), c.targets.data(), accum * B * T, c.docs.eod));
    if (c.cp_rank > 0) kept = 0;  // the context ranks of a data rank hold the same samples: counted once
    if (data.size() > 1) data.all_reduce(&kept, 1, DType::F64);
    targets_kept = std::max<int64_t>(1, static_cast<int64_t>(kept));
  }
  const float grad_scale = 1.0f / static_cast<float>(targets_kept) * static_cast<float>(st.loss_scale);
  std::vector<int32_t> doc_start, positions;
  if (pipe && !c.cp_rows.empty()) {  // pipeline x context: every micro-batch's rows of this rank first
    const int64_t Tl = static_cast<int64_t>(c.cp_rows.size());
    const double wait0 = parallel::context_comm_wait_seconds();
    c.cp_inputs.resize(static_cast<size_t>(accum * B * Tl));
    c.cp_targets.resize(c.cp_inputs.size());
    parallel::context_batch(c.cp_rows, accum * B, T, c.inputs.data(), c.cp_inputs.data());
    parallel::context_batch(c.cp_rows, accum * B, T, c.targets.data(), c.cp_targets.data());
    std::vector<int32_t> in_l, tg_l, ds, pos;
    loss_sum = pipe->step(c.cp_inputs.data(), c.cp_targets.data(), grad_scale, [&](int64_t m) {
      parallel::set_context_pass(model, c.docs, c.cp_rows, c.inputs.data() + m * B * T, c.targets.data() + m * B * T,
                                 B, T, in_l, tg_l, ds, pos);
    });
    st.context_wait_s = parallel::context_comm_wait_seconds() - wait0;
  } else if (pipe) {  // the schedule runs every micro-batch; the data-parallel reduction follows it
    loss_sum = pipe->step(c.inputs.data(), c.targets.data(), grad_scale, [&](int64_t m) {
      set_batch_documents(model, c.docs, c.inputs.data() + m * B * T, B, T, doc_start, positions);
    });
  }
  if (pipe) {
    // ZeRO 3: the executor gathered each action's blocks (parallel/param_gather.h) and released them.
    st.comm_wait_s += pipe->gather_wait_s();
    opt.end_micro_batch(true);  // the pages released: whole weights must be gathered again to be read
    opt.set_last_backward(true);
    opt.grads_ready(0, model.num_params());
    opt.set_last_backward(false);
  }
  if (!c.cp_rows.empty() && !pipe) {  // context parallelism: this rank's rows of each sample (parallel/context_parallel.h)
    const int64_t Tl = static_cast<int64_t>(c.cp_rows.size());
    const double wait0 = parallel::context_comm_wait_seconds();
    std::vector<int32_t> ds, pos;
    for (int64_t m = 0; m < accum; ++m) {
      trace::Scope span("forward+backward micro-batch", trace::Cat::Compute, m);
      const int32_t *in = c.inputs.data() + m * B * T, *tg = c.targets.data() + m * B * T;
      parallel::set_context_pass(model, c.docs, c.cp_rows, in, tg, B, T, c.cp_inputs, c.cp_targets, ds, pos);
      opt.set_last_backward(m + 1 == accum);
      loss_sum += model.forward_backward(c.cp_inputs.data(), c.cp_targets.data(), B, Tl, grad_scale, true);
    }
    st.context_wait_s = parallel::context_comm_wait_seconds() - wait0;
  }
  for (int64_t m = 0; m < (pipe || !c.cp_rows.empty() ? 0 : accum); ++m) {
    trace::Scope span("forward+backward micro-batch", trace::Cat::Compute, m);
    // Device models: micro-batch m+1's ids start their (pinned, async) copy now, overlapping m's
    // compute (Model::stage_inputs; nothing on the CPU).
    for (int64_t s = m == 0 ? 0 : m + 1; s <= m + 1 && s < accum; ++s)
      model.stage_inputs(c.inputs.data() + s * B * T, c.targets.data() + s * B * T, B * T);
    set_batch_documents(model, c.docs, c.inputs.data() + m * B * T, B, T, doc_start, positions);
    opt.set_last_backward(m + 1 == accum);  // gradients are final during the last micro-batch's backward
    opt.begin_micro_batch();                 // ZeRO 3: weights gathered per block from here
    loss_sum +=
        model.forward_backward(c.inputs.data() + m * B * T, c.targets.data() + m * B * T, B, T, grad_scale, true);
    if (model.arch().moe_experts > 0) moe_aux_sum += model.moe_aux_loss() * static_cast<double>(model.moe_loss_targets());
    st.comm_wait_s += opt.end_micro_batch(m + 1 == accum);  // ZeRO 3: released; reduced unless the last
  }
  opt.set_last_backward(false);
  model.drop_staged_inputs();  // the loader refills these arrays for the next step
  if (c.faults.stall_rank == data.rank() && c.faults.stall_step == step + 1)  // a hung rank (tests/parallel)
    std::this_thread::sleep_for(std::chrono::hours(1));
  st.comm_wait_s += opt.reduce_grads();  // the buckets backward did not issue, and the wait for all
  if (gather) st.weight_gather_bytes = static_cast<int64_t>(gather->gathered_bytes() - gathered0);
  if (data.size() > 1) data.all_reduce(&loss_sum, 1, DType::F64);
  st.loss = loss_sum / static_cast<double>(targets_kept);
  if (model.arch().moe_experts > 0) {
    if (data.size() > 1) data.all_reduce(&moe_aux_sum, 1, DType::F64);
    st.moe_aux_loss = moe_aux_sum / static_cast<double>(targets_kept);
  }
  if (inject_non_finite(c.faults, step + 1) && opt.state_end() > opt.state_begin())
    model.grad_data()[opt.state_begin()] = INFINITY;
  if (const double spike = inject_loss_spike(c.faults, step + 1); spike != 1.0) {
    st.loss *= spike;
    float* grad = model.grad_data();
    for (size_t i = opt.state_begin(); i < opt.state_end(); ++i) grad[i] *= static_cast<float>(spike);
  }
  const double t_opt = now_seconds();  // norm, scaler and update: the optimizer's share of the step
  trace::Scope opt_span("grad norm + optimizer", trace::Cat::Optimizer);
  // The norm of the unscaled gradients (dividing by a power of two is exact).
  st.norm = opt.grad_norm() / st.loss_scale;
  st.lr_factor = c.anomaly.lr_factor();  // < 1 for a while after an anomaly
  st.lr = optim::lr_at(c.sched, step) * st.lr_factor;
  const int64_t skipped_before = c.scaler.state().skipped_steps;
  switch (c.scaler.update(!std::isfinite(st.loss) || !std::isfinite(st.norm), step + 1)) {
    case optim::LossScaler::Verdict::Stop:
      throw_error(
          "{} — training stopped, no weights written. This step: loss {}, grad norm {}. Last finite values: loss "
          "{}, grad norm {}, lr {} (step {}). Try a lower optimizer.lr or a smaller optimizer.grad_clip{}.",
          c.scaler.stop_reason(), st.loss, st.norm, prev.loss, prev.norm, prev.lr, prev.step,
          c.scaler.dynamic() ? "" : ", or raise training.max_skipped_steps (0 = never stop)");
    case optim::LossScaler::Verdict::Skip:
      st.skipped = true;  // weights and moments untouched; the batch is consumed, the schedule moves on
      st.anomaly = c.anomaly.observe(step + 1, st.loss, st.norm, true, c.scaler.dynamic() && std::isfinite(st.loss));
      break;
    case optim::LossScaler::Verdict::Apply: {
      // The same loss and norm on every rank (global): the same decision everywhere.
      st.anomaly = c.anomaly.observe(step + 1, st.loss, st.norm, false, false);
      if (st.anomaly.skip) break;  // a spike: weights and moments untouched, the batch consumed
      // The clipping coefficient (from the unscaled norm) and the unscaling are applied inside the
      // optimizer update (one pass less over the gradients; bit-identical to scaling them first).
      // AdamW/LAMB's bias correction counts the updates applied, not skipped steps (as torch.optim
      // under GradScaler, whose skipped steps do not advance the optimizer's step).
      const float unscale = static_cast<float>(1.0 / st.loss_scale);
      LATHE_CHECK(std::isfinite(unscale) && unscale > 0,
                  "step {}: the loss scale {} has no finite float reciprocal (1 / scale = {}); the update would turn "
                  "the weights into NaN: keep precision.loss_scale in [2^-100, 2^100]",
                  step + 1, st.loss_scale, unscale);
      const float coef = optim::clip_coefficient(st.norm, opt.grad_clip()) * unscale;
      const int64_t updates = step + 1 - skipped_before - c.anomaly.state().skipped_updates;
      opt.step(st.lr, updates, coef);
      model.refresh_compute_weights();  // the bf16/fp16 copies of the new weights
      break;
    }
  }
  st.seconds = now_seconds() - t0;
  st.optimizer_s = now_seconds() - t_opt;
  return st;
}

}  // namespace lathe
