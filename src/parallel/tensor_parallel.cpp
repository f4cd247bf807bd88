// Tensor parallelism: configs, shard slicing and the reduction hook (see tensor_parallel.h).
#include "parallel/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/ops_bf16.h"
#include "optim/chunks.h"
#include "optim/clip.h"

namespace lathe::parallel {

VocabShard vocab_shard(int64_t V, int tp, int rank) {
  LATHE_CHECK(tp >= 1 && rank >= 0 && rank < tp && V >= 0, "internal: vocabulary shard of rank {} of {} over {} rows",
              rank, tp, V);
  const int64_t q = V / tp, e = V % tp, r = rank;
  return {r * q + std::min(r, e), q + (r < e ? 1 : 0)};
}

ModelConfig shard_config(const ModelConfig& global, int tp, int rank) {
  LATHE_CHECK(tp >= 1, "parallel.tensor = {}: must be >= 1", tp);
  LATHE_CHECK(rank >= 0 && rank < tp, "internal: tensor-parallel rank {} of {}", rank, tp);
  if (tp == 1) return global;
  auto divides = [&](int64_t n, const char* key) {
    LATHE_CHECK(n % tp == 0,
                "parallel.tensor = {} does not divide model.{} = {}: each tensor-parallel rank takes an equal share; "
                "choose a tensor-parallel degree that divides {}",
                tp, key, n, n);
  };
  divides(global.num_attention_heads, "num_attention_heads");
  divides(global.num_key_value_heads, "num_key_value_heads");
  divides(global.intermediate_size, "intermediate_size");
  // Uneven shards are fine (vocab_shard); an empty one is not (a rank without vocabulary rows).
  LATHE_CHECK(global.vocab_size >= tp,
              "parallel.tensor = {} is more than model.vocab_size = {}: the embedding and the lm head are split by "
              "vocabulary rows across the tensor-parallel ranks, at least one row each; choose a degree of at most {}",
              tp, global.vocab_size, global.vocab_size);
  ModelConfig c = global;
  c.explicit_head_dim = global.head_dim();  // heads / tp of the whole model's width
  c.num_attention_heads = global.num_attention_heads / tp;
  c.num_key_value_heads = global.num_key_value_heads / tp;
  c.intermediate_size = global.intermediate_size / tp;
  c.vocab_size = vocab_shard(global.vocab_size, tp, rank).rows;
  return c;
}

TensorShard tensor_shard(const ModelConfig& global, int tp, bool sequence) {
  LATHE_CHECK(tp >= 1, "parallel.tensor = {}: must be >= 1", tp);
  LATHE_CHECK(!sequence || tp > 1,
              "parallel.sequence = true needs parallel.tensor > 1 (it shards the sequence over the tensor-parallel "
              "ranks); set parallel.tensor or parallel.sequence: false");
  if (tp == 1) return {};
  return TensorShard{global.vocab_size, tp, sequence};
}

std::unique_ptr<Model> build_shard_model(const ModelConfig& global, int tp, bool sequence, int rank,
                                         const ComputeSpec& compute) {
  const TensorShard shard = tensor_shard(global, tp, sequence);
  std::unique_ptr<Model> m = build_model(shard_config(global, tp, rank), compute);
  m->set_tensor_shard(shard);
  return m;
}

std::vector<SliceRun> shard_runs(const ParamSpec& g, const ParamSpec& l, int rank, int tp) {
  LATHE_CHECK(g.name == l.name, "internal: shard of '{}' taken from '{}'", l.name, g.name);
  auto bad_shape = [&]() {
    throw_error("tensor parallel: '{}' has shape [{}] on rank {} of {}, which is not a {} shard of [{}]", l.name,
                fmt::join(l.shape, ", "), rank, tp,
                g.shard == ShardRule::Row      ? "column"
                : g.shard == ShardRule::Column ? "row"
                : g.shard == ShardRule::Vocab  ? "vocabulary-row"
                                               : "whole",
                fmt::join(g.shape, ", "));
  };
  std::vector<SliceRun> runs;
  const bool whole = tp == 1 || g.shard == ShardRule::Replicated;
  if (whole) {
    if (l.shape != g.shape) bad_shape();
    runs.push_back({0, 0, g.numel()});
    return runs;
  }
  if (g.shape.empty() || l.shape.size() != g.shape.size()) bad_shape();
  const int64_t inner = g.numel() / std::max<int64_t>(g.shape[0], 1);  // elements per row of dim 0
  if (g.shard == ShardRule::Vocab) {
    // [V, C]: rank r holds rows vocab_shard(V, tp, r), one contiguous run.
    const int64_t V = g.shape[0];
    LATHE_CHECK(V >= tp, "tensor parallel: '{}' has {} vocabulary rows, fewer than the {} ranks that split it", g.name,
                V, tp);
    const VocabShard vs = vocab_shard(V, tp, rank);
    Shape want = g.shape;
    want[0] = vs.rows;
    if (l.shape != want) bad_shape();
    runs.push_back({vs.begin * inner, 0, vs.rows * inner});
    return runs;
  }
  if (g.shard == ShardRule::Column) {
    // dim 0 = S sections of s_k rows (equal, or ParamSpec::section_units); rank r holds rows
    // [r*s_k/tp, (r+1)*s_k/tp) of each section, the sections' parts one after the other.
    const int64_t S = g.sections, rows = g.shape[0];
    std::vector<int64_t> units = g.section_units;
    if (units.empty()) units.assign(static_cast<size_t>(S), 1);
    int64_t total_units = 0;
    for (int64_t u : units) total_units += u;
    LATHE_CHECK(S >= 1 && static_cast<int64_t>(units.size()) == S && total_units > 0 && rows % total_units == 0,
                "internal: '{}' has {} rows in {} sections", g.name, rows, S);
    int64_t global_row = 0, local_row = 0;
    for (int64_t u : units) {
      const int64_t s = u * (rows / total_units);
      LATHE_CHECK(s % tp == 0, "tensor parallel: '{}' has a section of {} rows, which {} ranks cannot split evenly",
                  g.name, s, tp);
      const int64_t part = s / tp;
      runs.push_back({(global_row + rank * part) * inner, local_row * inner, part * inner});
      global_row += s;
      local_row += part;
    }
    Shape want = g.shape;
    want[0] = local_row;
    if (l.shape != want) bad_shape();
    return runs;
  }
  // Row: a [O, I] weight split along I (dim 1).
  if (g.shape.size() != 2) bad_shape();
  const int64_t O = g.shape[0], I = g.shape[1];
  LATHE_CHECK(I % tp == 0, "tensor parallel: '{}' has {} input features, which {} ranks cannot split evenly", g.name, I,
              tp);
  const int64_t part = I / tp;
  if (l.shape != Shape{O, part}) bad_shape();
  for (int64_t o = 0; o < O; ++o) runs.push_back({o * I + rank * part, o * part, part});
  return runs;
}

namespace {
template <class Fn>
void for_each_shard(const ParamTable& global, const ParamTable& local, int rank, int tp, Fn fn) {
  for (const ParamSpec& l : local.specs()) {
    const ParamSpec* g = global.find(l.name);
    LATHE_CHECK(g != nullptr, "tensor parallel: the rank's model has '{}', which the global model has not", l.name);
    for (const SliceRun& r : shard_runs(*g, l, rank, tp)) fn(*g, l, r);
  }
}
}  // namespace

void scatter_shard(const ParamTable& global, const float* gbuf, const ParamTable& local, float* lbuf, int rank,
                   int tp) {
  for_each_shard(global, local, rank, tp, [&](const ParamSpec& g, const ParamSpec& l, const SliceRun& r) {
    std::memcpy(lbuf + l.offset + r.local, gbuf + g.offset + r.global, static_cast<size_t>(r.count) * sizeof(float));
  });
}

void place_shard(const ParamTable& global, float* gbuf, const ParamTable& local, const float* lbuf, int rank, int tp) {
  for_each_shard(global, local, rank, tp, [&](const ParamSpec& g, const ParamSpec& l, const SliceRun& r) {
    std::memcpy(gbuf + g.offset + r.global, lbuf + l.offset + r.local, static_cast<size_t>(r.count) * sizeof(float));
  });
}

namespace {
// Rank `rank`'s table, from this rank's `local`: the same tensors in the same order, the vocabulary
// tensors with that rank's rows (the only tensors whose shapes differ between ranks).
ParamTable rank_table(const ParamTable& global, const ParamTable& local, int rank, int tp) {
  ParamTable t;
  for (const ParamSpec& l : local.specs()) {
    const ParamSpec* g = global.find(l.name);
    LATHE_CHECK(g != nullptr, "tensor parallel: the rank's model has '{}', which the global model has not", l.name);
    Shape shape = l.shape;
    if (tp > 1 && g->shard == ShardRule::Vocab && !shape.empty() && !g->shape.empty())
      shape[0] = vocab_shard(g->shape[0], tp, rank).rows;
    ParamSpec& s = t.add(l.name, shape, l.init, l.init_std, l.shard, l.decay, l.hf_transposed);
    s.role = l.role;
    s.layer = l.layer;
    s.sections = l.sections;
    s.section_units = l.section_units;
  }
  return t;
}
}  // namespace

void gather_global(dist::Communicator& tp_group, const ParamTable& global, const ParamTable& local, const float* l,
                   float* g) {
  const int tp = tp_group.size();
  std::vector<ParamTable> tables;
  std::vector<size_t> counts, displ;
  size_t n = 0;
  for (int r = 0; r < tp; ++r) {
    tables.push_back(rank_table(global, local, r, tp));
    counts.push_back(tables.back().total());
    displ.push_back(n);
    n += counts.back();
  }
  LATHE_CHECK(counts[static_cast<size_t>(tp_group.rank())] == local.total(),
              "internal: tensor-parallel rank {} holds {} parameters, its shard rule says {}", tp_group.rank(),
              local.total(), counts[static_cast<size_t>(tp_group.rank())]);
  std::vector<float> all(n);
  tp_group.all_gather(l, all.data(), counts, DType::F32);
  for (int r = 0; r < tp; ++r)
    place_shard(global, g, tables[static_cast<size_t>(r)], all.data() + displ[static_cast<size_t>(r)], r, tp);
}

void init_shard(Model& m, const ParamTable& global, int rank, int tp, uint64_t seed) {
  std::vector<float> values;  // the current tensor's global values, drawn once per tensor
  const ParamSpec* drawn = nullptr;
  for_each_shard(global, m.params(), rank, tp, [&](const ParamSpec& g, const ParamSpec& l, const SliceRun& r) {
    if (drawn != &g) {
      values.resize(static_cast<size_t>(g.numel()));
      init_param_values(g, seed, values.data());
      drawn = &g;
    }
    std::memcpy(m.param_data() + l.offset + r.local, values.data() + r.global,
                static_cast<size_t>(r.count) * sizeof(float));
  });
  m.refresh_compute_weights();
}

namespace {
// StepHooks::tp.vocab's reduction: the per-row statistics of the vocab-parallel loss (max, then sums).
void vocab_all_reduce(void* ctx, double* buf, int64_t count, bool max) {
  static_cast<dist::Communicator*>(ctx)->all_reduce(buf, static_cast<size_t>(count), DType::F64,
                                                    max ? dist::ReduceOp::Max : dist::ReduceOp::Sum);
}

// The vocab-parallel embedding and head: this rank's rows of the vocabulary, the loss statistics'
// reduction and the gathering of logits (evaluation: gather_from_tensor_region).
void attach_vocab_parallel(Model& m, dist::Communicator& tp_group) {
  const ModelConfig& cfg = m.config();
  const int tp = tp_group.size();
  const int64_t V = m.global_vocab();
  LATHE_CHECK(V >= tp, "tensor parallel: a vocabulary of {} rows cannot be split over {} ranks", V, tp);
  const VocabShard mine = vocab_shard(V, tp, tp_group.rank());
  LATHE_CHECK(cfg.vocab_size == mine.rows,
              "tensor parallel: rank {}'s model holds {} vocabulary rows, not its {} of {}; build it from "
              "shard_config with its rank",
              tp_group.rank(), cfg.vocab_size, mine.rows, V);
  VocabParallel& vp = m.hooks().tp.vocab;
  vp.vocab_begin = mine.begin;
  vp.global_V = V;
  vp.all_reduce = vocab_all_reduce;
  vp.ctx = &tp_group;
  dist::Communicator* group = &tp_group;
  // [M, V_r] on rank r -> all-gather (rank r's block of M * V_r after the lower ranks') -> [M, V]
  // (rank r's columns at vocab_shard(V, tp, r).begin).
  m.hooks().tp.comm.gather_vocab = [group, V](const float* local, float* whole, int64_t M, int64_t Vl) {
    const int n = group->size();
    LATHE_CHECK(Vl == vocab_shard(V, n, group->rank()).rows, "internal: gather_vocab of {} columns on rank {}", Vl,
                group->rank());
    std::vector<size_t> counts;
    size_t total = 0;
    for (int r = 0; r < n; ++r) {
      counts.push_back(static_cast<size_t>(M * vocab_shard(V, n, r).rows));
      total += counts.back();
    }
    std::vector<float> all(total);
    group->all_gather(local, all.data(), counts, DType::F32);
    const float* block = all.data();
    for (int r = 0; r < n; ++r) {
      const VocabShard s = vocab_shard(V, n, r);
      for (int64_t i = 0; i < M; ++i)
        std::memcpy(whole + i * V + s.begin, block + i * s.rows, static_cast<size_t>(s.rows) * sizeof(float));
      block += counts[static_cast<size_t>(r)];
    }
  };
}

// The sequence-parallel row collectives (models/tp_mappings.h's TpCollectives: the sequence pairs'
// halves and the norm-gradient reduction): counts are per rank, in compute-dtype elements.
void attach_sequence_parallel(Model& m, dist::Communicator* group) {
  const DType dt = m.compute_dtype();
  const size_t es = dtype_size(dt);
  const int tp = group->size(), rank = group->rank();
  auto counts = [tp](int64_t n) { return std::vector<size_t>(static_cast<size_t>(tp), static_cast<size_t>(n)); };
  TpCollectives& h = m.hooks().tp.comm;
  // An all-gather moves bytes: the same for every dtype. send aliases nothing of recv here.
  h.all_gather_rows = [group, dt, counts](const void* shard, void* full, int64_t n) {
    group->all_gather(shard, full, counts(n), dt);
  };
  h.split_rows = [rank, es](const void* full, void* shard, int64_t n) {
    const auto* src = static_cast<const std::byte*>(full) + static_cast<size_t>(rank) * static_cast<size_t>(n) * es;
    if (src != shard) std::memmove(shard, src, static_cast<size_t>(n) * es);
  };
  h.all_reduce_f32 = [group](float* g, int64_t n) { group->all_reduce(g, static_cast<size_t>(n), DType::F32); };
  if (dt == DType::F32) {
    h.reduce_scatter_rows = [group, counts](void* full, void* shard, int64_t n) {
      group->reduce_scatter(full, shard, counts(n), DType::F32);
    };
    return;
  }
  // 16-bit: widened, summed in fp32 in rank order and rounded once, as all_reduce does, so each
  // row equals the all-reduce's. [tp*S, C] fp32 staging per call.
  auto staging = std::make_shared<std::vector<float>>();
  h.reduce_scatter_rows = [group, staging, dt, tp, counts](void* full, void* shard, int64_t n) {
    const int64_t total = n * tp;
    staging->resize(static_cast<size_t>(total));
    float* f = staging->data();
    const auto* src = static_cast<const uint16_t*>(full);
    if (dt == DType::BF16) {
      cpu::convert_bf16_to_fp32(f, src, total);
    } else {
      for (int64_t i = 0; i < total; ++i) f[i] = fp16_to_fp32(src[i]);
    }
    group->reduce_scatter(f, f, counts(n), DType::F32);  // this rank's sums into f[0, n)
    auto* dst = static_cast<uint16_t*>(shard);
    if (dt == DType::BF16) {
      cpu::convert_fp32_to_bf16(dst, f, n);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(f[i]);
    }
  };
}
}  // namespace

void attach_tensor_parallel(Model& m, dist::Communicator& tp_group) {
  if (tp_group.size() == 1) return;
  LATHE_CHECK(m.tensor_shard().parts == tp_group.size(),
              "tensor parallel: the model is a shard of {} rank(s) but the group has {}; build each rank's model "
              "with parallel::build_shard_model",
              m.tensor_shard().parts, tp_group.size());
  attach_vocab_parallel(m, tp_group);
  dist::Communicator* group = &tp_group;
  const DType dt = m.compute_dtype();
  if (m.tensor_shard().sequence_parallel) {
    LATHE_CHECK(dt == DType::F32 || dt == DType::BF16 || dt == DType::F16,
                "sequence parallel: no reduction for compute dtype {}", compute_dtype_name(dt));
    attach_sequence_parallel(m, group);
  }
  // fp32 gradient sums of replicated weights whose gradients are partial per rank: the sequence-
  // parallel norms' (above) and the q/k norms' (Arch::qk_norm: each rank normalises its own heads).
  // Alone it does not turn sequence parallelism on (TpMappings::sequence_parallel needs all four).
  m.hooks().tp.comm.all_reduce_f32 = [group](float* g, int64_t n) {
    group->all_reduce(g, static_cast<size_t>(n), DType::F32);
  };
  if (dt == DType::F32) {
    m.hooks().tp.comm.all_reduce = [group](void* buf, int64_t count) {
      group->all_reduce(buf, static_cast<size_t>(count), DType::F32);
    };
    return;
  }
  LATHE_CHECK(dt == DType::BF16 || dt == DType::F16, "tensor parallel: no reduction for compute dtype {}",
              compute_dtype_name(dt));
  // 16-bit activations: each rank's partial product (already rounded to 16 bits by its GEMM) is
  // widened, the sum taken in fp32 in rank order, and rounded once, so a row-parallel output carries
  // tp + 1 roundings where one process has one. [N, C] fp32 staging per call.
  auto staging = std::make_shared<std::vector<float>>();
  m.hooks().tp.comm.all_reduce = [group, staging, dt](void* buf, int64_t count) {
    staging->resize(static_cast<size_t>(count));
    auto* h = static_cast<uint16_t*>(buf);
    float* f = staging->data();
    if (dt == DType::BF16) {
      cpu::convert_bf16_to_fp32(f, h, count);
    } else {
      for (int64_t i = 0; i < count; ++i) f[i] = fp16_to_fp32(h[i]);
    }
    group->all_reduce(f, static_cast<size_t>(count), DType::F32);
    if (dt == DType::BF16) {
      cpu::convert_fp32_to_bf16(h, f, count);
    } else {
      for (int64_t i = 0; i < count; ++i) h[i] = fp32_to_fp16(f[i]);
    }
  };
}

std::vector<std::pair<size_t, size_t>> owned_ranges(const ParamTable& local, int rank) {
  return local.ranges([&](const ParamSpec& s) {
    return rank == 0 || s.shard == ShardRule::Column || s.shard == ShardRule::Row || s.shard == ShardRule::Vocab;
  });
}

}  // namespace lathe::parallel
