// Tensor parallelism: configs, shard slicing and the reduction hook (see tensor_parallel.h).
#include "parallel/tensor_parallel.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <memory>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/ops_bf16.h"
#include "optim/chunks.h"
#include "optim/clip.h"

namespace lathe::parallel {

ModelConfig tensor_parallel_config(const ModelConfig& global, int tp) {
  LATHE_CHECK(tp >= 1, "parallel.tensor = {}: must be >= 1", tp);
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
  ModelConfig c = global;
  c.shard_head_dim = global.head_dim();
  c.num_attention_heads = global.num_attention_heads / tp;
  c.num_key_value_heads = global.num_key_value_heads / tp;
  c.intermediate_size = global.intermediate_size / tp;
  return c;
}

std::vector<SliceRun> shard_runs(const ParamSpec& g, const ParamSpec& l, int rank, int tp) {
  LATHE_CHECK(g.name == l.name, "internal: shard of '{}' taken from '{}'", l.name, g.name);
  auto bad_shape = [&]() {
    throw_error("tensor parallel: '{}' has shape [{}] on rank {} of {}, which is not a {} shard of [{}]", l.name,
                fmt::join(l.shape, ", "), rank, tp,
                g.shard == ShardRule::Row ? "column" : (g.shard == ShardRule::Column ? "row" : "whole"),
                fmt::join(g.shape, ", "));
  };
  std::vector<SliceRun> runs;
  const bool whole = tp == 1 || g.shard == ShardRule::Replicated || g.shard == ShardRule::Vocab;
  if (whole) {
    if (l.shape != g.shape) bad_shape();
    runs.push_back({0, 0, g.numel()});
    return runs;
  }
  if (g.shape.empty() || l.shape.size() != g.shape.size()) bad_shape();
  const int64_t inner = g.numel() / std::max<int64_t>(g.shape[0], 1);  // elements per row of dim 0
  if (g.shard == ShardRule::Column) {
    // dim 0 = S sections of s rows; rank r holds rows [k*s + r*s/tp, k*s + (r+1)*s/tp) of each.
    const int64_t S = g.sections, rows = g.shape[0];
    LATHE_CHECK(S >= 1 && rows % S == 0, "internal: '{}' has {} rows in {} sections", g.name, rows, S);
    const int64_t s = rows / S;
    LATHE_CHECK(s % tp == 0, "tensor parallel: '{}' has sections of {} rows, which {} ranks cannot split evenly",
                g.name, s, tp);
    const int64_t part = s / tp;
    Shape want = g.shape;
    want[0] = part * S;
    if (l.shape != want) bad_shape();
    for (int64_t k = 0; k < S; ++k) runs.push_back({(k * s + rank * part) * inner, k * part * inner, part * inner});
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

void gather_global(dist::Communicator& tp_group, const ParamTable& global, const ParamTable& local, const float* l,
                   float* g) {
  const int tp = tp_group.size();
  const size_t n = local.total();
  std::vector<float> all(n * static_cast<size_t>(tp));
  tp_group.all_gather(l, all.data(), std::vector<size_t>(static_cast<size_t>(tp), n), DType::F32);
  for (int r = 0; r < tp; ++r) place_shard(global, g, local, all.data() + n * static_cast<size_t>(r), r, tp);
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

void attach_tensor_parallel(Model& m, dist::Communicator& tp_group) {
  if (tp_group.size() == 1) return;
  dist::Communicator* group = &tp_group;
  const DType dt = m.compute_dtype();
  if (dt == DType::F32) {
    m.hooks().reduce_partial = [group](void* buf, int64_t count) {
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
  m.hooks().reduce_partial = [group, staging, dt](void* buf, int64_t count) {
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
  std::vector<std::pair<size_t, size_t>> out;
  for (const ParamSpec& s : local.specs()) {
    const bool sharded = s.shard == ShardRule::Column || s.shard == ShardRule::Row;
    if (!sharded && rank != 0) continue;
    const size_t b = s.offset, e = s.offset + static_cast<size_t>(s.numel());
    if (!out.empty() && out.back().second == b)
      out.back().second = e;
    else
      out.push_back({b, e});
  }
  return out;
}

double tensor_parallel_grad_norm(dist::Communicator& tp_group, const float* grads,
                                 const std::vector<std::pair<size_t, size_t>>& owned) {
  double sum = 0;
  std::vector<double> chunks;
  for (const auto& [b, e] : owned) {
    chunks.assign((e - b + optim::kChunk - 1) / optim::kChunk, 0.0);
    optim::grad_sq_chunk_sums(grads + b, e - b, chunks.data());
    for (double c : chunks) sum += c;
  }
  tp_group.all_reduce(&sum, 1, DType::F64);
  return std::sqrt(sum);
}

}  // namespace lathe::parallel
