#include "train/evaluator.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/timer.h"
#include "core/trace.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "train/trainer.h"

namespace lathe {

namespace {

// A validation pass whose evaluated tokens are all masked (mask_loss_after_eod) has no loss: the
// record carries val_tokens 0 and no val_loss, the log says why, instead of a loss of 0.0000.
constexpr const char* kNoValidationTargets =
    "no target tokens in the evaluated batches (every token follows an EOD under data.mask_loss_after_eod)";
nlohmann::json validation_record(int64_t step, double loss, int64_t tokens) {
  nlohmann::json j = {{"step", step}, {"val_tokens", tokens}};
  if (tokens) j["val_loss"] = loss;
  return j;
}

}  // namespace

std::pair<double, int64_t> evaluate_samples(Model& model, const data::IndexedDataset& ds,
                                            const std::vector<int64_t>& samples, int64_t B, int64_t T,
                                            const DocumentOptions* docs, const EvalForward* forward) {
  std::vector<int32_t> window(static_cast<size_t>(T + 1)), in(static_cast<size_t>(B * T)),
      tg(static_cast<size_t>(B * T)), doc_start, positions;
  double sum = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < samples.size(); i += static_cast<size_t>(B)) {
    const int64_t b = std::min<int64_t>(B, static_cast<int64_t>(samples.size() - i));
    for (int64_t r = 0; r < b; ++r) {
      ds.read_global(samples[i + r] * T, T + 1, window.data());
      std::copy(window.begin(), window.begin() + T, in.begin() + r * T);
      std::copy(window.begin() + 1, window.end(), tg.begin() + r * T);
    }
    if (docs && docs->model_needs_documents())
      set_batch_documents(model, *docs, in.data(), b, T, doc_start, positions);
    else  // plain causal attention, whatever documents an earlier pass left set
      model.set_documents(nullptr, nullptr, 0, 0);
    if (docs && docs->mask_loss)
      tokens += mask_loss_after_eod(in.data(), tg.data(), b * T, docs->eod);
    else
      tokens += b * T;
    sum +=
        forward ? (*forward)(in.data(), tg.data(), b) : model.forward_backward(in.data(), tg.data(), b, T, 0.0f, false);
  }
  return {tokens ? sum / static_cast<double>(tokens) : 0.0, tokens};
}

Evaluator::Evaluator(const Recipe& r, Topology& topo, RankModel& rm,
                     std::shared_ptr<const data::IndexedDataset> valid_ds, std::vector<int64_t> valid_samples,
                     std::vector<McItem> mc_items, const DocumentOptions& docs, int64_t B, int64_t T, RunLog& log)
    : r_(r),
      topo_(topo),
      rm_(rm),
      valid_ds_(std::move(valid_ds)),
      valid_samples_(std::move(valid_samples)),
      mc_items_(std::move(mc_items)),
      docs_(docs),
      B_(B),
      T_(T),
      tasks_interval_(r.training.eval_tasks_interval > 0 ? r.training.eval_tasks_interval : r.training.eval_interval),
      log_(log) {
  subset_.assign(valid_samples_.begin(),
                 valid_samples_.begin() +
                     std::min<int64_t>(static_cast<int64_t>(valid_samples_.size()), r.training.eval_batches * B));
}

// Context parallelism (parallel/context_parallel.h): this rank's rows of each sample, as
// evaluate_samples does whole samples; the loss sum and target count are this rank's rows' (the
// caller sums them over the data x context ranks).
static std::pair<double, int64_t> evaluate_context(Model& model, const data::IndexedDataset& ds,
                                            const std::vector<int64_t>& samples, int64_t B, int64_t T,
                                            const DocumentOptions& docs, const std::vector<int32_t>& rows,
                                            const EvalForward* forward) {
  std::vector<int32_t> window(static_cast<size_t>(T + 1)), in(static_cast<size_t>(B * T)),
      tg(static_cast<size_t>(B * T)), in_l, tg_l, ds_l, pos_l;
  double sum = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < samples.size(); i += static_cast<size_t>(B)) {
    const int64_t b = std::min<int64_t>(B, static_cast<int64_t>(samples.size() - i));
    for (int64_t r = 0; r < b; ++r) {
      ds.read_global(samples[i + r] * T, T + 1, window.data());
      std::copy(window.begin(), window.begin() + T, in.begin() + r * T);
      std::copy(window.begin() + 1, window.end(), tg.begin() + r * T);
    }
    if (docs.mask_loss) mask_loss_after_eod(in.data(), tg.data(), b * T, docs.eod);
    parallel::set_context_pass(model, docs, rows, in.data(), tg.data(), b, T, in_l, tg_l, ds_l, pos_l);
    tokens += std::count_if(tg_l.begin(), tg_l.end(), [](int32_t t) { return t >= 0; });
    sum += forward ? (*forward)(in_l.data(), tg_l.data(), b)
                   : model.forward_backward(in_l.data(), tg_l.data(), b, static_cast<int64_t>(rows.size()), 0.0f, false);
  }
  return {tokens ? sum / static_cast<double>(tokens) : 0.0, tokens};
}

std::pair<double, int64_t> Evaluator::evaluate(const std::vector<int64_t>& set) {
  const int dp = topo_.lay.dp;
  const parallel::LocalExperts local(rm_.model());  // expert parallelism: ranks' shares differ in size
  std::vector<int64_t> mine;
  // Data ranks split the samples; the context ranks of one data rank take the same ones.
  for (size_t i = static_cast<size_t>(topo_.lay.samples_dp_rank()); i < set.size();
       i += static_cast<size_t>(topo_.lay.samples_dp()))
    mine.push_back(set[i]);
  // Pipeline: every stage takes part in each batch's forward (the stage model holds the documents).
  parallel::PipelineExecutor* pipe = rm_.pipe();
  const EvalForward pipe_forward = [&](const int32_t* in, const int32_t* tg, int64_t b) {
    return pipe->forward_loss(in, tg, b, nullptr);
  };
  if (topo_.lay.cp > 1) {
    const auto rows = parallel::context_rows(T_, topo_.lay.cp, topo_.lay.cp_rank);
    auto [mean, tokens] =
        evaluate_context(rm_.model(), *valid_ds_, mine, B_, T_, docs_, rows, pipe ? &pipe_forward : nullptr);
    double st[2] = {mean * static_cast<double>(tokens), static_cast<double>(tokens)};
    topo_.data().all_reduce(st, 2, DType::F64);
    return {st[1] > 0 ? st[0] / st[1] : 0.0, static_cast<int64_t>(st[1])};
  }
  auto [mean, tokens] = evaluate_samples(rm_.model(), *valid_ds_, mine, B_, T_, &docs_, pipe ? &pipe_forward : nullptr);
  double st[2] = {mean * static_cast<double>(tokens), static_cast<double>(tokens)};
  if (dp > 1) topo_.data().all_reduce(st, 2, DType::F64);
  return {st[1] > 0 ? st[0] / st[1] : 0.0, static_cast<int64_t>(st[1])};
}

// Multiple-choice accuracy (eval/eval_tasks.h). Contexts are cut to seq_len.
// Context parallelism: the rank's model holds T / context rows of a pass and attends across the
// group, so the endings (one short sequence each) are scored by a plain copy of the whole model,
// allocated for one sequence and given the current weights before each scoring (context ranks hold
// every weight; the recipe refuses eval_tasks with context x tensor or pipeline). The context ranks
// share the items as data ranks do (topo_.lay.dp counts data x context).
Model& Evaluator::context_scorer() {
  Model& m = rm_.model();
  if (!context_copy_) {
    context_copy_ = build_model(m.config(), ComputeSpec{nullptr, m.compute_dtype(), /*gradients=*/false});
    context_copy_->allocate(1, std::min<int64_t>(T_, m.config().max_position_embeddings));
  }
  LATHE_CHECK(context_copy_->num_params() == m.num_params(),
              "internal: the context scorer has {} parameters, the rank's model {}", context_copy_->num_params(),
              m.num_params());
  std::copy_n(m.param_data(), m.num_params(), context_copy_->param_data());
  context_copy_->refresh_compute_weights();
  return *context_copy_;
}

void Evaluator::score_tasks(int64_t at) {
  trace::Scope span("eval tasks", trace::Cat::Eval, at);
  const double t0 = now_seconds();
  const int dp = topo_.lay.dp;
  Model& model = topo_.lay.cp > 1 ? context_scorer() : rm_.model();
  const parallel::LocalExperts local(model);  // expert parallelism: no collective while scoring
  // Pipeline: the stages run each ending's forward together; the last one has the logits and
  // scores, its counts reach the other stages by an all-reduce (theirs are zero).
  parallel::PipelineExecutor* pipe = rm_.pipe();
  LogitsFn pipe_logits;
  if (pipe) pipe_logits = [&](const int32_t* seq, int64_t t, float* out) { pipe->forward_logits(seq, 1, t, out); };
  const McScores sc = score_mc_items(model, mc_items_, std::min<int64_t>(T_, model.config().max_position_embeddings),
                                     r_.training.eval_tasks, static_cast<size_t>(topo_.lay.dp_rank),
                                     static_cast<size_t>(dp), nullptr, pipe_logits);
  int64_t c[3] = {sc.items, sc.right, sc.right_norm};
  if (pipe) {
    if (!rm_.stage().last()) c[0] = c[1] = c[2] = 0;
    topo_.groups.pp->all_reduce(c, 3, DType::I64);
  }
  if (dp > 1) topo_.data().all_reduce(c, 3, DType::I64);
  const double n = static_cast<double>(std::max<int64_t>(c[0], 1));
  log_.metrics({{"step", at},
                {"tasks_acc", static_cast<double>(c[1]) / n},
                {"tasks_acc_norm", static_cast<double>(c[2]) / n},
                {"tasks_items", c[0]}},
               "tasks");
  log_.log(fmt::format("step {:>6}/{} | tasks {}: acc {:.4f} | acc_norm {:.4f} ({} items, {:.1f} s)", at,
                       r_.training.steps, r_.training.eval_tasks, static_cast<double>(c[1]) / n,
                       static_cast<double>(c[2]) / n, c[0], now_seconds() - t0));
}

bool Evaluator::due(int64_t done, bool last) const {
  if (last) return false;
  return (!subset_.empty() && r_.training.eval_interval > 0 && done % r_.training.eval_interval == 0) ||
         (!mc_items_.empty() && tasks_interval_ > 0 && done % tasks_interval_ == 0);
}

void Evaluator::maybe(int64_t done, bool last) {
  if (last) return;
  const int64_t steps = r_.training.steps;
  if (!subset_.empty() && r_.training.eval_interval > 0 && done % r_.training.eval_interval == 0) {
    trace::Scope span("validation", trace::Cat::Eval, done);
    auto [vl, vt] = evaluate(subset_);
    log_.metrics(validation_record(done, vl, vt), "val");
    log_.log(vt ? fmt::format("step {:>6}/{} | validation loss {:.4f} ({} tokens)", done, steps, vl, vt)
                : fmt::format("step {:>6}/{} | validation: {}", done, steps, kNoValidationTargets));
  }
  if (!mc_items_.empty() && tasks_interval_ > 0 && done % tasks_interval_ == 0) score_tasks(done);
}

double Evaluator::final() {
  double loss = -1;
  if (!valid_samples_.empty()) {
    std::vector<int64_t> set(valid_samples_.begin(),
                             valid_samples_.begin() + std::min<int64_t>(valid_samples_.size(), 256 * B_));
    auto [vl, vt] = evaluate(set);
    loss = vl;
    log_.metrics(validation_record(r_.training.steps, vl, vt), "val");
    log_.log(vt ? fmt::format("final validation loss {:.4f} over {} tokens", vl, vt)
                : fmt::format("final validation: {}", kNoValidationTargets));
  }
  if (!mc_items_.empty()) score_tasks(r_.training.steps);
  return loss;
}

}  // namespace lathe
