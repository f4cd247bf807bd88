#include "parallel/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "core/checked.h"
#include "core/error.h"
#include "core/timer.h"
#include "dist/comm.h"
#include "models/memory.h"
#include "models/model.h"
#include "parallel/pipeline_schedule.h"

namespace lathe::plan {

std::string Layout::name() const {
  return fmt::format("data {} x tensor {} x pipeline {}{}{}{}, ZeRO {}, recompute {}", data, tensor, pipeline,
                     virtual_stages > 1 ? fmt::format(" (virtual {})", virtual_stages) : std::string(),
                     context > 1 ? fmt::format(" x context {}", context) : std::string(), sequence ? " +sp" : "", zero,
                     recompute_name(recompute));
}

double flops_per_token(const ModelConfig& cfg, int64_t T) {
  double n = static_cast<double>(cfg.num_parameters());
  if (cfg.is_gpt2()) n -= static_cast<double>(cfg.max_position_embeddings * cfg.hidden_size);
  // Mixture of experts: a token runs through num_experts_per_tok of each layer's experts (active
  // parameters, as Model::flops_per_token).
  if (cfg.moe())
    n -= static_cast<double>(cfg.num_hidden_layers) *
         static_cast<double>(cfg.num_local_experts - cfg.num_experts_per_tok) * 3.0 *
         static_cast<double>(cfg.hidden_size) * static_cast<double>(cfg.intermediate_size);
  return 6.0 * n + 12.0 * static_cast<double>(cfg.attention_width()) * cfg.attention_keys_over_layers(T);
}

namespace {

// The parameter table cut into what a stage holds: per decoder layer (of which `layer_repl` is
// replicated across tensor ranks: norms and the biases added after a row-parallel reduction),
// the token embedding, the learned positions, an untied head and the final norm.
struct Params {
  int64_t layer = 0, layer_repl = 0, wte = 0, wpe = 0, head = 0, final_norm = 0;
};

Params split_params(const ModelConfig& cfg) {
  ModelConfig one = cfg, two = cfg;
  one.num_hidden_layers = 1;
  two.num_hidden_layers = 2;
  Params s;
  s.layer = two.num_parameters() - one.num_parameters();
  const int64_t C = cfg.hidden_size;
  s.wte = cfg.vocab_size * C;
  s.wpe = cfg.is_gpt2() ? cfg.max_position_embeddings * C : 0;
  s.head = cfg.tie_word_embeddings ? 0 : s.wte;
  s.final_norm = one.num_parameters() - s.layer - s.wte - s.wpe - s.head;
  s.layer_repl = (cfg.gelu_mlp() ? 4 * C : 2 * C) + (cfg.o_bias() ? C : 0) + (cfg.gelu_mlp() ? C : 0) +
                 (cfg.qk_norm ? 2 * cfg.head_dim() : 0);  // q/k norm weights: replicated
  LATHE_CHECK(s.final_norm >= 0 && s.layer_repl <= s.layer, "internal: parameter split of {} ({} per layer, {} rest)",
              cfg.model_type, s.layer, s.final_norm);
  return s;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How tensor / sequence parallelism divide an activation buffer of Model's arena.
enum class Split { Wide, Hidden, Fixed };
Split split_of(std::string_view name) {
  if (name.rfind("shared.", 0) == 0) name.remove_prefix(7);
  for (std::string_view w : {"qkv", "qk_saved", "qk_rstd", "att", "lse", "fc", "act", "dqkv", "datt", "dfc", "dact"})
    if (name == w) return Split::Wide;  // heads / MLP width: column-parallel outputs
  if (name == "scratch" || name == "rope_cos" || name == "rope_sin") return Split::Fixed;
  return Split::Hidden;  // [N, C] residual stream, norms and their statistics, losses
}

double ring(int64_t n, double bytes, double bytes_per_s, bool all_reduce) {
  if (n <= 1 || bytes <= 0) return 0;
  const double f = static_cast<double>(n - 1) / static_cast<double>(n);
  return (all_reduce ? 2 : 1) * f * bytes / bytes_per_s;
}

struct Sched {
  double makespan = 0, bubble = 0;
  std::vector<int64_t> in_flight;
};
using ScheduleKey = std::tuple<int64_t, int64_t, int64_t, int64_t, std::vector<double>, std::vector<double>, double>;

// Micro-batches after which a schedule is in its steady phase for sure: the longest warm-up is
// interleaving's (p - 1) x 2 + (v - 1) x p chunk-forwards, under (v + 1) p micro-batches.
int64_t steady_after(int64_t p, int64_t v) { return 2 * p * (v + 1); }

// The schedule's step with these costs, simulated directly while p x m x v <= limit. Beyond, each
// further group of p micro-batches adds the same time once the pipeline is in its steady phase:
// two simulations (m1 and m1 + p micro-batches) extend it linearly, and the micro-batches in flight
// have reached their maximum (tests/parallel/test_plan.cpp compares both ways).
Sched run_schedule_uncached(const pipeline::Spec& spec, const pipeline::Costs& c, int64_t limit) {
  const int64_t p = spec.stages, v = spec.virtual_stages, m = spec.micro_batches;
  auto sim = [&](int64_t mb) {
    pipeline::Spec s = spec;
    s.micro_batches = mb;
    pipeline::SimResult r = pipeline::simulate(s, pipeline::make_schedule(s), c);
    LATHE_CHECK(r.ok, "internal: {} schedule p {} m {} v {}: {}", pipeline::kind_name(s.kind), p, mb, v, r.error);
    return r;
  };
  const int64_t m1 = steady_after(p, v);
  if (p * m * v <= limit || m <= m1 + p) {
    const pipeline::SimResult r = sim(m);
    return {r.makespan, r.bubble, r.max_in_flight};
  }
  const pipeline::SimResult r1 = sim(m1), r2 = sim(m1 + p);
  Sched out;
  out.makespan = r2.makespan + static_cast<double>(m - m1 - p) * (r2.makespan - r1.makespan) / static_cast<double>(p);
  double busy = 0;
  for (double b : r2.busy) busy += b;
  busy *= static_cast<double>(m) / static_cast<double>(m1 + p);  // compute grows exactly with m
  out.bubble = out.makespan > 0 ? 1 - busy / (static_cast<double>(p) * out.makespan) : 0;
  out.in_flight = r2.max_in_flight;
  return out;
}

// ---- context parallelism (issue 27; parallel/context_parallel.h) ----------------------------
// One rank's K|V rows of one micro-batch (fp32, the rank's kv heads): what a ring step passes on.
int64_t context_kv_bytes(const Job& job, const Layout& l) {
  const ModelConfig& cfg = job.model;
  return checked_product(
      {job.micro_batch, job.seq_len / l.context, 2 * cfg.num_key_value_heads / l.tensor, cfg.head_dim(), 4},
      "plan: context K/V bytes");
}

// ContextAttention's buffers (allocated once per rank): ring: its K|V, the next one, two travelling
// dK|dV and one block's contribution; all-gather: every rank's K|V and dK|dV; both one block's out
// and lse; a 16-bit compute dtype adds the widened qkv, dqkv, out and dout of the rank's rows.
int64_t context_buffers(const Job& job, const Layout& l) {
  if (l.context <= 1) return 0;
  const ModelConfig& cfg = job.model;
  const int64_t kv = context_kv_bytes(job, l), rows = job.micro_batch * (job.seq_len / l.context);
  const int64_t H = cfg.num_attention_heads / l.tensor, KVH = cfg.num_key_value_heads / l.tensor, D = cfg.head_dim();
  int64_t n = job.context_allgather ? 2 * l.context * kv : 5 * kv;
  n += rows * H * (D + 1) * 4;
  if (job.compute != DType::F32) n += 2 * rows * (H + 2 * KVH) * D * 4 + 2 * rows * H * D * 4;
  return n;
}

// Per layer and micro-batch: the bytes a rank sends and the seconds of exchange the attention
// compute does not hide. attn_flops: attention FLOPs per token and layer (forward + backward, the
// 12 (H D) keys term); s_per_flop_row: seconds per FLOP of one of the rank's rows (rows / tensor /
// peak). The ring sends its K/V c - 1 times, each transfer overlapped with one block's attention
// (1/c of the layer's): exposed max(0, transfer - block); its backward sends K/V the same way and
// then dK/dV c times after each block, not overlapped. The all-gather sends the same c - 1 blocks
// in one collective before the attention (not overlapped), backward an all-gather and a
// reduce-scatter of as many bytes.
struct ContextCost {
  int64_t bytes_fwd = 0, bytes_bwd = 0;
  double fwd_s = 0, bwd_s = 0;
};
ContextCost context_cost(const Job& job, const Layout& l, double attn_flops, double s_per_flop_row,
                         double bytes_per_s) {
  ContextCost x;
  const int64_t c = l.context;
  if (c <= 1) return x;
  const int64_t kv = context_kv_bytes(job, l);
  const double hop = static_cast<double>(kv) / bytes_per_s;
  const double block_fwd = attn_flops / 3 * s_per_flop_row / static_cast<double>(c), block_bwd = 2 * block_fwd;
  x.bytes_fwd = (c - 1) * kv;
  if (job.context_allgather) {
    x.bytes_bwd = 2 * (c - 1) * kv;
    x.fwd_s = static_cast<double>(c - 1) * hop;
    x.bwd_s = 2 * x.fwd_s;
  } else {
    x.bytes_bwd = (2 * c - 1) * kv;
    x.fwd_s = static_cast<double>(c - 1) * std::max(0.0, hop - block_fwd);
    x.bwd_s = static_cast<double>(c - 1) * std::max(0.0, hop - block_bwd) + static_cast<double>(c) * hop;
  }
  return x;
}

// Why the model or the sequence cannot take layout l ("" = they can): head, width and layer splits,
// and what a run refuses with context parallelism (config/recipe.cpp).
std::string shape_reject(const Job& job, const Layout& l) {
  const ModelConfig& cfg = job.model;
  const int64_t t = l.tensor, p = l.pipeline, c = l.context, B = job.micro_batch, T = job.seq_len;
  const int64_t L = cfg.num_hidden_layers;
  auto reject = [](std::string why) { return why; };
  if (cfg.moe() && (t > 1 || p > 1 || c > 1 || l.recompute != Recompute::None || job.compute != DType::F32))
    return reject("a mixture-of-experts model runs data parallelism alone in fp32 without recompute so far");
  if (cfg.num_attention_heads % t)
    return reject(fmt::format("tensor {} does not divide num_attention_heads {}", t, cfg.num_attention_heads));
  if (cfg.num_key_value_heads % t)
    return reject(fmt::format("tensor {} does not divide num_key_value_heads {}", t, cfg.num_key_value_heads));
  if (cfg.intermediate_size % t)
    return reject(fmt::format("tensor {} does not divide intermediate_size {}", t, cfg.intermediate_size));
  if (cfg.vocab_size < t)  // uneven vocabulary shards are fine (parallel/tensor_parallel.h), empty ones are not
    return reject(
        fmt::format("tensor {} is more than vocab_size {} (vocab-parallel embedding and head)", t, cfg.vocab_size));
  const int64_t v = l.virtual_stages, S = p * v;
  if (L % p) return reject(fmt::format("pipeline {} does not divide num_hidden_layers {}", p, L));
  if (v > 1 && L % S)
    return reject(fmt::format("pipeline {} x virtual stages {} does not divide num_hidden_layers {}", p, v, L));
  if (c > 1) {  // what a run refuses with context parallelism (config/recipe.cpp)
    if (l.zero == 3) return reject(fmt::format("ZeRO 3 with context {}: runs refuse it (parallel.zero <= 2)", c));
    if (T % (2 * c))
      return reject(fmt::format("context {} does not split seq_len {} into 2 x {} equal chunks", c, T, c));
    if (l.sequence && (B * (T / c)) % t)
      return reject(
          fmt::format("sequence parallel: tensor {} does not divide micro_batch_size {} x seq_len / "
                      "context {} = {} rows",
                      t, B, c, B * (T / c)));
  } else if (l.sequence && T % t) {
    return reject(fmt::format("sequence parallel: tensor {} does not divide seq_len {}", t, T));
  }
  return "";
}

}  // namespace

struct ScheduleCache {
  std::map<ScheduleKey, Sched> map;
};

namespace {

// The same, remembered across the layouts of one enumeration (ZeRO stages and often recompute modes
// share the pipeline's costs; every layout of a (p, m, v) shares the unit-cost run).
Sched run_schedule(const pipeline::Spec& spec, const pipeline::Costs& c, int64_t limit, ScheduleCache* cache) {
  const int64_t p = spec.stages, v = spec.virtual_stages, m = spec.micro_batches;
  ScheduleKey key{p, m, v, limit, c.forward_per_stage, c.backward_per_stage, c.p2p};
  if (cache) {
    auto it = cache->map.find(key);
    if (it != cache->map.end()) return it->second;
  }
  Sched out = run_schedule_uncached(spec, c, limit);
  if (cache) cache->map.emplace(std::move(key), out);
  return out;
}

}  // namespace

Estimate estimate(const Job& job, const Machine& mach, const Layout& l) { return estimate(job, mach, l, nullptr); }

Estimate estimate(const Job& job, const Machine& mach, const Layout& l, ScheduleCache* cache) {
  LATHE_CHECK(job.world >= 1 && job.micro_batch >= 1 && job.seq_len >= 1 && job.global_batch >= 1,
              "internal: plan job world {} micro_batch {} seq_len {} global_batch {}", job.world, job.micro_batch,
              job.seq_len, job.global_batch);
  const ModelConfig& cfg = job.model;
  Estimate e;
  e.layout = l;
  const int64_t t = l.tensor, p = l.pipeline, d = l.data, c = l.context, B = job.micro_batch, T = job.seq_len;
  const int64_t L = cfg.num_hidden_layers, C = cfg.hidden_size;
  LATHE_CHECK(c >= 1 && t * p * d * c == job.world, "internal: layout {} for world {}", l.name(), job.world);
  auto reject = [&](std::string why) {
    e.reject = std::move(why);
    return e;
  };
  if (std::string why = shape_reject(job, l); !why.empty()) return reject(std::move(why));
  const int64_t v = l.virtual_stages, S = p * v;
  if (job.global_batch % (B * d))
    return reject(
        fmt::format("global batch {} is not a multiple of micro_batch_size {} x data {}", job.global_batch, B, d));
  const int64_t m = job.global_batch / (B * d);
  e.micro_batches = m;
  if (m < p)
    return reject(
        fmt::format("{} micro-batches per step (global batch {} / micro_batch_size {} / data {}) is fewer "
                    "than pipeline {}",
                    m, job.global_batch, B, d, p));
  if (v > 1 && m % p)
    return reject(
        fmt::format("interleaved schedule: {} micro-batches per step is not a multiple of pipeline {}", m, p));
  // Layers per virtual stage k (on rank k % p as its chunk k / p).
  e.stage_layers = pipeline::assign_layers(L, p, v, {});

  const std::string what = fmt::format("plan of {} for {}", cfg.model_type, l.name());
  // The simulator's work: p x m x v, or p x (steady_after + p) x v when a long step is extended.
  if (p * std::min(m, steady_after(p, v) + p) * v > job.sim_limit)
    return reject(
        fmt::format("pipeline {} x virtual stages {} is too deep for the schedule simulator ({} x {} "
                    "micro-batches x {} > {} steps)",
                    p, v, p, std::min(m, steady_after(p, v) + p), v, job.sim_limit));
  const pipeline::Spec spec{v > 1 ? pipeline::Kind::Interleaved : pipeline::Kind::OneFOneB, p, m, v};
  const Sched unit = run_schedule(spec, pipeline::Costs{}, job.sim_limit, cache);

  // ---- memory of each rank; the heaviest is the figure ----
  const Params ps = split_params(cfg);
  const int64_t act_size = static_cast<int64_t>(dtype_size(job.compute));
  // Vocab parallel: the head's chunk of logits (the scratch, when it is the largest) holds this
  // rank's V / t columns, as the rank model's arena does (parallel/tensor_parallel.h).
  ModelConfig act_cfg = cfg;
  act_cfg.vocab_size = ceil_div(cfg.vocab_size, t);
  // Context parallelism: each rank's passes hold T / c rows of every sample (its RoPE tables cover
  // the T positions, TensorShard::context_T, as preflight counts them).
  const int64_t Tr = T / c;
  TensorShard act_shard;
  if (c > 1) act_shard.context_T = T;
  const ActivationPlan ap =
      Model::plan_activations(act_cfg, B, Tr, ComputeSpec{nullptr, job.compute}, l.recompute, act_shard);
  std::vector<int64_t> first(static_cast<size_t>(S)), rank_layers(static_cast<size_t>(p), 0);
  for (int64_t k = 0, acc = 0; k < S; acc += e.stage_layers[static_cast<size_t>(k)], ++k) {
    first[static_cast<size_t>(k)] = acc;
    rank_layers[static_cast<size_t>(k % p)] += e.stage_layers[static_cast<size_t>(k)];
  }
  auto rank_of = [&](int64_t layer) {
    return (static_cast<int64_t>(std::upper_bound(first.begin(), first.end(), layer) - first.begin()) - 1) % p;
  };
  // Activations held per rank: a layer's buffers (and a chunk's input) for each (micro-batch, chunk)
  // in flight; with v chunks of equal size a rank holding n of them holds n / v of its layers' sets.
  std::vector<int64_t> layer_acts(static_cast<size_t>(p), 0), input_acts(static_cast<size_t>(p), 0),
      once_acts(static_cast<size_t>(p), 0);
  for (size_t i = 0; i < ap.entries.size(); ++i) {
    const ActivationEntry& a = ap.entries[i];
    // The arena's bytes of this entry, padding included (so t = p = 1 sums to ap.bytes exactly).
    const int64_t padded =
        static_cast<int64_t>((i + 1 < ap.entries.size() ? ap.entries[i + 1].offset : ap.bytes) - a.offset);
    const Split sp = split_of(a.name);
    const int64_t bytes = sp == Split::Wide || (sp == Split::Hidden && l.sequence) ? ceil_div(padded, t) : padded;
    if (a.layer >= 0) {
      const auto ru = static_cast<size_t>(rank_of(a.layer));
      layer_acts[ru] = checked_add(layer_acts[ru], bytes, what);
    } else if (!a.transient) {
      // Kept per (micro-batch, chunk) in flight, as each slot of a stage's arena holds them: the
      // chunk's input (embedding output or received activation), the gradient of the residual
      // stream (the head's output on the last stage, received on the others, then sent back) and
      // the RoPE tables.
      for (int64_t& o : input_acts) o = checked_add(o, bytes, what);
    } else {  // working buffers of one pass at a time, once per stage (Model::allocate shares them
              // between slots): gradients, scratch, the head's buffers, recompute sets
      for (int64_t& o : once_acts) o = checked_add(o, bytes, what);
    }
  }
  // Communication buffers: the pipeline's copies of the messages it sends (an activation down, a
  // gradient up), and the staging of the host reductions (dist/comm.h: what one all-reduce or
  // reduce-scatter of X bytes holds, X itself up to half of kReduceStagingBytes, then that bound):
  // the data-parallel gradient buckets (parallel.bucket_mb, 25 MB by default) and the tensor
  // all-reduces of one activation can run at once (two progress threads); a tied embedding's
  // gradient sum between the first and last stage runs alone, after the schedule.
  const int64_t act_bytes_mb = checked_product({B, Tr, C, act_size}, what);
  auto staging = [](int64_t x) {
    constexpr auto cap = static_cast<int64_t>(dist::Communicator::kReduceStagingBytes);
    return x <= cap / 2 ? x : cap;
  };
  int64_t comm = p > 1 ? 2 * ceil_div(act_bytes_mb, l.sequence ? t : 1) : 0;
  int64_t reductions = t > 1 ? staging(act_bytes_mb) : 0;
  if (p > 1 && cfg.tie_word_embeddings) reductions = std::max(reductions, staging(4 * ceil_div(ps.wte, t)));
  comm = checked_add(comm, reductions, what);
  comm = checked_add(comm, context_buffers(job, l), what);
  const int64_t layer_params = ps.layer_repl + ceil_div(ps.layer - ps.layer_repl, t);
  std::vector<int64_t> rank_params(static_cast<size_t>(p));
  const int64_t moment_shards = l.zero > 0 ? d * c : 1;  // ZeRO shards over data x context
  for (int64_t r = 0; r < p; ++r) {
    const auto ru = static_cast<size_t>(r);
    int64_t n = checked_mul(layer_params, rank_layers[ru], what);
    if (r == 0) n += ceil_div(ps.wte, t) + ps.wpe;
    if (r == p - 1)
      n += ps.final_norm + (cfg.tie_word_embeddings ? (p > 1 ? ceil_div(ps.wte, t) : 0) : ceil_div(ps.head, t));
    rank_params[ru] = n;
    Memory mem;
    mem.stage = r;
    mem.in_flight = unit.in_flight[ru];
    mem.params = checked_mul(n, 4, what);
    mem.grads = mem.params;
    mem.moments = ceil_div(checked_mul(mem.params, job.moments, what), moment_shards);
    if (job.compute != DType::F32) mem.compute_weights = checked_mul(n, act_size, what);
    mem.activations = checked_add(checked_add(ceil_div(checked_mul(layer_acts[ru], mem.in_flight, what), v),
                                              checked_mul(input_acts[ru], mem.in_flight, what), what),
                                  once_acts[ru], what);
    // A gradient bucket is at most the rank's gradient buffer.
    mem.comm = d * c > 1 ? checked_add(comm, staging(std::min(int64_t{25} << 20, mem.grads)), what) : comm;
    if (l.zero == 3) {  // the weights and gradients sharded too, plus the blocks gathered (prefetch 1)
      MemoryEstimate z;
      z.num_params = n;
      z.compute_dtype = job.compute;
      z.compute_weight_bytes = mem.compute_weights;
      shard_parameters(z, cfg, d, 1, 0, (int64_t{25} << 20) / 4);  // the default 25 MB buckets
      mem.params = z.param_bytes;
      // A pipeline stage's gradients accumulate whole over the step's micro-batches and are reduced
      // once after the schedule (parallel/pipeline_executor.h): not sharded during the step.
      if (p == 1) mem.grads = z.grad_bytes;
      mem.compute_weights = z.compute_weight_bytes;
    }
    if (r == 0 || mem.total() > e.memory.total()) e.memory = mem;
  }
  e.fits = mach.memory_bytes <= 0 || e.memory.total() <= mach.memory_bytes;

  // ---- step time ----
  auto bw = [&](int64_t span) { return (span <= mach.gpus_per_node ? mach.intra_gbps : mach.inter_gbps) * 1e9 / 8; };
  const double peak = mach.peak_gflops * 1e9;
  const double tokens_mb = static_cast<double>(B * Tr);  // this rank's rows of a micro-batch
  const double act_bytes = tokens_mb * static_cast<double>(C * act_size);
  const double tp_ar = ring(t, act_bytes, bw(t), true);
  const double per_layer_flops =
      6.0 * static_cast<double>(ps.layer) +
      12.0 * static_cast<double>(cfg.attention_width()) * cfg.attention_keys_over_layers(T) / static_cast<double>(L);
  const double rest_flops = flops_per_token(cfg, T) - static_cast<double>(L) * per_layer_flops;  // head, embedding
  const ContextCost cx =
      context_cost(job, l, per_layer_flops - 6.0 * static_cast<double>(ps.layer), tokens_mb / t / peak, bw(t * c));
  e.cp_bytes_fwd = cx.bytes_fwd;
  e.cp_bytes_bwd = cx.bytes_bwd;
  pipeline::Costs costs;
  std::vector<double> compute_rank(static_cast<size_t>(p), 0), tp_rank(static_cast<size_t>(p), 0),
      cp_rank(static_cast<size_t>(p), 0);
  for (int64_t k = 0; k < S; ++k) {
    const double layers = static_cast<double>(e.stage_layers[static_cast<size_t>(k)]);
    double fwd_flops = layers * per_layer_flops / 3;
    if (k == S - 1) fwd_flops += rest_flops / 3;
    const double fwd = fwd_flops * tokens_mb / static_cast<double>(t) / peak;
    const double recompute = l.recompute == Recompute::Full ? layers * per_layer_flops / 3 * tokens_mb / t / peak : 0;
    double tp_f = 2 * layers * tp_ar, tp_b = (l.recompute == Recompute::Full ? 4 : 2) * layers * tp_ar;
    // Vocab parallel: the embedding's partial lookups are all-reduced (first stage, forward) and so
    // is the head's partial input gradient (last stage, backward); the loss's row statistics are a
    // few doubles per row, left out.
    if (k == 0) tp_f += tp_ar;
    if (k == S - 1) tp_b += tp_ar;
    // The context group's exchange of each layer (again in the backward under full recompute).
    const double cp_f = layers * cx.fwd_s, cp_b = layers * (cx.bwd_s + (l.recompute == Recompute::Full ? cx.fwd_s : 0));
    costs.forward_per_stage.push_back(fwd + tp_f + cp_f);
    costs.backward_per_stage.push_back(2 * fwd + recompute + tp_b + cp_b);
    compute_rank[static_cast<size_t>(k % p)] += static_cast<double>(m) * (3 * fwd + recompute);
    tp_rank[static_cast<size_t>(k % p)] += static_cast<double>(m) * (tp_f + tp_b);
    cp_rank[static_cast<size_t>(k % p)] += static_cast<double>(m) * (cp_f + cp_b);
  }
  costs.p2p = p > 1 ? act_bytes / (l.sequence ? t : 1) / bw(job.world) : 0;
  const Sched sim = run_schedule(spec, costs, job.sim_limit, cache);
  e.compute_s = *std::max_element(compute_rank.begin(), compute_rank.end());
  e.tp_s = *std::max_element(tp_rank.begin(), tp_rank.end());
  e.cp_s = *std::max_element(cp_rank.begin(), cp_rank.end());
  e.pp_s = p > 1 ? 2.0 * static_cast<double>(m * v) * costs.p2p : 0;
  e.pipeline_s = sim.makespan;
  e.bubble = sim.bubble;
  // Gradients of the largest rank (fp32), reduced over the data x context group of t x c x d
  // consecutive ranks.
  const int64_t grad_bytes = 4 * *std::max_element(rank_params.begin(), rank_params.end());
  e.dp_s = ring(d * c, static_cast<double>(grad_bytes), bw(t * c * d), true);
  if (l.zero == 3) e.dp_s *= 1.5;  // reduce-scatter + two all-gathers (forward, backward) vs an all-reduce
  e.step_s = e.pipeline_s + e.dp_s;
  const double tokens = static_cast<double>(job.global_batch) * static_cast<double>(T);
  e.tokens_per_s = e.step_s > 0 ? tokens / e.step_s : 0;
  e.mfu = e.step_s > 0 ? tokens * flops_per_token(cfg, T) / (static_cast<double>(job.world) * peak * e.step_s) : 0;
  return e;
}

std::vector<Estimate> enumerate(const Job& job, const Machine& m) {
  LATHE_CHECK(job.world >= 1 && job.world <= (1 << 20), "--world {} must be in [1, {}]", job.world, 1 << 20);
  std::vector<Estimate> out;
  ScheduleCache cache;
  for (int64_t t = 1; t <= job.world; ++t) {
    if (job.world % t) continue;
    for (int64_t p = 1; p <= job.world / t; ++p) {
      if ((job.world / t) % p) continue;
      for (int64_t c = 1; c <= job.world / t / p; ++c) {
        if ((job.world / t / p) % c) continue;
        const int64_t d = job.world / t / p / c;
        for (bool sp : {false, true}) {
          if (sp && t == 1) continue;
          for (int zero = 0; zero <= 3; ++zero) {
            if (zero > 0 && d * c == 1) continue;
            if (zero == 3 && c > 1) continue;
            for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full})
              for (int64_t v : job.virtual_stages)
                if (v == 1 || p > 1) out.push_back(estimate(job, m, Layout{d, t, p, sp, zero, rc, v, c}, &cache));
          }
        }
      }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const Estimate& a, const Estimate& b) {
    if (a.reject.empty() != b.reject.empty()) return a.reject.empty();
    if (a.fits != b.fits) return a.fits;
    if (a.tokens_per_s != b.tokens_per_s) return a.tokens_per_s > b.tokens_per_s;
    return a.memory.total() < b.memory.total();  // as fast: the one that leaves more memory free
  });
  return out;
}

nlohmann::json to_json(const Estimate& e) {
  nlohmann::json j{{"data", e.layout.data},
                   {"tensor", e.layout.tensor},
                   {"pipeline", e.layout.pipeline},
                   {"context", e.layout.context},
                   {"virtual_stages", e.layout.virtual_stages},
                   {"sequence", e.layout.sequence},
                   {"zero", e.layout.zero},
                   {"recompute", recompute_name(e.layout.recompute)},
                   {"valid", e.reject.empty()}};
  if (!e.reject.empty()) {
    j["reject"] = e.reject;
    return j;
  }
  j["micro_batches"] = e.micro_batches;
  j["stage_layers"] = e.stage_layers;
  j["memory"] = {{"stage", e.memory.stage},
                 {"in_flight", e.memory.in_flight},
                 {"params", e.memory.params},
                 {"grads", e.memory.grads},
                 {"moments", e.memory.moments},
                 {"compute_weights", e.memory.compute_weights},
                 {"activations", e.memory.activations},
                 {"comm", e.memory.comm},
                 {"total", e.memory.total()}};
  j["fits"] = e.fits;
  j["time"] = {{"compute_s", e.compute_s},   {"tp_s", e.tp_s},     {"pp_s", e.pp_s},     {"dp_s", e.dp_s},
               {"pipeline_s", e.pipeline_s}, {"step_s", e.step_s}, {"bubble", e.bubble}, {"cp_s", e.cp_s}};
  if (e.layout.context > 1) j["context_bytes_per_layer"] = {{"forward", e.cp_bytes_fwd}, {"backward", e.cp_bytes_bwd}};
  j["tokens_per_s"] = e.tokens_per_s;
  j["mfu"] = e.mfu;
  return j;
}

double measure_copy_gbps() {
  std::vector<char> a(size_t{64} << 20, 1), b(a.size(), 0);
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    const double t0 = now_seconds();
    std::memcpy(b.data(), a.data(), a.size());
    const double dt = now_seconds() - t0;
    if (rep > 0 && dt > 0) best = std::max(best, static_cast<double>(a.size()) * 8 / dt / 1e9);
    a[static_cast<size_t>(rep)] = b[static_cast<size_t>(rep) + 1];  // keep the copies observable
  }
  return best;
}

}  // namespace lathe::plan
