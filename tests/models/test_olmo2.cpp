// OLMo 2 (Arch::pre_norm false + sandwich_norm: post norms only; Arch::qk_norm_full: q / k RMSNorm
// over the whole projection): the config (olmo2 model_type, Olmo2Config's class defaults, refusals,
// config.json round trip, parameter count), the table, finite differences of the new norm placement
// and of the whole-projection q/k norm against a naive double-precision reference at odd sizes,
// parity with the PyTorch reference (torch_reference_olmo2.py, written after transformers'
// modeling_olmo2.py: logits, loss and every gradient within 1e-5; the reference with per-head q/k
// norms, with pre-norms, or without RoPE must fail), recompute modes, the KV cache, and the refusals
// (GGUF, ONNX). Tensor / sequence / context parallelism: tests/parallel/tp_fixtures.h's families.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "error_of.h"
#include "interop/gguf_export.h"
#include "interop/hf_weights.h"
#include "interop/onnx_export.h"
#include "io/safetensors.h"
#include "model_fixtures.h"
#include "models/kv_cache.h"
#include "models/memory.h"
#include "models/model.h"

namespace fs = std::filesystem;
using namespace lathe;
using lathe::test::error_of;

namespace {

// olmo2-debug with weights of std 0.5: q/k projections large enough that attention, RoPE and the
// norms all matter.
ModelConfig olmo2_cfg() {
  ModelConfig c = ModelConfig::preset("olmo2-debug");
  c.initializer_range = 0.5;
  return c;
}

fs::path write_case(const ModelConfig& cfg, int64_t B, int64_t T) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_olmo2_parity_{}", getpid());
  model_test::fresh_dir(dir);
  auto model = model_test::perturbed_model(cfg);
  model->allocate(B, T);
  save_hf_model(*model, (dir / "model").string());
  const int64_t V = cfg.vocab_size, N = B * T;
  std::vector<int32_t> toks = model_test::random_tokens(N, V, 123), tgts = model_test::random_tokens(N, V, 456);
  io::write_safetensors((dir / "batches.safetensors").string(), {{"tokens", DType::I32, Shape{1, B, T}, toks.data()},
                                                                 {"targets", DType::I32, Shape{1, B, T}, tgts.data()}});
  std::vector<float> logits(static_cast<size_t>(N * V));
  model->forward_logits(toks.data(), B, T, logits.data());
  model->zero_grad();
  const float loss = static_cast<float>(model->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true) / N);
  io::write_safetensors((dir / "outputs.safetensors").string(),
                        {{"logits", DType::F32, Shape{B, T, V}, logits.data()}, {"loss", DType::F32, Shape{}, &loss}});
  save_hf_tensors(*model, model->grad_data(), (dir / "grads.safetensors").string());
  return dir;
}

std::string oracle(const fs::path& dir, const std::string& flags, int& rc) {
  std::string out;
  const std::string cmd = fmt::format("/usr/bin/python3 {}/tests/models/torch_reference_olmo2.py check {} {} 2>&1",
                                      LATHE_SOURCE_DIR, dir.string(), flags);
  model_test::run_oracle(cmd, rc, out);
  return out;
}

nlohmann::json small_config() {
  return {{"model_type", "olmo2"},   {"hidden_size", 60},       {"num_attention_heads", 6},
          {"num_key_value_heads", 2}, {"intermediate_size", 72}, {"num_hidden_layers", 2}};
}

// ---- A naive double-precision OLMo 2 layer stack (no kernels, no flat buffers) for finite
// differences: the same weights as the model, read by role from its table.
struct Naive {
  const Model& m;
  const std::vector<double>& p;  // the model's parameters, widened
  int64_t C, H, KV, D, F, V, L;
  double eps, theta;
  explicit Naive(const Model& model, const std::vector<double>& params)
      : m(model),
        p(params),
        C(model.config().hidden_size),
        H(model.config().num_attention_heads),
        KV(model.config().num_key_value_heads),
        D(model.config().head_dim()),
        F(model.config().intermediate_size),
        V(model.config().vocab_size),
        L(model.config().num_hidden_layers),
        eps(model.config().norm_eps),
        theta(model.config().rope_theta) {}
  const double* w(const std::string& name) const { return p.data() + m.params().at(name).offset; }
  // RMSNorm of x[n] with weight w in place.
  void rms(double* x, int64_t n, const double* wt) const {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] * r * wt[i];
  }
  // y[rows] = W[rows, cols] x[cols]
  static void mv(double* y, const double* W, const double* x, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t c = 0; c < cols; ++c) s += W[r * cols + c] * x[c];
      y[r] = s;
    }
  }
  void rope(double* v, int64_t t) const {  // rotate_half on one head
    for (int64_t i = 0; i < D / 2; ++i) {
      const double a = t * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
      const double x1 = v[i], x2 = v[i + D / 2];
      v[i] = x1 * std::cos(a) - x2 * std::sin(a);
      v[i + D / 2] = x2 * std::cos(a) + x1 * std::sin(a);
    }
  }
  // Mean cross-entropy over one sequence.
  double loss(const std::vector<int32_t>& toks, const std::vector<int32_t>& tgts) const {
    const int64_t T = static_cast<int64_t>(toks.size());
    std::vector<double> x(static_cast<size_t>(T * C));
    const double* wte = w("model.embed_tokens.weight");
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) x[t * C + c] = wte[toks[t] * C + c];
    for (int64_t l = 0; l < L; ++l) {
      auto n = [&](const char* s) { return fmt::format("model.layers.{}.{}", l, s); };
      std::vector<double> q(T * H * D), k(T * KV * D), v(T * KV * D), y(T * H * D), o(C), h(F), u(F), d(C);
      for (int64_t t = 0; t < T; ++t) {
        mv(&q[t * H * D], w(n("self_attn.q_proj.weight")), &x[t * C], H * D, C);
        mv(&k[t * KV * D], w(n("self_attn.k_proj.weight")), &x[t * C], KV * D, C);
        mv(&v[t * KV * D], w(n("self_attn.v_proj.weight")), &x[t * C], KV * D, C);
        rms(&q[t * H * D], H * D, w(n("self_attn.q_norm.weight")));  // the whole projection
        rms(&k[t * KV * D], KV * D, w(n("self_attn.k_norm.weight")));
        for (int64_t hh = 0; hh < H; ++hh) rope(&q[(t * H + hh) * D], t);
        for (int64_t g = 0; g < KV; ++g) rope(&k[(t * KV + g) * D], t);
      }
      for (int64_t t = 0; t < T; ++t)
        for (int64_t hh = 0; hh < H; ++hh) {
          const int64_t g = hh / (H / KV);
          std::vector<double> s(static_cast<size_t>(t + 1));
          double mx = -1e300, z = 0;
          for (int64_t j = 0; j <= t; ++j) {
            double a = 0;
            for (int64_t e = 0; e < D; ++e) a += q[(t * H + hh) * D + e] * k[(j * KV + g) * D + e];
            s[j] = a / std::sqrt(static_cast<double>(D));
            mx = std::max(mx, s[j]);
          }
          for (int64_t j = 0; j <= t; ++j) z += (s[j] = std::exp(s[j] - mx));
          for (int64_t e = 0; e < D; ++e) {
            double a = 0;
            for (int64_t j = 0; j <= t; ++j) a += s[j] / z * v[(j * KV + g) * D + e];
            y[(t * H + hh) * D + e] = a;
          }
        }
      for (int64_t t = 0; t < T; ++t) {  // res1 = x + n(o(y)); res2 = res1 + n(mlp(res1))
        mv(o.data(), w(n("self_attn.o_proj.weight")), &y[t * H * D], C, H * D);
        rms(o.data(), C, w(n("post_attention_layernorm.weight")));
        for (int64_t c = 0; c < C; ++c) x[t * C + c] += o[c];
        mv(h.data(), w(n("mlp.gate_proj.weight")), &x[t * C], F, C);
        mv(u.data(), w(n("mlp.up_proj.weight")), &x[t * C], F, C);
        for (int64_t f = 0; f < F; ++f) h[f] = h[f] / (1 + std::exp(-h[f])) * u[f];
        mv(d.data(), w(n("mlp.down_proj.weight")), h.data(), C, F);
        rms(d.data(), C, w(n("post_feedforward_layernorm.weight")));
        for (int64_t c = 0; c < C; ++c) x[t * C + c] += d[c];
      }
    }
    double total = 0;
    std::vector<double> lg(static_cast<size_t>(V));
    for (int64_t t = 0; t < T; ++t) {
      rms(&x[t * C], C, w("model.norm.weight"));
      mv(lg.data(), w("lm_head.weight"), &x[t * C], V, C);
      double mx = -1e300, z = 0;
      for (double a : lg) mx = std::max(mx, a);
      for (double a : lg) z += std::exp(a - mx);
      total += std::log(z) + mx - lg[tgts[t]];
    }
    return total / static_cast<double>(T);
  }
};

}  // namespace

TEST(Olmo2Config, PresetRoundTripsThroughConfigJson) {
  const ModelConfig c = ModelConfig::preset("olmo2-debug");
  EXPECT_TRUE(c.post_norm);
  EXPECT_TRUE(c.qk_norm_full);
  EXPECT_FALSE(c.qk_norm);
  const nlohmann::json j = c.to_hf_json();
  EXPECT_EQ(j["model_type"], "olmo2");
  EXPECT_EQ(j["architectures"][0], "Olmo2ForCausalLM");
  EXPECT_EQ(j["attention_bias"], false);
  EXPECT_FALSE(j.contains("mlp_bias"));
  EXPECT_EQ(j["rope_theta"], 500000.0);
  const ModelConfig back = ModelConfig::from_hf_json(j, "olmo2 config.json", true);
  EXPECT_TRUE(back == c);
  EXPECT_TRUE(back.post_norm && back.qk_norm_full);
  // Against llama of the same shape: (H + KV) x head_dim norm weights more per layer (the post
  // norms replace the pre-norms one for one).
  ModelConfig llama = c;
  llama.model_type = "llama";
  llama.post_norm = llama.qk_norm_full = false;
  EXPECT_EQ(c.num_parameters() - llama.num_parameters(), (6 + 2) * 10 * c.num_hidden_layers);
  EXPECT_EQ(static_cast<int64_t>(build_model(c)->num_params()), c.num_parameters());
}

TEST(Olmo2Config, ClassDefaultsAndRefusals) {
  // Olmo2Config: vocab 50304, rms_norm_eps 1e-5, pad 1, eos 50279, no bos, untied, kv = heads.
  nlohmann::json j = small_config();
  j.erase("num_key_value_heads");
  const ModelConfig c = ModelConfig::from_hf_json(j, "cfg");
  EXPECT_EQ(c.vocab_size, 50304);
  EXPECT_EQ(c.norm_eps, 1e-5);
  EXPECT_EQ(c.pad_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 50279);
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_key_value_heads, 6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_TRUE(c.ignored_keys.empty()) << c.ignored_note();
  nlohmann::json b = small_config();
  b["attention_bias"] = true;
  EXPECT_NE(error_of([&] { (void)ModelConfig::from_hf_json(b, "cfg.json"); }).find("cfg.json: attention_bias"),
            std::string::npos);
  nlohmann::json s = small_config();
  s["hidden_act"] = "gelu";
  EXPECT_NE(error_of([&] { (void)ModelConfig::from_hf_json(s, "cfg.json"); }).find("hidden_act"), std::string::npos);
  nlohmann::json u = small_config();
  u["n_embd"] = 60;  // a recipe key of another family is named
  EXPECT_NE(error_of([&] { (void)ModelConfig::from_hf_json(u, "recipe", "model.", true); })
                .find("unknown key 'model.n_embd' for model_type olmo2"),
            std::string::npos);
}

TEST(Olmo2Model, TableAndArch) {
  auto m = build_model(ModelConfig::preset("olmo2-debug"));
  EXPECT_FALSE(m->arch().pre_norm);
  EXPECT_TRUE(m->arch().sandwich_norm);
  EXPECT_TRUE(m->arch().qk_norm_full);
  EXPECT_FALSE(m->arch().qk_norm);
  EXPECT_EQ(m->arch().norm_weight_offset, 0.0f);
  EXPECT_EQ(m->params().at("model.layers.2.self_attn.q_norm.weight").shape, (Shape{60}));
  EXPECT_EQ(m->params().at("model.layers.2.self_attn.k_norm.weight").shape, (Shape{20}));
  EXPECT_EQ(m->params().find("model.layers.0.input_layernorm.weight"), nullptr);
  EXPECT_NE(m->params().find("model.layers.0.post_feedforward_layernorm.weight"), nullptr);
  EXPECT_NE(m->params().find("lm_head.weight"), nullptr);
  for (const ParamSpec& s : m->params().specs()) {
    if (s.shape.size() == 1) {
      EXPECT_FALSE(s.decay) << s.name;
    }
  }
  for (const char* d : {"llama-debug", "qwen3-debug", "gemma2-debug"}) {
    EXPECT_TRUE(build_model(ModelConfig::preset(d))->arch().pre_norm) << d;
    EXPECT_FALSE(build_model(ModelConfig::preset(d))->arch().qk_norm_full) << d;
  }
}

// Finite differences of the whole model (post norms, whole-projection q/k norms, RoPE) in double
// precision against lathe's fp32 backward, on odd sizes (T 5, H*D 60 / KV*D 20 normalised rows,
// vocab 97): each checked gradient entry within 2e-3 relative of the central difference of the
// naive reference's loss, and the naive loss equals lathe's (so the reference is the same model).
TEST(Olmo2Model, GradientsMatchFiniteDifferencesOfANaiveReference) {
  const ModelConfig cfg = olmo2_cfg();
  auto m = model_test::perturbed_model(cfg);
  const int64_t T = 5;
  m->allocate(1, T);
  const auto toks = model_test::random_tokens(T, cfg.vocab_size, 11), tgts = model_test::random_tokens(T, cfg.vocab_size, 12);
  m->zero_grad();
  const double loss = m->forward_backward(toks.data(), tgts.data(), 1, T, 1.0f / T, true) / T;
  std::vector<double> p(m->param_data(), m->param_data() + m->num_params());
  Naive naive(*m, p);
  EXPECT_NEAR(naive.loss(toks, tgts), loss, 1e-5 * std::max(1.0, std::abs(loss)));
  // A few entries of each tensor whose use is new here (and of the projections feeding the norms).
  int checked = 0;
  for (const char* name : {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                           "model.layers.0.post_attention_layernorm.weight",
                           "model.layers.2.post_feedforward_layernorm.weight", "model.layers.1.self_attn.q_proj.weight",
                           "model.layers.0.self_attn.k_proj.weight", "model.layers.2.mlp.up_proj.weight",
                           "model.embed_tokens.weight"}) {
    const ParamSpec& s = m->params().at(name);
    for (int64_t i : {int64_t{0}, s.numel() / 3, s.numel() - 1}) {
      const size_t at = s.offset + static_cast<size_t>(i);
      const double h = 1e-5, keep = p[at];
      p[at] = keep + h;
      const double up = naive.loss(toks, tgts);
      p[at] = keep - h;
      const double down = naive.loss(toks, tgts);
      p[at] = keep;
      const double fd = (up - down) / (2 * h), g = m->grad_data()[at];
      EXPECT_NEAR(g, fd, 2e-3 * std::max(std::abs(fd), 1e-2)) << name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 24);
}

// fp32 lathe against the float64 reference module (transformers' Olmo2 structure): logits, loss
// and every gradient within 1e-5. Three broken references must each fail: per-head q/k norms,
// norms placed before the blocks, no RoPE.
TEST(Olmo2Model, MatchesTorchReferenceAndBrokenReferencesFail) {
  const fs::path dir = write_case(olmo2_cfg(), 2, 9);
  int rc = -1;
  const std::string out = oracle(dir, "", rc);
  EXPECT_EQ(rc, 0) << out;
  bool all_broken_fail = true;
  for (const char* kind : {"per-head-qk-norm", "pre-norm", "no-rope"}) {
    int broken_rc = -1;
    const std::string broken = oracle(dir, std::string("--break ") + kind, broken_rc);
    EXPECT_NE(broken_rc, 0) << "the " << kind << " reference agreed with lathe:\n" << broken;
    EXPECT_NE(broken.find("MISMATCH"), std::string::npos) << broken;
    all_broken_fail = all_broken_fail && broken_rc != 0;
  }
  if (rc == 0 && all_broken_fail) fs::remove_all(dir);
}

// The arena has no pre-norm buffers, the post-norm ones, the q|k rows and two rstd per token; the
// estimate is the arena; every recompute mode gives the same bits.
TEST(Olmo2Model, ArenaAndRecomputeAreBitIdentical) {
  const ModelConfig cfg = olmo2_cfg();
  const int64_t B = 2, T = 7, N = B * T;
  const auto toks = model_test::random_tokens(N, cfg.vocab_size, 5),
             tgts = model_test::random_tokens(N, cfg.vocab_size, 6);
  std::vector<float> ref_grads;
  double ref_loss = 0;
  for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    SCOPED_TRACE(recompute_name(rc));
    auto m = model_test::perturbed_model(cfg);
    m->allocate(B, T, 2, rc);
    int rstd = 0, post = 0;
    for (const ActivationEntry& e : m->activation_plan().entries) {
      const std::string name = e.name;
      EXPECT_EQ(name.find("ln1"), std::string::npos) << e.label();
      EXPECT_EQ(name.find("ln2"), std::string::npos) << e.label();
      EXPECT_NE(name, "shared.ln") << e.label();
      if (name == "qk_rstd" || name == "shared.qk_rstd") {
        ++rstd;
        EXPECT_EQ(e.count, N * 2);
      }
      if (name == "attn_out" || name == "shared.attn_out") ++post;
    }
    const int want = rc == Recompute::Full ? 1 : static_cast<int>(cfg.num_hidden_layers);
    EXPECT_EQ(rstd, want);
    EXPECT_EQ(post, want);
    EXPECT_EQ(estimate_memory(cfg, B, T, 2, 1, DType::F32, rc).activation_bytes,
              static_cast<int64_t>(m->activation_bytes()));
    m->zero_grad();
    const double loss = m->forward_backward(toks.data(), tgts.data(), B, T, 1.0f / N, true);
    std::vector<float> g(m->grad_data(), m->grad_data() + m->num_params());
    if (rc == Recompute::None) {
      ref_loss = loss;
      ref_grads = g;
      continue;
    }
    EXPECT_EQ(loss, ref_loss);
    EXPECT_TRUE(g == ref_grads) << "gradients differ from recompute none";
  }
}

// Incremental decoding: the KV cache's last-position logits, fed in two chunks, equal the full
// forward's.
TEST(Olmo2Model, KvCacheEqualsTheFullForward) {
  const ModelConfig cfg = olmo2_cfg();
  auto m = model_test::perturbed_model(cfg);
  const int64_t T = 9, V = cfg.vocab_size;
  m->allocate(1, T);
  const auto toks = model_test::random_tokens(T, V, 3);
  std::vector<float> full(static_cast<size_t>(T * V)), last(static_cast<size_t>(V));
  m->forward_logits(toks.data(), 1, T, full.data());
  KvCache cache(*m, 1, T);
  decode_chunk(*m, cache, toks.data(), 5, nullptr);
  decode_chunk(*m, cache, toks.data() + 5, T - 5, last.data());
  double worst = 0, scale = 0;
  for (int64_t v = 0; v < V; ++v) {
    worst = std::max(worst, static_cast<double>(std::abs(last[v] - full[(T - 1) * V + v])));
    scale = std::max(scale, static_cast<double>(std::abs(full[(T - 1) * V + v])));
  }
  EXPECT_LE(worst, 1e-5 * std::max(1.0, scale));
}

TEST(Olmo2Model, UnsupportedPathsAreRefusedNamingTheReason) {
  auto m = build_model(ModelConfig::preset("olmo2-debug"));
  m->init_weights(1);
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_olmo2_export_{}", getpid());
  model_test::fresh_dir(dir);
  const std::string onnx = error_of([&] { (void)save_onnx(*m, (dir / "m.onnx").string(), {}); });
  EXPECT_NE(onnx.find("olmo2"), std::string::npos) << onnx;
  // GGUF export is supported (llama.cpp's olmo2, run by tests/interop/test_gguf_llama_cpp.py).
  const std::string gguf = error_of([&] { (void)save_gguf(*m, (dir / "m.gguf").string(), {}); });
  EXPECT_EQ(gguf, "") << gguf;
  fs::remove_all(dir);
}
