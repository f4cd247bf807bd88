#include "train/run_log.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>

#include "core/blas_env.h"
#include "core/error.h"
#include "core/progress.h"
#include "core/stop.h"
#include "core/sysinfo.h"
#include "io/fs.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/ops_bf16.h"
#include "models/memory.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/plan.h"
#include "train/peak.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) return line.substr(line.find(':') + 2);
  return "unknown";
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, bool append) : f_(std::fopen(path.c_str(), append ? "a" : "w")) {
  LATHE_CHECK(f_ != nullptr, "{}: cannot open for writing", path);
}

MetricsWriter::~MetricsWriter() { std::fclose(f_); }

void MetricsWriter::write(const nlohmann::json& j) {
  std::string s = j.dump() + "\n";
  std::fwrite(s.data(), 1, s.size(), f_);
  std::fflush(f_);
}

void trim_metrics(const std::string& path, int64_t step) {
  if (!fs::exists(path)) return;
  std::string text = io::read_file(path), kept;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) break;  // a torn last line from a crash
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    try {
      auto j = nlohmann::json::parse(line);
      if (j.value("step", int64_t{0}) <= step) kept += line + "\n";
    } catch (const nlohmann::json::exception&) {
    }
  }
  io::atomic_write_file(path, kept);
}

namespace {

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

}  // namespace

LogFile::~LogFile() {
  if (f_) std::fclose(f_);
}

void LogFile::open(const std::string& path, bool resumed, int64_t start_step) {
  f_ = std::fopen(path.c_str(), resumed ? "a" : "w");
  LATHE_CHECK(f_ != nullptr, "{}: cannot open the run log for writing (output.dir must be writable)", path);
  // The process and host: `lathe runs` tells a running run from a killed one by them.
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const std::string who = fmt::format("{}; pid {} on {}", utc_now(), static_cast<long>(::getpid()), host);
  const std::string marker = resumed ? fmt::format("==== resumed at step {} ({}) ====", start_step, who)
                                     : fmt::format("==== lathe {} started ({}) ====", LATHE_VERSION, who);
  std::vector<std::string> pending = std::move(pending_);
  pending_.clear();
  line(marker);
  // The runtime note this process printed to stderr before any log existed (before the re-execution,
  // core/blas_env.h): the first line said, so the first after the marker.
  if (!runtime_note().empty()) line(runtime_note());
  for (const std::string& s : pending) line(s);
}

void LogFile::line(const std::string& s) {
  if (!f_) {
    pending_.push_back(s);
    return;
  }
  std::fputs(s.c_str(), f_);
  std::fputc('\n', f_);
  std::fflush(f_);
}

void RunLog::log(const std::string& s) const {
  if (rank0_) file_.line(s);
  if (rank0_ && !quiet_) fmt::print("{}\n", s);
  std::fflush(stdout);
}

void RunLog::say(const std::string& s) const {
  if (rank0_) file_.line(s);
  if (rank0_) fmt::print("{}\n", s);
  std::fflush(stdout);
}

void RunLog::open_log_file(bool resumed, int64_t start_step) {
  if (rank0_) file_.open((fs::path(r_.output.dir) / "train.log").string(), resumed, start_step);
}

void RunLog::fail(const std::exception& e) const {
  if (rank0_ && file_.is_open())
    file_.line(dynamic_cast<const Interrupted*>(&e) ? std::string(e.what()) : "error: " + std::string(e.what()));
}

void RunLog::startup(const StartupFacts& f) {
  metrics_path_ = (fs::path(r_.output.dir) / "metrics.jsonl").string();
  if (rank0_ && f.resumed) trim_metrics(metrics_path_, f.start_step);
  const std::string resolved = r_.to_yaml();
  if (rank0_) io::atomic_write_file((fs::path(r_.output.dir) / "recipe.yaml").string(), resolved);
  log("resolved recipe (saved to " + (fs::path(r_.output.dir) / "recipe.yaml").string() + "):\n" + resolved);

  const Model& model = f.model;
  // MFU denominator: training.peak_gflops, else the GPU's dense peak (table or estimate), else the CPU probe.
  const std::optional<GpuInfo> gpu = model.backend().device_info();
  const PeakChoice peak_choice =
      choose_peak(r_.training.peak_gflops, gpu ? &*gpu : nullptr, model.compute_dtype(), &measure_peak_gflops);
  const double peak = peak_choice.gflops;
  const char* peak_source = r_.training.peak_gflops > 0 ? "recipe"
                            : !gpu                      ? "GEMM probe"
                            : peak_choice.estimated     ? "GPU estimate"
                                                        : "GPU table";
  const size_t P = model.num_params();
  // Per rank: parameters and gradients whole, moments of this rank's shard (ZeRO).
  const double moments = 2.0 * 4 * static_cast<double>(f.moment_elems);
  const double wcopy = static_cast<double>(model.compute_weight_bytes());  // bf16/fp16 weight copies
  const double est = static_cast<double>(P) * 4 * 2 + moments + static_cast<double>(model.activation_bytes()) + wcopy;
  log(fmt::format(
      "model {}: {:.2f}M parameters; precision {}{}; threads {}; peak {:.1f} GFLOP/s ({}; OpenBLAS kernel {})",
      r_.model.model_type, P / 1e6, r_.precision.compute,
      f.scaler.dynamic() ? fmt::format(" (loss scale {})", f.scaler.scale()) : std::string(), f.threads, peak,
      r_.training.peak_gflops > 0 ? std::string("from recipe")
      : !gpu                      ? std::string("measured by GEMM probe")
                                  : peak_choice.source,
      blas_kernel_name()));
  if (rank0_) write_run_info(f, peak, peak_source, gpu.has_value());
  if (f.tp > 1)
    log(fmt::format("tensor parallel: {} ranks per replica, {} of {} parameters on each (the rest of {} replicated)",
                    f.tp, P, f.whole_params, r_.model.model_type));
  if (f.pp > 1)
    log(parallel::describe_pipeline(*f.pipeline) +
        fmt::format("; {} of {} parameters on this rank", P, f.whole_params));
  if (r_.parallel.context > 1)
    log(fmt::format("context parallel: {} ranks per sequence ({} attention), {} of {} positions on each (chunks i "
                    "and 2N-1-i); replicated gradients reduced over data x context",
                    r_.parallel.context, r_.parallel.context_impl, f.T / r_.parallel.context, f.T));
  if (f.dp > 1)
    log(fmt::format(
        "data parallel: {} ranks, global batch {} samples ({} per rank as {} x {}), ZeRO {}, buckets of {:.1f} MB",
        f.dp, f.G, f.B * f.accum, f.accum, f.B, r_.parallel.zero, f.bucket_elems * 4 / 1e6));
  log(fmt::format(
      "memory estimate per rank: params {:.1f} MB + grads {:.1f} MB + {} moments {:.1f} MB{} + activations "
      "({}) {:.1f} MB = {:.1f} MB",
      P * 4 / 1e6, P * 4 / 1e6, r_.optimizer.name, moments / 1e6,
      wcopy > 0 ? fmt::format(" + {} weight copies {:.1f} MB", r_.precision.compute, wcopy / 1e6) : std::string(),
      r_.precision.compute, model.activation_bytes() / 1e6, est / 1e6));
  plan_line(f, peak);
  log(f.data_line);

  peak_gflops_ = peak;
  flops_per_step_ = f.whole_flops_per_token * static_cast<double>(f.G * f.T);
  memory_estimate_ = est;
  G_ = f.G;
  T_ = f.T;
  accum_ = f.accum;
  dp_ = f.dp;
  pp_ = f.pp;
  start_step_ = f.start_step;
}

// OUTPUT/run_info.json: what ran where, for `lathe report` and for anyone comparing runs later.
void RunLog::write_run_info(const StartupFacts& f, double peak, const char* peak_source, bool gpu) const {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const MachineMemory mm = machine_memory();
  const nlohmann::json info = {
      {"lathe_version", LATHE_VERSION},
      {"host", host},
      {"cpu", cpu_model_name()},
      {"cores_online", static_cast<int64_t>(::sysconf(_SC_NPROCESSORS_ONLN))},
      {"memory_bytes", mm.bytes},
      {"world_size", f.world_size},
      {"tensor_parallel", f.tp},
      {"pipeline_parallel", f.pp},
      {"threads_per_rank", f.threads},
      {"openblas_kernel", blas_kernel_name()},
      {"peak_gflops", peak},
      {"peak_source", peak_source},
      {"precision", r_.precision.compute},
      // The instruction set found and the host bf16 GEMM path
      // (kernels/cpu/ops_bf16.h; fp16 always widens to fp32).
      {"isa", cpu::isa_name(cpu::cpu_isa())},
      {"bf16_gemm", gpu                              ? "device"
                    : r_.precision.compute == "bf16" ? cpu::bf16_gemm_name(cpu::bf16_gemm_process_path())
                    : r_.precision.compute == "fp16" ? "fp32"
                                                     : "none"},
      {"parameters", f.model.num_params()},
      {"started_unix", static_cast<int64_t>(std::time(nullptr))}};
  io::atomic_write_file((fs::path(r_.output.dir) / "run_info.json").string(), info.dump(2) + "\n");
}

// What `lathe plan` predicts for this very layout (same peak; this machine's copy bandwidth), so a
// run shows how far it is from its plan.
void RunLog::plan_line(const StartupFacts& f, double peak) const {
  lathe::plan::Job job;
  job.context_allgather = r_.parallel.context_impl == "allgather";
  job.model = f.whole_cfg;
  job.world = f.world_size;
  job.micro_batch = f.B;
  job.seq_len = f.T;
  job.global_batch = f.G;
  job.compute = f.model.compute_dtype();
  lathe::plan::Machine m;
  m.peak_gflops = peak;
  m.inter_gbps = m.intra_gbps = f.copy_gbps;
  m.gpus_per_node = f.world_size;
  lathe::plan::Layout l;
  l.data = f.dp;
  l.tensor = f.tp;
  l.pipeline = f.pp;
  l.context = r_.parallel.context;
  l.virtual_stages = r_.parallel.virtual_stages;
  l.zero = static_cast<int>(r_.parallel.zero);
  l.recompute = f.model.recompute();
  const lathe::plan::Estimate e = lathe::plan::estimate(job, m, l);
  if (e.reject.empty())
    log(fmt::format(
        "plan for this layout ({}): {:.1f} MB per rank, {:.0f} ms per step, {:.0f} tokens/s{} "
        "(predicted by lathe plan at {:.0f} GFLOP/s and {:.1f} Gbit/s)",
        l.name(), e.memory.total() / 1e6, e.step_s * 1e3, e.tokens_per_s,
        e.bubble > 0 ? fmt::format(", bubble {:.1f}%", 100 * e.bubble) : std::string(), peak, m.inter_gbps));
}

void RunLog::open_records(bool resumed, bool anomaly_audit) {
  if (!rank0_) return;
  metrics_ = std::make_unique<MetricsWriter>(metrics_path_, resumed);
  // Appended across resumes and rollbacks: it is the audit trail. Only written with the policy on.
  if (anomaly_audit)
    anomalies_ = std::make_unique<MetricsWriter>((fs::path(r_.output.dir) / "anomalies.jsonl").string(), resumed);
  if (r_.output.tensorboard)
    tensorboard_ = std::make_unique<TensorBoardWriter>((fs::path(r_.output.dir) / "tensorboard").string(),
                                                       resumed ? start_step_ : 0, r_.to_yaml());
}

void RunLog::metrics(const nlohmann::json& j, const char* group) {
  if (metrics_) metrics_->write(j);
  if (tensorboard_) tensorboard_->record(group, j);
  if (rank0_ && on_metrics_) on_metrics_(j);
}

void RunLog::audit(const nlohmann::json& j, const std::string& line) {
  if (anomalies_) anomalies_->write(j);
  say(line);
}

void RunLog::restart_metrics_at(int64_t step) {
  if (!rank0_) return;
  metrics_.reset();
  trim_metrics(metrics_path_, step);
  metrics_ = std::make_unique<MetricsWriter>(metrics_path_, true);
  if (tensorboard_) tensorboard_->restart_at(step);
}

void RunLog::step(int64_t step, const StepStats& st, const optim::LossScaler& scaler, const AnomalyPolicy& anomaly) {
  const int64_t steps = r_.training.steps;
  const std::string& precision = r_.precision.compute;
  const int64_t skipped_total = scaler.state().skipped_steps;
  const double loss = st.loss, norm = st.norm, lr = st.lr, dt = st.seconds, wait = st.data_wait_s,
               comm_wait = st.comm_wait_s;
  comm_total_ += comm_wait;
  step_time_sum_ += dt;
  ++steps_timed_;
  const double eta_s = static_cast<double>(steps - (step + 1)) * step_time_sum_ / steps_timed_;
  const double tok_s = static_cast<double>(G_ * T_) / dt;
  const double mfu = peak_gflops_ > 0 ? flops_per_step_ / dt / (peak_gflops_ * 1e9) : 0.0;  // 0: unknown GPU peak
  nlohmann::json rec = {{"step", step + 1},
                        {"loss", loss},
                        {"lr", lr},
                        {"grad_norm", norm},
                        {"tokens_per_s", tok_s},
                        {"mfu", mfu},
                        {"ms_per_step", dt * 1e3},
                        {"data_wait_pct", 100.0 * wait / dt},
                        {"comm_exposed_ms", comm_wait * 1e3},
                        {"comm_exposed_pct", 100.0 * comm_wait / dt},
                        {"optimizer_ms", st.optimizer_s * 1e3},
                        {"optimizer_pct", 100.0 * st.optimizer_s / dt},
                        // the rest of the step: forward and backward (and what is not measured apart)
                        {"compute_pct", 100.0 * std::max(0.0, dt - wait - comm_wait - st.optimizer_s) / dt},
                        {"world_size", dp_},
                        {"tokens", (step + 1) * G_ * T_},
                        {"precision", precision},
                        {"loss_scale", st.loss_scale},
                        {"skipped", st.skipped},
                        {"skipped_steps", skipped_total},
                        {"eta_s", eta_s}};
  if (r_.parallel.context > 1) {  // rank 0's waits for the context group's K/V, dK/dV (in compute_pct)
    rec["context_comm_exposed_ms"] = st.context_wait_s * 1e3;
    rec["context_comm_exposed_pct"] = 100.0 * st.context_wait_s / dt;
  }
  if (std::isfinite(st.moe_aux_loss)) rec["moe_aux_loss"] = st.moe_aux_loss;  // mixture of experts
  // ZeRO 3: rank 0's bytes received by weight gathers this step (bf16/fp16: the GEMM weights in that dtype).
  if (st.weight_gather_bytes >= 0) rec["weight_gather_mb"] = static_cast<double>(st.weight_gather_bytes) / (1 << 20);
  if (pp_ > 1)  // the schedule's idle share of the step, (p-1)/(v m + p-1) (not measured)
    rec["bubble_pct"] = 100 * pipeline::bubble_formula(pp_, accum_, r_.parallel.virtual_stages);
  if (anomaly.enabled()) {  // the policy's verdict and the factor this step's lr carried
    rec["anomaly"] = st.anomaly.anomaly;
    rec["anomalies"] = anomaly.state().anomalies;
    rec["lr_factor"] = st.lr_factor;
  }
  metrics(rec, "train");

  // The precision, the loss scale this step carried (fp16) and the skipped steps so far.
  const std::string prec =
      fmt::format("{}{}{}", precision, scaler.dynamic() ? fmt::format(" scale {}", st.loss_scale) : std::string(),
                  skipped_total ? fmt::format(" | skipped {}", skipped_total) : std::string());
  if (st.skipped)  // always logged, whatever log_interval
    log(fmt::format(
        "step {:>6}/{} | SKIPPED: {} not finite (loss {:.4f}, grad norm {:.4f}); weights and moments unchanged, "
        "batch consumed | {}{} | skipped {} ({} in a row; training.max_skipped_steps {})",
        step + 1, steps,
        !std::isfinite(st.norm) && !std::isfinite(st.loss) ? "the loss and the gradient norm are"
        : std::isfinite(st.norm)                           ? "the loss is"
                                                           : "the gradient norm is",
        loss, norm, precision,
        scaler.dynamic() ? fmt::format(" scale {} -> {}", st.loss_scale, scaler.scale()) : std::string(), skipped_total,
        scaler.state().consecutive_skipped, r_.training.max_skipped_steps));
  else if ((step + 1) % r_.training.log_interval == 0 || step == 0 || step + 1 == steps)
    log(fmt::format(
        "step {:>6}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.4f} | {} | {:.0f} tok/s | MFU {:.1f}% | "
        "{:.1f} ms | data wait {:.1f}% | optimizer {:.1f}%{} | ETA {}",
        step + 1, steps, loss, lr, norm, prec, tok_s, 100 * mfu, dt * 1e3, 100.0 * wait / dt,
        100.0 * st.optimizer_s / dt,
        dp_ > 1 ? fmt::format(" | comm exposed {:.1f} ms ({:.1f}%)", comm_wait * 1e3, 100.0 * comm_wait / dt)
                : std::string(),
        progress::format_duration(eta_s)));
}

void RunLog::finish(int64_t peak_rss, int64_t train_peak_rss, int world_size, int64_t skipped_steps) {
  log(fmt::format("peak resident memory {:.1f} MB{}, during the training steps {:.1f} MB (estimate {:.1f} MB per rank)",
                  peak_rss / 1e6, world_size > 1 ? " (largest rank)" : "", train_peak_rss / 1e6,
                  memory_estimate_ / 1e6));
  metrics({{"step", r_.training.steps},
           {"world_size", dp_},
           {"peak_rss_mb_max_rank", peak_rss / 1e6},
           {"train_peak_rss_mb_max_rank", train_peak_rss / 1e6},
           {"skipped_steps", skipped_steps},
           {"comm_exposed_s_total", comm_total_}},
          "run");
}

}  // namespace lathe
