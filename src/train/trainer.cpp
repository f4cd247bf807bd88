#include "train/trainer.h"

#include <cstdint>
#include <exception>
#include <optional>

#include "train/session.h"
#include "train/train_step.h"

namespace lathe {

namespace {

// The order of events of a run; every part is set up and owned by the session (train/session.h).
TrainResult run_steps(TrainSession& s) {
  StepStats prev;
  for (int64_t step = s.start_step(); step < s.steps(); ++step) {
    s.control().before_step(step);  // profiler window
    const StepStats st = train_step(s.step_context(), step, prev);
    s.control().after_step(step);
    if (!st.skipped) prev = st;
    s.record(step, st);  // metrics.jsonl and the log line; the health the next checkpoint records
    if (const std::optional<int64_t> back = s.anomaly().act(step, st)) {
      step = *back - 1;  // rolled back: the loop's ++step continues with the checkpoint's next step
      prev = StepStats{};
      continue;
    }
    const int64_t done = step + 1;
    const bool last = done == s.steps();
    if (s.eval().due(done, last) || s.ckpt().export_due(done, last) || s.ckpt().due(done, last))
      s.whole_weights();                   // ZeRO 3: gathered for what reads them next
    s.eval().maybe(done, last);            // validation, multiple-choice tasks
    s.ckpt().maybe_export_hf(done, last);  // output.save_every
    s.completed(done);
    const StopRequest stop = s.control().stop_requested(done, last);  // signal or --stop-after, all ranks
    if (stop) s.whole_weights();
    if (s.ckpt().due(done, last) || stop) s.save_checkpoint(done, st.lr);
    if (stop) return s.stopped(done, stop);
  }
  return s.finish();  // final validation and tasks, HF directory, peak memory, sample
}

}  // namespace

TrainResult train(const Recipe& recipe, const TrainOptions& opts) {
  TrainSession s(recipe, opts);  // layout, preflight, rank model, optimizer, resume, startup report, data
  try {
    return run_steps(s);
  } catch (const std::exception& e) {
    s.log().fail(e);  // the error that ends the run, into OUTPUT/train.log too
    throw;
  }
}

}  // namespace lathe
