#include "train/train_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "core/error.h"
#include "core/timer.h"
#include "core/trace.h"
#include "optim/clip.h"
#include "parallel/tensor_parallel.h"

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

StepStats train_step(StepParts& p, int64_t step, const StepStats& prev) {
  StepStats st;
  const double t0 = now_seconds();
  trace::Scope step_span("step", trace::Cat::Step, step + 1);
  p.world.set_step(step + 1);
  const int64_t B = p.B, T = p.T;
  // Mean over the global batch's tokens, times the loss scale (a power of two by default: exact).
  st.step = step + 1;
  st.loss_scale = p.scaler.scale();
  double loss_sum = 0;
  if (p.sync)
    p.sync->zero_grads();  // ZeRO 2: only the shard (the rest was released as zeros)
  else
    p.model.zero_grad();
  {
    trace::Scope span("data wait", trace::Cat::Data);
    st.data_wait_s = p.loader.next(p.inputs.data(), p.targets.data());
  }
  // The loss is the mean over the global batch's trained targets: all G x T of them, or with
  // data.mask_loss_after_eod those left after masking (counted over every rank: Megatron's mean).
  int64_t targets_kept = p.G * T;
  if (p.docs.mask_loss) {
    double kept =
        static_cast<double>(mask_loss_after_eod(p.inputs.data(), p.targets.data(), p.accum * B * T, p.docs.eod));
    if (p.world.size() > 1) p.world.all_reduce(&kept, 1, DType::F64);
    targets_kept = std::max<int64_t>(1, static_cast<int64_t>(kept));
  }
  const float grad_scale = 1.0f / static_cast<float>(targets_kept) * static_cast<float>(st.loss_scale);
  std::vector<int32_t> doc_start, positions;
  if (p.pipe) {  // the schedule runs every micro-batch; the data-parallel reduction follows it
    loss_sum = p.pipe->step(p.inputs.data(), p.targets.data(), grad_scale, [&](int64_t m) {
      set_batch_documents(p.model, p.docs, p.inputs.data() + m * B * T, B, T, doc_start, positions);
    });
    if (p.sync) p.sync->ready(0, p.model.num_params());
  }
  for (int64_t m = 0; m < (p.pipe ? 0 : p.accum); ++m) {
    trace::Scope span("forward+backward micro-batch", trace::Cat::Compute, m);
    // Device models: micro-batch m+1's ids start their (pinned, async) copy now, overlapping m's
    // compute (Model::stage_inputs; nothing on the CPU).
    for (int64_t s = m == 0 ? 0 : m + 1; s <= m + 1 && s < p.accum; ++s)
      p.model.stage_inputs(p.inputs.data() + s * B * T, p.targets.data() + s * B * T, B * T);
    set_batch_documents(p.model, p.docs, p.inputs.data() + m * B * T, B, T, doc_start, positions);
    p.sync_this_pass = m + 1 == p.accum;  // gradients are final during the last micro-batch's backward
    loss_sum +=
        p.model.forward_backward(p.inputs.data() + m * B * T, p.targets.data() + m * B * T, B, T, grad_scale, true);
  }
  p.sync_this_pass = false;
  p.model.drop_staged_inputs();  // the loader refills these arrays for the next step
  if (p.faults.stall_rank == p.world.rank() && p.faults.stall_step == step + 1)  // a hung rank (tests/parallel)
    std::this_thread::sleep_for(std::chrono::hours(1));
  if (p.sync) st.comm_wait_s = p.sync->finish();
  if (p.dev) st.comm_wait_s = p.dev->reduce_grads();  // device: cuda: over NCCL after backward (device_dp.h)
  if (p.world.size() > 1) p.world.all_reduce(&loss_sum, 1, DType::F64);
  st.loss = loss_sum / static_cast<double>(targets_kept);
  if (inject_non_finite(p.faults, step + 1) && p.opt.state_end() > p.opt.state_begin())
    p.model.grad_data()[p.opt.state_begin()] = INFINITY;
  if (const double spike = inject_loss_spike(p.faults, step + 1); spike != 1.0) {
    st.loss *= spike;
    float* g = p.model.grad_data();
    for (size_t i = p.opt.state_begin(); i < p.opt.state_end(); ++i) g[i] *= static_cast<float>(spike);
  }
  const double t_opt = now_seconds();  // norm, scaler and update: the optimizer's share of the step
  trace::Scope opt_span("grad norm + optimizer", trace::Cat::Optimizer);
  // The norm of the unscaled gradients (dividing by a power of two is exact).
  st.norm = (p.dev             ? p.dev->grad_norm()
             : p.tp_norm_group ? parallel::tensor_parallel_grad_norm(*p.tp_norm_group, p.model.grad_data(), p.tp_owned)
                               : p.opt.grad_norm(p.model.grad_data())) /
            st.loss_scale;
  st.lr_factor = p.anomaly.lr_factor();  // < 1 for a while after an anomaly
  st.lr = optim::lr_at(p.sched, step) * st.lr_factor;
  const int64_t skipped_before = p.scaler.state().skipped_steps;
  switch (p.scaler.update(!std::isfinite(st.loss) || !std::isfinite(st.norm), step + 1)) {
    case optim::LossScaler::Verdict::Stop:
      throw_error(
          "{} — training stopped, no weights written. This step: loss {}, grad norm {}. Last finite values: loss "
          "{}, grad norm {}, lr {} (step {}). Try a lower optimizer.lr or a smaller optimizer.grad_clip{}.",
          p.scaler.stop_reason(), st.loss, st.norm, prev.loss, prev.norm, prev.lr, prev.step,
          p.scaler.dynamic() ? "" : ", or raise training.max_skipped_steps (0 = never stop)");
    case optim::LossScaler::Verdict::Skip:
      st.skipped = true;  // weights and moments untouched; the batch is consumed, the schedule moves on
      st.anomaly = p.anomaly.observe(step + 1, st.loss, st.norm, true, p.scaler.dynamic() && std::isfinite(st.loss));
      break;
    case optim::LossScaler::Verdict::Apply: {
      // The same loss and norm on every rank (global): the same decision everywhere.
      st.anomaly = p.anomaly.observe(step + 1, st.loss, st.norm, false, false);
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
      const float coef = optim::clip_coefficient(st.norm, p.grad_clip) * unscale;
      const int64_t updates = step + 1 - skipped_before - p.anomaly.state().skipped_updates;
      if (p.dev)
        p.dev->step(st.lr, updates, coef);
      else
        p.opt.step(p.model.param_data(), p.model.grad_data(), st.lr, updates, coef);
      p.model.refresh_compute_weights();  // the bf16/fp16 copies of the new weights
      break;
    }
  }
  st.seconds = now_seconds() - t0;
  st.optimizer_s = now_seconds() - t_opt;
  return st;
}

}  // namespace lathe
