// What a training run tells the world: log lines, the startup report (recipe.yaml, run_info.json,
// the layout, memory and plan lines), OUTPUT/metrics.jsonl (one record per step, validation, task
// scores, checkpoints, the end of the run) and OUTPUT/anomalies.jsonl (the anomaly policy's audit
// trail). Only rank 0 prints and writes these files: the one place that decides it is this class,
// so no caller tests the rank before logging. Internal to src/train (opened by train/session.cpp).
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "models/model.h"
#include "optim/loss_scaler.h"
#include "parallel/pipeline_stage.h"
#include "train/anomaly.h"
#include "train/preflight.h"
#include "train/tensorboard.h"
#include "train/train_step.h"

namespace lathe {

// Appends one JSON object per line and flushes, so a crash loses at most the current line.
class MetricsWriter {
 public:
  MetricsWriter(const std::string& path, bool append);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const nlohmann::json& j);

 private:
  std::FILE* f_;
};

// OUTPUT/train.log: every line rank 0 prints (also those --quiet keeps off stdout), written and
// flushed line by line so that `tail -f` follows the run. Lines said before the run directory is
// claimed wait in memory until open(). A resume appends after a marker line; a new run starts it over.
class LogFile {
 public:
  LogFile() = default;
  ~LogFile();
  LogFile(const LogFile&) = delete;
  LogFile& operator=(const LogFile&) = delete;
  void open(const std::string& path, bool resumed, int64_t start_step);
  void line(const std::string& s);
  bool is_open() const { return f_ != nullptr; }

 private:
  std::FILE* f_ = nullptr;
  std::vector<std::string> pending_;
};

// Keeps the records of steps <= `step` of the JSONL file `path` (a resumed run rewrites what came
// after its checkpoint); a torn last line from a crash is dropped. No-op when it does not exist.
void trim_metrics(const std::string& path, int64_t step);

// The facts the startup report states; gathered by the session once the rank's model and the
// optimizer exist.
struct StartupFacts {
  const Model& model;            // this rank's (a shard or stage with tensor or pipeline parallelism)
  const ModelConfig& whole_cfg;  // the whole model's, and its parameter count
  size_t whole_params = 0;
  double whole_flops_per_token = 0;
  int world_size = 1, tp = 1, pp = 1, dp = 1, threads = 1;
  int64_t B = 1, T = 1, accum = 1, G = 1;              // micro-batch, seq_len, accumulation, global batch (samples)
  double copy_gbps = 100;                              // this machine's copy bandwidth (for the plan line)
  size_t moment_elems = 0;                             // of this rank's optimizer shard (ZeRO)
  size_t bucket_elems = 0;                             // of the data-parallel gradient reduction
  const parallel::PipelineLayout* pipeline = nullptr;  // pipeline parallelism: this rank's stage
  const optim::LossScaler& scaler;
  bool resumed = false;  // a resume: metrics.jsonl keeps the records up to start_step
  int64_t start_step = 0;
  std::string data_line;  // what the run trains and validates on
};

class RunLog {
 public:
  RunLog(const Recipe& r, bool rank0, bool quiet) : r_(r), rank0_(rank0), quiet_(quiet) {}

  bool rank0() const { return rank0_; }
  // Called with each metrics.jsonl record (TrainOptions::on_metrics), rank 0 only.
  void set_metrics_hook(std::function<void(const nlohmann::json&)> fn) { on_metrics_ = std::move(fn); }
  // A routine line (silenced by --quiet).
  void log(const std::string& s) const;
  // A line printed even with --quiet: resume decisions, stops, anomalies (what state the run is in).
  void say(const std::string& s) const;
  std::function<void(const std::string&)> log_fn() const {
    return [this](const std::string& s) { log(s); };
  }
  std::function<void(const std::string&)> say_fn() const {
    return [this](const std::string& s) { say(s); };
  }
  PreflightLog preflight_log() const { return {log_fn(), say_fn()}; }
  // OUTPUT/train.log, once the run directory is this run's (after claim_run_dir); the lines said so
  // far go in first. `start_step` > 0 with `resumed`: appended after a "==== resumed" marker.
  void open_log_file(bool resumed, int64_t start_step);
  // The exception that ends the run, into train.log only (main() prints it to stderr): "error: ..."
  // or, for a stop request honoured before any result was written (core/stop.h), its message.
  void fail(const std::exception& e) const;

  // metrics.jsonl trimmed to start_step on a resume, recipe.yaml, run_info.json and the lines that
  // describe the run (model, layout, memory estimate, lathe plan's prediction, data).
  void startup(const StartupFacts& f);
  // metrics.jsonl (appended to on a resume), with the anomaly policy on anomalies.jsonl, with
  // output.tensorboard a new TensorBoard event file.
  void open_records(bool resumed, bool anomaly_audit);
  // One metrics.jsonl record; `group` names its TensorBoard tags: "train" (steps), "val", "tasks",
  // "checkpoint", "run" (the end of the run).
  void metrics(const nlohmann::json& j, const char* group);
  // One line of anomalies.jsonl and the same event as a log line.
  void audit(const nlohmann::json& j, const std::string& line);
  // After a rollback to `step`: the curves continue from the checkpoint, as after a resume.
  void restart_metrics_at(int64_t step);

  // The step's metrics record and log line (every log_interval steps; skipped steps always).
  void step(int64_t step, const StepStats& st, const optim::LossScaler& scaler, const AnomalyPolicy& anomaly);
  // The end of the run: peak memory (largest rank) and the totals record.
  void finish(int64_t peak_rss, int64_t train_peak_rss, int world_size, int64_t skipped_steps);

  const std::string& metrics_path() const { return metrics_path_; }

 private:
  void write_run_info(const StartupFacts& f, double peak, const char* peak_source, bool gpu) const;
  void plan_line(const StartupFacts& f, double peak) const;

  const Recipe& r_;
  const bool rank0_, quiet_;
  mutable LogFile file_;  // OUTPUT/train.log (rank 0)
  std::function<void(const nlohmann::json&)> on_metrics_;
  std::string metrics_path_;
  std::unique_ptr<MetricsWriter> metrics_, anomalies_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  int64_t start_step_ = 0;
  // Set by startup() for the step records.
  double peak_gflops_ = 0, flops_per_step_ = 0, memory_estimate_ = 0;
  int64_t G_ = 1, T_ = 1, accum_ = 1;
  int dp_ = 1, pp_ = 1;
  // ETA: remaining steps x the mean step time of this process's steps; exposed communication total.
  double step_time_sum_ = 0, comm_total_ = 0;
  int64_t steps_timed_ = 0;
};

}  // namespace lathe
