#include "models/memory.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/checked.h"
#include "core/error.h"
#include "models/model.h"

namespace lathe {

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e12) return fmt::format("{:.1f} TB", b / 1e12);
  if (b >= 1e9) return fmt::format("{:.1f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.1f} MB", b / 1e6);
  return fmt::format("{:.1f} KB", b / 1e3);
}

namespace {
std::string format_count(int64_t n) {
  const double d = static_cast<double>(n);
  if (d >= 1e12) return fmt::format("{:.1f}T", d / 1e12);
  if (d >= 1e9) return fmt::format("{:.1f}B", d / 1e9);
  if (d >= 1e6) return fmt::format("{:.1f}M", d / 1e6);
  return fmt::format("{}", n);
}
}  // namespace

std::string MemoryEstimate::breakdown() const {
  std::string s = fmt::format("params {} + grads {}", format_bytes(param_bytes), format_bytes(grad_bytes));
  if (param_shards > 1)
    s = fmt::format("params {} (1/{} shard + {} blocks gathered, prefetch {}) + grads {} (1/{} shard + blocks in backward)",
                    format_bytes(param_bytes), param_shards, format_bytes(gather_bytes), prefetch,
                    format_bytes(grad_bytes), moment_shards);
  if (optimizer_moments > 0)
    s += fmt::format(" + optimizer moments ({}{}) {}", optimizer_moments,
                     moment_shards > 1 ? fmt::format(", 1/{} shard per rank", moment_shards) : std::string(),
                     format_bytes(optimizer_bytes));
  if (compute_weight_bytes > 0)
    s += fmt::format(" + {} weight copies {}", compute_dtype_name(compute_dtype), format_bytes(compute_weight_bytes));
  if (batch > 0)
    s += fmt::format(
        " + activations ({}batch {} x seq_len {}{}{}) {}",
        compute_dtype != DType::F32 ? compute_dtype_name(compute_dtype) + ", " : std::string(), batch, seq_len,
        recompute != Recompute::None ? fmt::format(", recompute {}", recompute_name(recompute)) : std::string(),
        sequence_parts > 1
            ? fmt::format(", sequence parallel over {} saves {}", sequence_parts, format_bytes(sequence_saving_bytes))
            : std::string(),
        format_bytes(activation_bytes));
  return s + fmt::format(" = {}", format_bytes(total_bytes()));
}

MemoryEstimate estimate_memory(const ModelConfig& cfg, int64_t B, int64_t T, int optimizer_moments,
                               int64_t moment_shards, DType compute_dtype, Recompute recompute,
                               const TensorShard& shard) {
  LATHE_CHECK(moment_shards >= 1, "internal: {} moment shards", moment_shards);
  cfg.validate("model");  // bounds first: the products below assume them
  LATHE_CHECK(optimizer_moments >= 0 && optimizer_moments <= 8, "internal: {} optimizer moments", optimizer_moments);
  LATHE_CHECK(B >= 0 && T >= 0, "batch {} x seq_len {} must not be negative", B, T);
  const std::string what = fmt::format("memory of {} (batch {} x seq_len {})", cfg.model_type, B, T);
  MemoryEstimate e;
  e.num_params = cfg.num_parameters();
  e.param_bytes = checked_mul(e.num_params, 4, what);
  e.grad_bytes = e.param_bytes;
  e.optimizer_moments = optimizer_moments;
  e.moment_shards = moment_shards;
  // A ZeRO shard: the rank's part of the flat buffer, rounded up.
  e.optimizer_bytes = (checked_mul(e.param_bytes, optimizer_moments, what) + moment_shards - 1) / moment_shards;
  if (B > 0 && T > 0) {
    e.batch = B;
    e.seq_len = T;
    e.recompute = recompute;
    // The same layout walk as Model::allocate (so Model::activation_bytes equals this exactly).
    e.activation_bytes = static_cast<int64_t>(
        Model::plan_activations(cfg, B, T, ComputeSpec{nullptr, compute_dtype}, recompute, shard).bytes);
    if (shard.seq_parallel()) {
      TensorShard whole_rows = shard;
      whole_rows.sequence_parallel = false;
      e.sequence_parts = shard.parts;
      e.sequence_saving_bytes =
          static_cast<int64_t>(
              Model::plan_activations(cfg, B, T, ComputeSpec{nullptr, compute_dtype}, recompute, whole_rows).bytes) -
          e.activation_bytes;
    }
  }
  e.compute_dtype = compute_dtype;
  if (compute_dtype != DType::F32)
    e.compute_weight_bytes = checked_mul(e.num_params, static_cast<int64_t>(dtype_size(compute_dtype)), what);
  int64_t total = 0;
  for (int64_t part : {e.param_bytes, e.grad_bytes, e.optimizer_bytes, e.activation_bytes, e.compute_weight_bytes})
    total = checked_add(total, part, what);
  (void)total;  // total_bytes() recomputes it; this proves it fits
  return e;
}

void shard_parameters(MemoryEstimate& e, const ModelConfig& cfg, int64_t shards, int prefetch,
                      int64_t weight_shards, int64_t bucket_elems) {
  LATHE_CHECK(shards >= 1 && prefetch >= 0, "internal: {} weight shards, prefetch {}", shards, prefetch);
  if (shards == 1) return;
  const std::string what = "ZeRO 3 memory";
  const int64_t C = cfg.hidden_size, L = std::max<int64_t>(1, cfg.num_hidden_layers);
  const int64_t wte = checked_mul(cfg.vocab_size, C, what);
  const int64_t wpe = cfg.is_gpt2() ? checked_mul(cfg.max_position_embeddings, C, what) : 0;
  const int64_t head = wte + 2 * C;  // the lm head (or the tied wte) and the final norm
  const int64_t body = e.num_params - wte - wpe - (cfg.tie_word_embeddings ? 0 : wte) - 2 * C;
  const int64_t layer = (std::max<int64_t>(body, 0) + L - 1) / L;
  // The pass visits embedding, L layers, head, L layers, embedding; at most 1 + prefetch
  // consecutive blocks are gathered at once (parallel/param_gather.h).
  std::vector<int64_t> seq = {wte + wpe};
  for (int64_t i = 0; i < std::min<int64_t>(L, prefetch + 1); ++i) seq.push_back(layer);  // longer runs: same sums
  seq.push_back(head);
  for (int64_t i = 0; i < std::min<int64_t>(L, prefetch + 1); ++i) seq.push_back(layer);
  seq.push_back(wte + wpe);
  int64_t window = 0;
  for (size_t i = 0; i < seq.size(); ++i) {
    int64_t sum = 0;
    for (size_t k = i; k < std::min(seq.size(), i + 1 + static_cast<size_t>(prefetch)); ++k) sum += seq[k];
    window = std::max(window, sum);
  }
  const int64_t shard = (e.num_params + shards - 1) / shards;
  const int64_t ws = weight_shards > 0 ? weight_shards : shards;
  e.param_shards = ws;
  e.prefetch = prefetch;
  e.gather_bytes = checked_mul(window, 4, what);
  e.param_bytes = checked_add(checked_mul((e.num_params + ws - 1) / ws, 4, what), e.gather_bytes, what);
  // bf16/fp16: the compute copy of the weight shard and of the blocks gathered (converted per block).
  if (e.compute_weight_bytes > 0)
    e.compute_weight_bytes = checked_mul(checked_add((e.num_params + ws - 1) / ws, window, what),
                                         static_cast<int64_t>(dtype_size(e.compute_dtype)), what);
  // Gradients written and not yet reduced: a block's (a tied wte's from the head's backward until
  // the embedding's, with a layer's on top).
  const int64_t pending = checked_add(std::max(std::max(wte + wpe, head), (cfg.tie_word_embeddings ? wte : 0) + layer),
                                      std::min(std::max<int64_t>(bucket_elems, 0), e.num_params), what);
  e.grad_bytes = checked_mul(std::min(checked_add(shard, pending, what), e.num_params), 4, what);  // at most the buffer
}

namespace {

// First number in a small kernel-provided file; -1 if absent or not a number ("max").
int64_t read_number(const std::string& path, const std::string& key = "") {
  std::ifstream f(path);
  if (!f) return -1;
  std::string line;
  while (std::getline(f, line)) {
    if (!key.empty() && line.rfind(key, 0) != 0) continue;
    std::istringstream is(key.empty() ? line : line.substr(key.size()));
    int64_t v = -1;
    if (is >> v) return v;
    return -1;
  }
  return -1;
}

}  // namespace

MachineMemory machine_memory() {
  MachineMemory m;
  auto consider = [&](int64_t bytes, std::string source) {
    if (bytes <= 0) return;
    if (m.bytes == 0 || bytes < m.bytes) {
      m.bytes = bytes;
      m.source = std::move(source);
    }
  };
  const int64_t kb = read_number("/proc/meminfo", "MemTotal:");
  if (kb > 0 && kb < (int64_t{1} << 52)) consider(kb * 1024, "this machine's memory (MemTotal in /proc/meminfo)");
  const int64_t cg = read_number("/sys/fs/cgroup/memory.max");  // cgroup v2; "max" = none
  if (cg > 0) consider(cg, "the cgroup's memory limit (/sys/fs/cgroup/memory.max)");
  const int64_t cg1 = read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes");  // cgroup v1
  if (cg1 > 0 && cg1 < (int64_t{1} << 60)) consider(cg1, "the cgroup's memory limit (memory.limit_in_bytes)");
  struct rlimit rl {};
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < (rlim_t{1} << 62))
    consider(static_cast<int64_t>(rl.rlim_cur), "the address-space limit (ulimit -v)");
  return m;
}

void check_memory_fits(const MemoryEstimate& est, const ModelConfig& cfg, std::string_view what) {
  const MachineMemory mm = machine_memory();
  if (mm.bytes == 0 || est.total_bytes() <= mm.bytes) return;
  const bool g = cfg.is_gpt2();
  throw_error(
      "{}: the model ({} {} = {}, {} = {}, {} = {}, intermediate_size = {}; {} parameters) needs {} but {} is "
      "{}: reduce the model's dimensions{}",
      what, cfg.model_type, g ? "n_layer" : "num_hidden_layers", cfg.num_hidden_layers, g ? "n_embd" : "hidden_size",
      cfg.hidden_size, "vocab_size", cfg.vocab_size, cfg.intermediate_size, format_count(est.num_params),
      est.breakdown(), mm.source, format_bytes(mm.bytes),
      est.batch > 0 ? " or training.micro_batch_size / seq_len" : "");
}

}  // namespace lathe
