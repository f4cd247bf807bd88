// Incremental decoder (see kv_cache.h). Mirrors Model::layer_forward of models/transformer.cpp
// step for step on the rows of the new tokens only; keep the two in sync when the body changes.
#include "models/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/checked.h"
#include "core/dtype.h"
#include "core/error.h"

namespace lathe {

std::string kv_cache_unsupported_reason(const Model& model) {
  const DType dt = model.compute_dtype();
  if (dt != DType::F32 && dt != DType::BF16 && dt != DType::F16)
    return fmt::format("the KV cache decodes fp32, bf16 and fp16 models; this model computes in {}",
                       compute_dtype_name(dt));
  if (model.hooks().tp.tensor_parallel())
    return "the KV cache does not decode a model whose layers are split by tensor parallelism";
  if (model.backend().device() != DeviceKind::Host) return "the KV cache decodes on the cpu backend only";
  if (model.arch().moe_experts > 0)
    return "the KV cache has no mixture-of-experts layer yet (generation recomputes the context per token)";
  return {};
}

KvCache::KvCache(const Model& model, int64_t batch, int64_t max_seq) : B_(batch), Tmax_(max_seq) {
  const std::string why = kv_cache_unsupported_reason(model);
  LATHE_CHECK(why.empty(), "kv cache: {}", why);
  const ModelConfig& cfg = model.config();
  LATHE_CHECK(batch >= 1 && max_seq >= 1, "kv cache: batch {} x max_seq {}: both must be >= 1", batch, max_seq);
  LATHE_CHECK(!model.arch().learned_pos || max_seq <= cfg.max_position_embeddings,
              "kv cache: max_seq {} exceeds the model's max_position_embeddings {}; use a shorter context", max_seq,
              cfg.max_position_embeddings);
  LATHE_CHECK(max_seq <= kMaxPositions, "kv cache: max_seq {} exceeds lathe's maximum {}", max_seq, kMaxPositions);
  const std::string what = fmt::format("kv cache of {} for batch {} x max_seq {}", cfg.model_type, batch, max_seq);
  layer_stride_ = checked_product({batch, cfg.num_key_value_heads, max_seq, cfg.head_dim()}, what);
  const int64_t total = checked_mul(layer_stride_, cfg.num_hidden_layers, what);
  k_.assign(static_cast<size_t>(total), 0.0f);
  v_.assign(static_cast<size_t>(total), 0.0f);
  if (!model.arch().learned_pos) {
    // Angles depend on the position only (not on the table length), so these rows equal the
    // model's own tables for every position both hold. Except with dynamic NTK scaling, whose
    // frequencies follow the sequence length: they are those of the whole max_seq sequence, so
    // the cache's logits are the full forward's over max_seq tokens (transformers' generate
    // instead recomputes them per step and keeps keys rotated with the older ones).
    const RopeFrequencies f = rope_frequencies(cfg, max_seq);
    const int64_t half = cfg.rotary_dim() / 2, n = checked_mul(max_seq, half, what);
    rope_cos_.assign(static_cast<size_t>(n), 0.0f);
    rope_sin_.assign(static_cast<size_t>(n), 0.0f);
    model.ops().rope_tables(rope_cos_.data(), rope_sin_.data(), max_seq, half, f.inv_freq.data(), f.attention_factor);
  }
}

namespace {

// Work buffers hold activations of the compute dtype (fp32, or 16-bit bf16/fp16 elements: half the
// bytes, so a float vector of `n` elements always has room for n of them).
void* grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// Element i of a compute-dtype buffer widened to fp32, and the rounding back (exact for fp32).
float load(const void* p, int64_t i, DType dt) {
  switch (dt) {
    case DType::BF16:
      return bf16_to_fp32(static_cast<const uint16_t*>(p)[i]);
    case DType::F16:
      return fp16_to_fp32(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}
void store(void* p, int64_t i, float x, DType dt) {
  switch (dt) {
    case DType::BF16:
      static_cast<uint16_t*>(p)[i] = fp32_to_bf16(x);
      break;
    case DType::F16:
      static_cast<uint16_t*>(p)[i] = fp32_to_fp16(x);
      break;
    default:
      static_cast<float*>(p)[i] = x;
  }
}

// Causal GQA attention of T new queries per sequence over the cached keys/values of positions
// 0..pos+t (the chunk's own keys already appended). qkv [B, T, Q] (q at column h*D) and out
// [B, T, H*D] in the compute dtype; k/v cache [B, KV, Tmax, D] fp32. Scale 1/sqrt(D), softmax in
// fp32 with the max subtracted, as attention_forward; 16-bit tables widen q|k|v to fp32 and round
// the output once, as their attention kernels do. window > 0: query position i sees keys
// j > i - window only (the layer's sliding window, as the kernels). scale > 0 replaces 1/sqrt(D) and
// softcap > 0 caps each score to softcap * tanh(s / softcap) (Gemma 2), as the kernels.
void cached_attention(void* out, const void* qkv, const float* kc, const float* vc, int64_t B, int64_t T, int64_t pos,
                      int64_t Tmax, int64_t H, int64_t KV, int64_t D, int64_t Q, DType dt, int64_t window,
                      float scale_arg, float softcap) {
  const int64_t group = H / KV;
  const float scale = scale_arg > 0.0f ? scale_arg : 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t jobs = B * H * T;
  // Worth threads only when there are several queries or a long cache.
#pragma omp parallel if (jobs * (pos + T) * D >= (1 << 16))
  {
    std::vector<float> p(static_cast<size_t>(pos + T)), q(static_cast<size_t>(D)), o(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t job = 0; job < jobs; ++job) {
      const int64_t b = job / (H * T), h = job / T % H, t = job % T;
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos + t + 1 - window) : 0;
      const int64_t n = pos + t + 1 - first;  // keys visible to this query: [first, pos + t]
      for (int64_t d = 0; d < D; ++d) q[d] = load(qkv, (b * T + t) * Q + h * D + d, dt);
      const float* k = kc + ((b * KV + h / group) * Tmax + first) * D;
      const float* v = vc + ((b * KV + h / group) * Tmax + first) * D;
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) s += q[d] * k[j * D + d];
        p[j] = s * scale;
        if (softcap > 0.0f) p[j] = softcap * std::tanh(p[j] / softcap);
        mx = std::max(mx, p[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += p[j] = std::exp(p[j] - mx);
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float w = p[j] / sum;
        for (int64_t d = 0; d < D; ++d) o[d] += w * v[j * D + d];
      }
      for (int64_t d = 0; d < D; ++d) store(out, (b * T + t) * H * D + h * D + d, o[d], dt);
    }
  }
}

}  // namespace

void decode_chunk(Model& model, KvCache& c, const int32_t* tokens, int64_t T, float* logits) {
  const std::string why = kv_cache_unsupported_reason(model);
  LATHE_CHECK(why.empty(), "kv cache: {}", why);
  const ModelConfig& cfg = model.config();
  const Arch& arch = model.arch();
  const Ops& ops = model.ops();
  const DType dt = ops.dtype;
  const size_t es = dtype_size(dt);  // bytes per activation element
  const ModelPtrs& w = model.weights();
  const int64_t B = c.B_, C = cfg.hidden_size, H = cfg.num_attention_heads, KV = cfg.num_key_value_heads,
                D = cfg.head_dim(), Q = (H + 2 * KV) * D, F = cfg.intermediate_size, FF = arch.gelu_mlp ? F : 2 * F,
                V = cfg.vocab_size, L = cfg.num_hidden_layers, N = B * T, pos = c.pos_;
  const float eps = static_cast<float>(cfg.norm_eps);
  LATHE_CHECK(T >= 1, "kv cache: {} new tokens per sequence; give at least one", T);
  LATHE_CHECK(T <= c.Tmax_ - pos,
              "kv cache full: {} positions filled of max_seq {}, {} more do not fit; make the cache longer (max_seq) "
              "or start again with a shorter context",
              pos, c.Tmax_, T);
  for (int64_t i = 0; i < N; ++i)
    LATHE_CHECK(tokens[i] >= 0 && tokens[i] < V, "kv cache: token id {} (row {}) is outside the vocabulary [0, {})",
                tokens[i], i, V);
  model.verify_compute_weights();  // 16-bit copies filled and fresh, as Model::embedding_forward checks
  auto at = [es](void* p, int64_t i) { return static_cast<void*>(static_cast<std::byte*>(p) + i * es); };

  void* x = grow(c.x_, N * C);
  void* ln = grow(c.ln_, N * C);
  void* qkv = grow(c.qkv_, N * Q);
  void* att = grow(c.att_, N * H * D);
  void* fc = grow(c.fc_, N * FF);
  void* act = grow(c.act_, N * F);
  void* res1 = grow(c.res1_, N * C);
  float* mean = static_cast<float*>(grow(c.mean_, N));
  float* rstd = static_cast<float*>(grow(c.rstd_, N));

  // Embedding: learned positions pos..pos+T-1 are the rows of wpe starting at pos (positions
  // nullptr: row t of the table passed; generation is one document, so no document positions).
  ops.embedding_forward(x, tokens, model.compute_weight(w.wte), w.wpe ? model.compute_weight(w.wpe + pos * C) : nullptr,
                        B, T, C, nullptr, 0, V);
  if (arch.embed_scale) ops.scale_forward(x, sqrt_hidden_in(dt, C), N * C);  // gemma2, as Model::embedding_forward
  auto norm = [&](void* out, const void* in, const float* nw, const float* nb, int64_t rows) {
    if (arch.layernorm) {
      ops.layernorm_forward(out, mean, rstd, in, nw, nb, rows, C, eps);
      return;
    }
    if (arch.norm_weight_offset != 0.0f) {  // gemma2's 1 + w, as Model::norm_weight
      float* nwo = static_cast<float*>(grow(c.norm_w_, C));
      for (int64_t i = 0; i < C; ++i) nwo[i] = arch.norm_weight_offset + nw[i];
      nw = nwo;
    }
    ops.rmsnorm_forward(out, rstd, in, nw, rows, C, eps);
  };
  void* post = arch.sandwich_norm ? grow(c.post_, N * C) : nullptr;
  for (int64_t l = 0; l < L; ++l) {
    const LayerPtrs& lw = w.layers[static_cast<size_t>(l)];
    if (arch.pre_norm) norm(ln, x, lw.ln1_w, lw.ln1_b, N);  // olmo2: the GEMM reads x itself
    ops.matmul_forward(qkv, arch.pre_norm ? ln : x, model.compute_weight(lw.qkv_w), lw.qkv_b, N, C, Q, false);
    if (arch.qk_norm_full) {  // olmo2: q and k normed over the whole projection, as Model::qk_norm_forward
      void* saved = grow(c.qk_saved_, N * (H + KV) * D);
      float* qk_rstd = static_cast<float*>(grow(c.qk_rstd_, N * 2));
      ops.head_rmsnorm_forward(qkv, saved, qk_rstd, lw.q_norm_w, N, 1, H * D, Q, eps);
      ops.head_rmsnorm_forward(at(qkv, H * D), at(saved, N * H * D), qk_rstd + N, lw.k_norm_w, N, 1, KV * D, Q, eps);
    }
    if (arch.qk_norm) {  // per-head q and k norms before RoPE, as Model::qk_norm_forward
      void* saved = grow(c.qk_saved_, N * (H + KV) * D);
      float* qk_rstd = static_cast<float*>(grow(c.qk_rstd_, N * (H + KV)));
      ops.head_rmsnorm_forward(qkv, saved, qk_rstd, lw.q_norm_w, N, H, D, Q, eps);
      ops.head_rmsnorm_forward(at(qkv, H * D), at(saved, N * H * D), qk_rstd + N * H, lw.k_norm_w, N, KV, D, Q, eps);
    }
    if (!arch.learned_pos) {  // rotate q and k at their absolute positions
      const int64_t rot = cfg.rotary_dim();
      const float* cs = c.rope_cos_.data() + pos * (rot / 2);
      const float* sn = c.rope_sin_.data() + pos * (rot / 2);
      ops.rope_forward(qkv, cs, sn, B, T, H, D, rot, Q, nullptr);
      ops.rope_forward(at(qkv, H * D), cs, sn, B, T, KV, D, rot, Q, nullptr);
    }
    // Append this chunk's keys and values, widened to fp32 (exact): qkv row (b, t) -> cache
    // [b, kvh, pos + t].
    float* kc = c.keys(l);
    float* vc = c.values(l);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < KV; ++g) {
          const int64_t row = (b * T + t) * Q, dst = ((b * KV + g) * c.Tmax_ + pos + t) * D;
          for (int64_t d = 0; d < D; ++d) {
            kc[dst + d] = load(qkv, row + (H + g) * D + d, dt);
            vc[dst + d] = load(qkv, row + (H + KV + g) * D + d, dt);
          }
        }
    cached_attention(att, qkv, kc, vc, B, T, pos, c.Tmax_, H, KV, D, Q, dt, cfg.layer_window(l), cfg.attention_scale(),
                     cfg.attn_softcap());
    if (arch.sandwich_norm) {  // res1 = x + norm(o(attn)), as Model::layer_forward_into
      ops.matmul_forward(post, att, model.compute_weight(lw.o_w), lw.o_b, N, H * D, C, false);
      norm(res1, post, lw.post_attn_w, nullptr, N);
    } else {
      ops.matmul_forward(res1, att, model.compute_weight(lw.o_w), lw.o_b, N, H * D, C, false);
    }
    ops.residual_forward(res1, res1, x, N * C);
    const void* in2 = arch.parallel_residual ? x : res1;
    if (arch.pre_norm) norm(ln, in2, lw.ln2_w, lw.ln2_b, N);  // as Model::norm_forward
    ops.matmul_forward(fc, arch.pre_norm ? ln : in2, model.compute_weight(lw.fc_w), lw.fc_b, N, C, FF, false);
    if (arch.gelu_mlp && arch.gelu_exact)
      ops.gelu_erf_forward(act, fc, N * F);
    else if (arch.gelu_mlp)
      ops.gelu_forward(act, fc, N * F);
    else if (arch.geglu)
      ops.geglu_forward(act, fc, N, F);
    else
      ops.swiglu_forward(act, fc, N, F);
    if (arch.sandwich_norm) {  // x = res1 + norm(mlp)
      ops.matmul_forward(post, act, model.compute_weight(lw.proj_w), lw.proj_b, N, F, C, false);
      norm(x, post, lw.post_ffn_w, nullptr, N);
    } else {
      ops.matmul_forward(x, act, model.compute_weight(lw.proj_w), lw.proj_b, N, F, C, false);
    }
    ops.residual_forward(x, x, res1, N * C);  // x is the next layer's input
  }
  c.pos_ = pos + T;
  if (!logits) return;
  // Head on the last new row of each sequence only: final norm is per row, so this equals the
  // full forward's rows.
  void* last = grow(c.last_, B * C);
  for (int64_t b = 0; b < B; ++b) std::memcpy(at(last, b * C), at(x, (b * T + T - 1) * C), static_cast<size_t>(C) * es);
  norm(ln, last, w.lnf_w, w.lnf_b, B);
  ops.logits_forward(logits, ln, model.compute_weight(w.lm_head), B, C, V);
  apply_final_softcap(cfg, logits, B * V);
}

}  // namespace lathe
