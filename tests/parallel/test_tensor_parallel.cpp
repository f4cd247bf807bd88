// Tensor parallelism against the single-process model (the oracle): the same global weights,
// scattered to tp ranks on the in-process thread communicator, must give the same loss and, once
// the ranks' shards are gathered back, the same gradients, for GPT-2 (fused c_attn in sections),
// Llama with GQA (KV heads split), Qwen2 (q/k/v biases, tied) and an untied Llama with o_proj bias
// (a row-parallel bias, added once after the reduction). Tolerance 1e-5 relative: the row-parallel
// GEMMs sum their K dimension in tp pieces instead of one, so results differ by rounding only.
// wte / lm_head are split by vocabulary rows (vocab-parallel embedding and loss: the embedding's
// partial lookups and the loss's row max / exp sum / target logit are reduced across the ranks);
// the kernels of every CPU table and the gathered logits are checked on their own below. A
// vocabulary the degree does not divide is split in uneven shards (vocab_shard): GPT-2's 50257 rows
// at tp=2, 97 rows at tp=3, odd vocabularies of Llama (GQA) and the tied Qwen2 at tp=2, held to the
// same tolerances, with checkpoint-side tensors (gather_global) of exactly V rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "dist/comm.h"
#include "kernels/backend.h"
#include "models/model.h"
#include "models/tp_mappings.h"
#include "parallel/tensor_parallel.h"
#include "tp_fixtures.h"

using namespace lathe;
using namespace lathe::parallel;
using namespace lathe::tp_test;

namespace {

// tp_fixtures.h's four layouts, then vocabularies the degree does not divide.
std::vector<Family> families() {
  // Vocabularies the degree does not divide (uneven vocabulary shards).
  ModelConfig gpt2_v = ModelConfig::preset("gpt2-debug");
  gpt2_v.vocab_size = 50257;  // GPT-2's own vocabulary: 25129 + 25128 rows at tp=2
  ModelConfig gpt2_h6 = ModelConfig::preset("gpt2-debug");
  gpt2_h6.num_attention_heads = gpt2_h6.num_key_value_heads = 6;  // head_dim 8, MLP 192: tp=3 divides them
  gpt2_h6.vocab_size = 97;                                        // 33 + 32 + 32 rows at tp=3, 49 + 48 at tp=2
  ModelConfig llama_v = ModelConfig::preset("llama-debug");
  llama_v.vocab_size = 101;
  ModelConfig qwen2_v = ModelConfig::preset("qwen2-debug");  // tied: wte is also the head
  qwen2_v.vocab_size = 101;
  std::vector<Family> f = base_families();
  f.insert(f.end(), {{"gpt2_v50257", gpt2_v, {2}},
                     {"gpt2_h6_v97", gpt2_h6, {2, 3}},
                     {"llama_gqa_v101", llama_v, {2}},
                     {"qwen2_tied_v101", qwen2_v, {2}},
                     // fused qkv_proj with unequal q and k/v sections (4 query heads, 2 KV heads)
                     {"phi3_gqa", ModelConfig::preset("phi3-debug"), {2}}});
  return f;
}

constexpr int64_t kB = 2, kT = 13;
constexpr int kSteps = 5;
constexpr float kLr = 0.05f;

Batch batch(const ModelConfig& cfg, int step) { return random_batch(cfg, step, kB, kT); }

// kSteps of plain SGD; returns the loss of every step and the gradients of the last one.
struct Trace {
  std::vector<double> losses;
  std::vector<float> last_grads;
};
Trace run_single(const ModelConfig& cfg) {
  auto m = build_model(cfg);
  perturbed_init(*m);
  m->allocate(kB, kT);
  Trace t;
  for (int s = 0; s < kSteps; ++s) t.losses.push_back(sgd_step(*m, batch(cfg, s), kB, kT, kLr));
  t.last_grads.assign(m->grad_data(), m->grad_data() + m->num_params());
  return t;
}

}  // namespace

TEST(TensorParallel, MatchesOneProcess) {
  for (const Family& f : families()) {
    const Trace ref = run_single(f.cfg);
    auto global = build_model(f.cfg);
    perturbed_init(*global);
    const ParamTable& gt = global->params();
    for (int tp : f.degrees) {
      SCOPED_TRACE(fmt::format("{} tp={}", f.name, tp));
      std::mutex mu;
      std::vector<std::vector<double>> losses(static_cast<size_t>(tp));
      std::vector<float> gathered(gt.total());
      std::vector<std::vector<float>> replicated_grads(static_cast<size_t>(tp));
      dist::run_threads(tp, [&](dist::Communicator& comm) {
        const int r = comm.rank();
        auto m = attached_shard(*global, comm, r, tp);
        m->allocate(kB, kT);
        for (int s = 0; s < kSteps; ++s)
          losses[static_cast<size_t>(r)].push_back(sgd_step(*m, batch(f.cfg, s), kB, kT, kLr));
        std::vector<float> g(gt.total());
        gather_global(comm, gt, m->params(), m->grad_data(), g.data());
        std::vector<float> rep;
        for (const ParamSpec& s : m->params().specs())
          if (s.shard == ShardRule::Replicated)
            rep.insert(rep.end(), m->grad_data() + s.offset, m->grad_data() + s.offset + s.numel());
        std::lock_guard<std::mutex> lock(mu);
        replicated_grads[static_cast<size_t>(r)] = std::move(rep);
        if (r == 0) gathered = std::move(g);
      });
      for (int s = 0; s < kSteps; ++s) {
        for (int r = 0; r < tp; ++r)  // every rank computes the whole loss, bit for bit the same
          EXPECT_EQ(losses[static_cast<size_t>(r)][static_cast<size_t>(s)], losses[0][static_cast<size_t>(s)]);
        EXPECT_NEAR(losses[0][static_cast<size_t>(s)], ref.losses[static_cast<size_t>(s)],
                    1e-5 * std::abs(ref.losses[static_cast<size_t>(s)]))
            << "step " << s;
      }
      for (int r = 1; r < tp; ++r)  // replicated tensors stay identical without any reduction
        EXPECT_EQ(replicated_grads[static_cast<size_t>(r)], replicated_grads[0]);
      for (const ParamSpec& s : gt.specs()) {
        const double e = rel_err(gathered.data() + s.offset, ref.last_grads.data() + s.offset, s.numel());
        EXPECT_LT(e, 1e-5) << s.name;
      }
    }
  }
}

TEST(TensorParallel, InitShardIsTheSliceOfTheGlobalInit) {
  for (const Family& f : families()) {
    auto global = build_model(f.cfg);
    global->init_weights(1234);
    for (int tp : f.degrees)
      for (int r = 0; r < tp; ++r) {
        auto a = build_model(shard_config(f.cfg, tp, r));
        auto b = build_model(shard_config(f.cfg, tp, r));
        init_shard(*a, global->params(), r, tp, 1234);
        scatter_shard(global->params(), global->param_data(), b->params(), b->param_data(), r, tp);
        EXPECT_EQ(0, std::memcmp(a->param_data(), b->param_data(), a->num_params() * sizeof(float)))
            << f.name << " tp=" << tp << " rank " << r;
      }
  }
}

TEST(TensorParallel, FusedQkvSectionsGiveEachRankItsHeads) {
  // GPT-2's c_attn [3*C, C]: rank r's rows are its heads of q, then of k, then of v.
  const ModelConfig cfg = ModelConfig::preset("gpt2-debug");  // C = 48, 4 heads of 12
  auto global = build_model(cfg);
  auto local = build_model(shard_config(cfg, 2));
  const ParamSpec& g = global->params().at("transformer.h.0.attn.c_attn.weight");
  const ParamSpec& l = local->params().at("transformer.h.0.attn.c_attn.weight");
  const auto runs = shard_runs(g, l, 1, 2);
  ASSERT_EQ(runs.size(), 3u);
  const int64_t C = 48;
  for (int64_t k = 0; k < 3; ++k) {
    EXPECT_EQ(runs[static_cast<size_t>(k)].global, (k * C + C / 2) * C);  // second half of section k
    EXPECT_EQ(runs[static_cast<size_t>(k)].local, k * (C / 2) * C);
    EXPECT_EQ(runs[static_cast<size_t>(k)].count, (C / 2) * C);
  }
}

// The vocab-parallel lm_head_loss of every CPU table (fp32, bf16, fp16) against the same table's
// whole-vocabulary call: w [V, C] split by rows over tp thread ranks, the row statistics
// all-reduced through VocabParallel's callback. Losses (the same on every rank) within 1e-6
// relative: the logits are the same dot products, only the exp sum is added in another order. The
// gathered dw and the summed partial dx within 1e-5 (fp32; 16-bit tables: 2e-2, the dlogits and dx
// partials are rounded to 16 bits before the sum, one more rounding than the whole call's). A
// missing shard, a wrong offset or an unreduced max would be off by O(1).
TEST(TensorParallel, VocabParallelLossMatchesWholeVocabularyInEveryTable) {
  constexpr int64_t N = 37, C = 24, V = 96, chunk = 16;
  Rng rng(11);
  std::vector<float> x(N * C), w(V * C);
  for (float& v : x) v = rng.normal();
  for (float& v : w) v = 0.5f * rng.normal();
  std::vector<int32_t> tg(N);
  for (auto& t : tg) t = static_cast<int32_t>(rng.next_u64() % V);
  tg[5] = -1;  // ignored
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const Ops* ops = find_ops(cpu_backend(), dt);
    ASSERT_NE(ops, nullptr);
    const size_t es = dtype_size(dt);
    // The table's element type: fp32 as is, 16-bit rounded copies otherwise.
    auto to_dt = [&](const std::vector<float>& v) {
      std::vector<uint16_t> out(v.size() * es / 2);
      if (dt == DType::F32)
        std::memcpy(out.data(), v.data(), v.size() * 4);
      else
        for (size_t i = 0; i < v.size(); ++i) out[i] = dt == DType::BF16 ? fp32_to_bf16(v[i]) : fp32_to_fp16(v[i]);
      return out;
    };
    auto from_dt = [&](const std::vector<uint16_t>& v, size_t n) {
      std::vector<float> out(n);
      if (dt == DType::F32)
        std::memcpy(out.data(), v.data(), n * 4);
      else
        for (size_t i = 0; i < n; ++i) out[i] = dt == DType::BF16 ? bf16_to_fp32(v[i]) : fp16_to_fp32(v[i]);
      return out;
    };
    const std::vector<uint16_t> xd = to_dt(x), wd = to_dt(w);
    std::vector<float> losses(N), dw(V * C, 0.0f);
    std::vector<uint16_t> dx(N * C * es / 2);
    std::vector<std::byte> scratch(ops->lm_head_loss_scratch_bytes(chunk, V));
    const double total = ops->lm_head_loss(losses.data(), dx.data(), dw.data(), xd.data(), wd.data(), tg.data(), N, C,
                                           V, 0.1f, true, scratch.data(), chunk, nullptr, 0.0f);
    const std::vector<float> dxf = from_dt(dx, N * C);
    const double tol = dt == DType::F32 ? 1e-5 : 2e-2;
    for (int tp : {2, 3, 5}) {  // 5 does not divide 96: shards of 20, 19, 19, 19, 19 rows
      SCOPED_TRACE(fmt::format("{} tp={}", compute_dtype_name(dt), tp));
      std::mutex mu;
      std::vector<float> dw_all(V * C), dx_sum(N * C, 0.0f);
      std::vector<std::vector<float>> rank_losses(static_cast<size_t>(tp));
      std::vector<double> totals(static_cast<size_t>(tp));
      dist::run_threads(tp, [&](dist::Communicator& comm) {
        const int r = comm.rank();
        const VocabShard vs = vocab_shard(V, tp, r);
        const int64_t Vl = vs.rows;
        VocabParallel vp;
        vp.vocab_begin = vs.begin;
        vp.global_V = V;
        vp.ctx = &comm;
        vp.all_reduce = [](void* ctx, double* buf, int64_t count, bool max) {
          static_cast<dist::Communicator*>(ctx)->all_reduce(buf, static_cast<size_t>(count), DType::F64,
                                                            max ? dist::ReduceOp::Max : dist::ReduceOp::Sum);
        };
        std::vector<uint16_t> wl(wd.begin() + static_cast<std::ptrdiff_t>(vs.begin * C * es / 2),
                                 wd.begin() + static_cast<std::ptrdiff_t>((vs.begin + Vl) * C * es / 2));
        std::vector<float> l(N), dwl(Vl * C, 0.0f);
        std::vector<uint16_t> dxl(N * C * es / 2);
        std::vector<std::byte> sc(ops->lm_head_loss_scratch_bytes(chunk, Vl));
        const double t = ops->lm_head_loss(l.data(), dxl.data(), dwl.data(), xd.data(), wl.data(), tg.data(), N, C, Vl,
                                           0.1f, true, sc.data(), chunk, &vp, 0.0f);
        const std::vector<float> dxp = from_dt(dxl, N * C);
        std::lock_guard<std::mutex> lock(mu);
        totals[static_cast<size_t>(r)] = t;
        rank_losses[static_cast<size_t>(r)] = l;
        std::copy(dwl.begin(), dwl.end(), dw_all.begin() + vs.begin * C);
        for (int64_t i = 0; i < N * C; ++i) dx_sum[static_cast<size_t>(i)] += dxp[static_cast<size_t>(i)];
      });
      for (int r = 0; r < tp; ++r) {
        EXPECT_EQ(totals[static_cast<size_t>(r)], totals[0]);
        EXPECT_EQ(rank_losses[static_cast<size_t>(r)], rank_losses[0]);
      }
      EXPECT_NEAR(totals[0], total, 1e-6 * std::abs(total));
      EXPECT_LT(rel_err(rank_losses[0].data(), losses.data(), N), 1e-6);
      EXPECT_EQ(rank_losses[0][5], 0.0f);
      EXPECT_LT(rel_err(dw_all.data(), dw.data(), V * C), tol);
      EXPECT_LT(rel_err(dx_sum.data(), dxf.data(), N * C), tol);
    }
  }
}

// forward_logits of the shard models (local logits gathered by gather_from_tensor_region) are the
// one-process logits: the same dot products, so within 1e-5 relative (the layers' reductions).
TEST(TensorParallel, GatheredLogitsMatchOneProcess) {
  for (const Family& f : families()) {
    auto global = build_model(f.cfg);
    perturbed_init(*global);
    global->allocate(kB, kT);
    const Batch b = batch(f.cfg, 0);
    const int64_t V = f.cfg.vocab_size;
    std::vector<float> ref(kB * kT * V), ref_last(kB * V);
    global->forward_logits(b.tokens.data(), kB, kT, ref.data());
    global->forward_last_logits(b.tokens.data(), kB, kT, ref_last.data());
    const int tp = 2;
    std::mutex mu;
    std::vector<std::vector<float>> got(static_cast<size_t>(tp)), got_last(static_cast<size_t>(tp));
    dist::run_threads(tp, [&](dist::Communicator& comm) {
      auto m = attached_shard(*global, comm, comm.rank(), tp);
      m->allocate(kB, kT);
      std::vector<float> lg(kB * kT * V), last(kB * V);
      m->forward_logits(b.tokens.data(), kB, kT, lg.data());
      m->forward_last_logits(b.tokens.data(), kB, kT, last.data());
      std::lock_guard<std::mutex> lock(mu);
      got[static_cast<size_t>(comm.rank())] = std::move(lg);
      got_last[static_cast<size_t>(comm.rank())] = std::move(last);
    });
    for (int r = 0; r < tp; ++r) {
      EXPECT_LT(rel_err(got[static_cast<size_t>(r)].data(), ref.data(), kB * kT * V), 1e-5) << f.name;
      EXPECT_LT(rel_err(got_last[static_cast<size_t>(r)].data(), ref_last.data(), kB * V), 1e-5) << f.name;
    }
  }
}

TEST(TensorParallel, ShardModelWithoutTheVocabHookIsRefused) {
  // A vocab shard's model run alone would look up wrong rows; it must say what is missing.
  auto m = build_shard_model(ModelConfig::preset("gpt2-debug"), 2, false, 0);
  m->init_weights(1);
  m->allocate(kB, kT);
  const Batch b = batch(ModelConfig::preset("gpt2-debug"), 0);
  try {
    m->forward_backward(b.tokens.data(), b.targets.data(), kB, kT, 1.0f, false);
    FAIL() << "a vocab shard ran without the vocab-parallel hooks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attach_tensor_parallel"), std::string::npos) << e.what();
  }
}

// The shard's config is a plain config.json (heads / tp with the whole model's head_dim); what
// makes the model a shard (whole vocabulary, degree, sequence parallelism) is its TensorShard.
TEST(TensorParallel, ShardStateLivesOnTheModelNotTheConfig) {
  const ModelConfig g = model_test::mistral_head_dim_config();
  const ModelConfig c = shard_config(g, 2, 1);
  EXPECT_EQ(c.num_attention_heads, 2);
  EXPECT_EQ(c.head_dim(), 32);
  EXPECT_EQ(c.to_hf_json()["head_dim"], 32);
  EXPECT_EQ(ModelConfig::from_hf_json(c.to_hf_json(), "shard"), c);
  EXPECT_EQ(shard_config(g, 1), g);
  EXPECT_TRUE(tensor_shard(g, 1).whole());
  auto m = build_shard_model(g, 2, true, 1);
  EXPECT_EQ(m->config(), c);
  EXPECT_EQ(m->tensor_shard(), (TensorShard{96, 2, true}));
  EXPECT_EQ(m->global_vocab(), 96);
  EXPECT_EQ(m->tensor_shard().rows_held(13), 7);
  // A model built from the shard config alone is a whole (small) model: attaching it is refused.
  std::string err;
  dist::run_threads(2, [&](dist::Communicator& comm) {
    auto plain = build_model(shard_config(g, 2, comm.rank()));
    try {
      attach_tensor_parallel(*plain, comm);
    } catch (const Error& e) {
      if (comm.rank() == 0) err = e.what();
    }
  });
  EXPECT_NE(err.find("build_shard_model"), std::string::npos) << err;
}

TEST(TensorParallel, DegreesThatDoNotDivideAreNamed) {
  const ModelConfig llama = ModelConfig::preset("llama-debug");  // 4 heads, 2 KV heads, F = 96
  try {
    shard_config(llama, 3);
    FAIL() << "tp=3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_attention_heads = 4"), std::string::npos) << e.what();
  }
  try {
    shard_config(llama, 4);
    FAIL() << "tp=4 accepted with 2 KV heads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads = 2"), std::string::npos) << e.what();
  }
  // The vocabulary is split by rows, unevenly where tp does not divide it: 97 rows over 2 ranks are
  // 49 + 48; a padded 98 gives 49 each as before. Fewer rows than ranks is refused, naming both.
  ModelConfig odd = ModelConfig::preset("gpt2-debug");
  odd.vocab_size = 97;
  EXPECT_EQ(shard_config(odd, 2).vocab_size, 49);
  EXPECT_EQ(shard_config(odd, 2, 1).vocab_size, 48);
  EXPECT_EQ(tensor_shard(odd, 2).global_vocab, 97);
  odd.vocab_size = 98;
  EXPECT_EQ(shard_config(odd, 2, 1).vocab_size, 49);
  odd.vocab_size = 1;
  try {
    shard_config(odd, 2);
    FAIL() << "tp=2 accepted with vocab_size 1";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("parallel.tensor = 2 is more than model.vocab_size = 1"), std::string::npos) << msg;
  }
}

// The vocabulary rule: contiguous shards in rank order covering [0, V) exactly once, sizes differing
// by at most one row (rank 0 the largest), never empty; where tp divides V exactly today's
// [r*V/tp, (r+1)*V/tp), so a model whose vocabulary is a multiple of the degree keeps its bits.
TEST(TensorParallel, VocabShardRule) {
  for (int64_t V : {1, 2, 5, 96, 97, 101, 50257, 50304})
    for (int tp = 1; tp <= 9 && tp <= V; ++tp) {
      int64_t next = 0;
      for (int r = 0; r < tp; ++r) {
        const VocabShard s = vocab_shard(V, tp, r);
        EXPECT_EQ(s.begin, next) << V << " " << tp << " " << r;
        EXPECT_GE(s.rows, 1);
        EXPECT_LE(s.rows, vocab_shard(V, tp, 0).rows);
        EXPECT_GE(s.rows, vocab_shard(V, tp, 0).rows - 1);
        if (V % tp == 0) {
          EXPECT_EQ(s.begin, r * (V / tp));
          EXPECT_EQ(s.rows, V / tp);
        }
        next = s.begin + s.rows;
      }
      EXPECT_EQ(next, V) << V << " " << tp;
    }
  EXPECT_EQ(vocab_shard(50257, 2, 0).rows, 25129);
  EXPECT_EQ(vocab_shard(50257, 2, 1).begin, 25129);
  EXPECT_EQ(vocab_shard(50257, 2, 1).rows, 25128);
}

// Uneven shards: every rank's scatter_shard, gathered back with gather_global (per-rank counts), is
// the global buffer bit for bit, wte / lm_head with exactly V rows; and a rank whose model was built
// with another rank's vocabulary rows is refused when the hooks are attached, naming the fix.
TEST(TensorParallel, UnevenVocabularyRoundTripsAndWrongRankIsRefused) {
  ModelConfig cfg = ModelConfig::preset("llama-debug");
  cfg.tie_word_embeddings = false;  // wte and lm_head both vocabulary-split
  cfg.num_attention_heads = 6;      // head_dim 8; 6 KV heads and the MLP width 96 split at tp=2 and 3
  cfg.num_key_value_heads = 6;
  cfg.vocab_size = 101;
  auto global = build_model(cfg);
  global->init_weights(3);
  const ParamTable& gt = global->params();
  EXPECT_EQ(gt.at("model.embed_tokens.weight").shape[0], 101);
  for (int tp : {2, 3}) {
    std::mutex mu;
    std::vector<std::vector<float>> got(static_cast<size_t>(tp));
    std::vector<std::string> errors(static_cast<size_t>(tp));
    dist::run_threads(tp, [&](dist::Communicator& comm) {
      const int r = comm.rank();
      auto m = build_shard_model(cfg, tp, false, r);
      EXPECT_EQ(m->params().at("lm_head.weight").shape[0], vocab_shard(101, tp, r).rows);
      scatter_shard(gt, global->param_data(), m->params(), m->param_data(), r, tp);
      std::vector<float> g(gt.total(), -1.0f);
      gather_global(comm, gt, m->params(), m->param_data(), g.data());
      // Every rank builds rank 0's model: the last rank's rows differ (101 = 51 + 50, 34 + 34 + 33).
      auto wrong = build_shard_model(cfg, tp, false, 0);
      std::string err;
      try {
        attach_tensor_parallel(*wrong, comm);
      } catch (const Error& e) {
        err = e.what();
      }
      std::lock_guard<std::mutex> lock(mu);
      got[static_cast<size_t>(r)] = std::move(g);
      errors[static_cast<size_t>(r)] = err;
    });
    for (int r = 0; r < tp; ++r) {
      EXPECT_EQ(0, std::memcmp(got[static_cast<size_t>(r)].data(), global->param_data(), gt.total() * sizeof(float)))
          << "tp=" << tp << " rank " << r;
      const bool same_rows = vocab_shard(101, tp, r).rows == vocab_shard(101, tp, 0).rows;
      EXPECT_EQ(errors[static_cast<size_t>(r)].empty(), same_rows) << "tp=" << tp << " rank " << r;
      if (!same_rows) {
        EXPECT_NE(errors[static_cast<size_t>(r)].find("shard_config with its rank"), std::string::npos)
            << errors[static_cast<size_t>(r)];
      }
    }
  }
}

TEST(TensorParallel, ShardConfigCountsItsOwnParameters) {
  // The analytical count (memory estimates, lathe plan) equals the shard model's table.
  for (const Family& f : families())
    for (int tp : f.degrees)
      for (int r = 0; r < tp; ++r) {
        const ModelConfig c = shard_config(f.cfg, tp, r);
        EXPECT_EQ(c.num_parameters(), static_cast<int64_t>(build_model(c)->num_params()))
            << f.name << " tp=" << tp << " rank " << r;
      }
}

// Each half of the region pairs (models/tp_mappings.h) calls the collective the table names, on
// the buffers it is given; identity halves are not calls. Recorded on stand-in collectives.
TEST(TensorParallel, RegionPairsCallTheirCollectives) {
  std::vector<std::string> log;
  TpMappings tp;
  EXPECT_FALSE(tp.tensor_parallel());
  EXPECT_FALSE(tp.sequence_parallel());
  char full[8], shard[4];
  float f32[2], whole[4];
  auto entry = [](const char* what, const void* a, const void* b, int64_t n) {
    return fmt::format("{} {} {} {}", what, a, b, n);
  };
  auto note = [&](const char* what, const void* a, const void* b, int64_t n) { log.push_back(entry(what, a, b, n)); };
  tp.comm.all_reduce = [&](void* buf, int64_t n) { note("all_reduce", buf, nullptr, n); };
  tp.comm.all_gather_rows = [&](const void* s, void* f, int64_t n) { note("all_gather", s, f, n); };
  tp.comm.reduce_scatter_rows = [&](void* f, void* s, int64_t n) { note("reduce_scatter", f, s, n); };
  tp.comm.split_rows = [&](const void* f, void* s, int64_t n) { note("split", f, s, n); };
  tp.comm.all_reduce_f32 = [&](float* g, int64_t n) { note("all_reduce_f32", g, nullptr, n); };
  tp.comm.gather_vocab = [&](const float* l, float* w, int64_t M, int64_t v) { note("gather_vocab", l, w, M * v); };
  EXPECT_TRUE(tp.tensor_parallel());
  EXPECT_TRUE(tp.sequence_parallel());
  auto expect = [&](const std::string& want) {
    ASSERT_EQ(log.size(), 1u) << want;
    EXPECT_EQ(log[0], want);
    log.clear();
  };
  tp.copy_to_tensor_region_backward(full, 8);
  expect(entry("all_reduce", full, nullptr, 8));
  tp.reduce_from_tensor_region_forward(full, 8);
  expect(entry("all_reduce", full, nullptr, 8));
  EXPECT_EQ(tp.gather_from_sequence_region_forward(shard, full, 4), full);
  expect(entry("all_gather", shard, full, 4));
  tp.gather_from_sequence_region_backward(full, shard, 4);
  expect(entry("reduce_scatter", full, shard, 4));
  tp.gather_from_sequence_region_backward_whole(full, shard, 4);
  expect(entry("split", full, shard, 4));
  tp.reduce_scatter_to_sequence_region_forward(full, shard, 4);
  expect(entry("reduce_scatter", full, shard, 4));
  EXPECT_EQ(tp.reduce_scatter_to_sequence_region_backward(shard, full, 4), full);
  expect(entry("all_gather", shard, full, 4));
  tp.scatter_to_sequence_region_forward(full, shard, 4);
  expect(entry("split", full, shard, 4));
  EXPECT_EQ(tp.scatter_to_sequence_region_backward(shard, full, 4), full);
  expect(entry("all_gather", shard, full, 4));
  tp.gather_from_tensor_region_forward(f32, whole, 1, 2);
  expect(entry("gather_vocab", f32, whole, 2));
  tp.reduce_sequence_norm_grads(f32, 2);
  expect(entry("all_reduce_f32", f32, nullptr, 2));
}

namespace {
void phi3_sections_case(const ModelConfig& mha) {
  auto whole = build_model(mha);
  whole->init_weights(3);
  auto local = build_model(shard_config(mha, 2, 1));
  scatter_shard(whole->params(), whole->param_data(), local->params(), local->param_data(), 1, 2);
  const ParamSpec& g = whole->params().at("model.layers.0.self_attn.qkv_proj.weight");
  const ParamSpec& l = local->params().at("model.layers.0.self_attn.qkv_proj.weight");
  const int64_t C = mha.hidden_size, D = mha.head_dim(), H = mha.num_attention_heads, KV = mha.num_key_value_heads;
  // rank 1: the second half of each of q (H heads), k and v (KV heads each)
  const int64_t global_first[3] = {H / 2 * D, (H + KV / 2) * D, (H + KV + KV / 2) * D};
  const int64_t local_first[3] = {0, H / 2 * D, (H / 2 + KV / 2) * D};
  ASSERT_EQ(l.shape[0], (H + 2 * KV) / 2 * D);
  for (int64_t sec = 0; sec < 3; ++sec)
    EXPECT_EQ(local->param_data()[l.offset + local_first[sec] * C], whole->param_data()[g.offset + global_first[sec] * C])
        << sec;
  std::vector<float> back(whole->num_params(), 0.0f);
  for (int r = 0; r < 2; ++r) {
    auto lr = build_model(shard_config(mha, 2, r));
    scatter_shard(whole->params(), whole->param_data(), lr->params(), lr->param_data(), r, 2);
    place_shard(whole->params(), back.data(), lr->params(), lr->param_data(), r, 2);
  }
  for (const char* n : {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"}) {
    const ParamSpec& s = whole->params().at(n);
    EXPECT_TRUE(
        std::equal(back.begin() + s.offset, back.begin() + s.offset + s.numel(), whole->param_data() + s.offset))
        << n;
  }
}
}  // namespace

// phi3's fused qkv_proj splits as three sections of H, KV and KV heads (q, k, v each over the
// ranks): a rank's shard holds its own q, k and v heads, grouped-query (KV < H) or not, and
// scatter then place restores the whole model.
TEST(TensorParallel, Phi3FusedQkv) {
  for (int64_t kv : {2, 4}) {
    ModelConfig mha = ModelConfig::preset("phi3-debug");  // 4 query heads
    mha.num_key_value_heads = kv;
    SCOPED_TRACE(fmt::format("kv heads {}", kv));
    phi3_sections_case(mha);
  }
}
