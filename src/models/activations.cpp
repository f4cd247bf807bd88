// The activation arena's layout: one walk over the blocks that sizes the arena (plan), places
// every activation of a micro-batch in it (allocate / use_slot: one slot per in-flight micro-batch
// under pipeline parallelism, the recompute policy deciding what is kept) and names each entry for
// the memory report (ActivationEntry::label). Shapes per entry are in the walk's comments.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/checked.h"
#include "kernels/backend.h"
#include "models/memory.h"
#include "models/model.h"

namespace lathe {

namespace {

// Hands out the arena's buffers in walk order, 64-byte aligned: in the (per-slot) arena, or, when
// the layout is split, the transient ones in the shared region; each recorded in the plan.
struct ArenaCursor {
  const std::string& what;
  std::byte* base;
  std::byte* shared;
  ActivationPlan* plan;
  bool split;
  int64_t off = 0, soff = 0;  // bytes: of the (per-slot) arena, of the shared region when split

  void* take(const char* name, int64_t layer, int64_t count, DType dtype, bool transient) {
    const int64_t bytes = checked_mul(count, static_cast<int64_t>(dtype_size(dtype)), what);
    int64_t& at = split && transient ? soff : off;
    std::byte* from = split && transient ? shared : base;
    if (plan) plan->entries.push_back({name, layer, count, dtype, static_cast<size_t>(at), transient});
    void* p = from ? from + at : nullptr;
    at = checked_add(at, checked_add(bytes, 63, what) / 64 * 64, what);  // keep 64-byte alignment
    return p;
  }
  float* stat(const char* name, int64_t layer, int64_t count, bool transient = false) {
    return static_cast<float*>(take(name, layer, count, DType::F32, transient));
  }
};

// Mixture of experts: what layer l's MoE block saves (fp32; kernels/cpu/ops.h MoeActs) for N tokens
// in NK = N*k dropless slots over ME experts of width F, and with FS > 0 the shared expert's
// (moe_shared.cpp). Kept whatever the recompute mode (a MoE model refuses recompute; the plans of
// `lathe plan` count them). LayerActs: Model's (private) per-layer set, deduced.
template <class LayerActs, class Mul>
void layout_moe_acts(ArenaCursor& ar, LayerActs& a, int64_t l, int64_t N, int64_t C, int64_t F, int64_t ME, int64_t NK,
                     int64_t FS, const Mul& mul) {
  cpu::MoeActs& m = a.moe;
  m.logits = ar.stat("moe_logits", l, mul({N, ME}));
  m.probs = ar.stat("moe_probs", l, mul({N, ME}));
  m.topk_idx = static_cast<int32_t*>(ar.take("moe_topk_idx", l, NK, DType::I32, false));
  m.topk_w = ar.stat("moe_topk_w", l, NK);
  m.offsets = static_cast<int32_t*>(ar.take("moe_offsets", l, ME + 1, DType::I32, false));
  m.slot_token = static_cast<int32_t*>(ar.take("moe_slot_token", l, NK, DType::I32, false));
  m.slot_k = static_cast<int32_t*>(ar.take("moe_slot_k", l, NK, DType::I32, false));
  m.token_slot = static_cast<int32_t*>(ar.take("moe_token_slot", l, NK, DType::I32, false));
  m.xp = ar.stat("moe_xp", l, mul({NK, C}));
  m.gate = ar.stat("moe_gate", l, mul({NK, F}));
  m.up = ar.stat("moe_up", l, mul({NK, F}));
  m.act = ar.stat("moe_act", l, mul({NK, F}));
  m.y = ar.stat("moe_y", l, mul({NK, C}));
  if (FS > 0) {  // the shared expert
    a.sh_gate = ar.stat("moe_sh_gate", l, mul({N, FS}));
    a.sh_up = ar.stat("moe_sh_up", l, mul({N, FS}));
    a.sh_act = ar.stat("moe_sh_act", l, mul({N, FS}));
    a.sh_y = ar.stat("moe_sh_y", l, mul({N, C}));
    a.sh_sig = ar.stat("moe_sh_sig", l, N);
  }
}

}  // namespace

std::string ActivationEntry::label() const {
  return layer >= 0 ? fmt::format("layers.{}.{}", layer, name) : std::string(name);
}

size_t Model::layout_activations(const ModelConfig& cfg, const TensorShard& shard, int64_t B, int64_t T, const Ops& ops,
                                 Recompute recompute, Model* m, std::byte* base, ActivationPlan* plan,
                                 size_t* shared_bytes, std::byte* shared) {
  // Every size below is a product of config fields and (B, T): checked, so that a hostile config or
  // --batch/--seq-len is refused instead of wrapping into a small arena that kernels overrun.
  const std::string what = fmt::format("activations of {} for batch {} x seq_len {}", cfg.model_type, B, T);
  auto mul = [&](std::initializer_list<int64_t> f) { return checked_product(f, what); };
  const bool gelu_mlp = cfg.gelu_mlp();              // the Arch of each family (gpt2.cpp, llama.cpp, gpt_neox.cpp)
  const bool qk_norm = cfg.qk_norm;                  // Arch::qk_norm (llama.cpp)
  const bool sandwich = cfg.model_type == "gemma2";  // Arch::sandwich_norm (gemma2.cpp)
  const bool moe = cfg.moe();                        // Arch::moe_experts (moe_layer.cpp)
  // --- olmo2 (olmo2.cpp): post norms (sandwich buffers) without pre-norms (no ln1 / ln2 and their
  // statistics); whole-projection q/k norms: the q|k rows saved as qk_norm's, one rstd each per token.
  const bool post_only = cfg.post_norm, qk_full = cfg.qk_norm_full;
  const bool sandwich_or_post = sandwich || post_only, qk_any = qk_norm || qk_full;
  // --- end olmo2 ---
  const int64_t N = mul({B, T}), C = cfg.hidden_size, H = cfg.num_attention_heads, KV = cfg.num_key_value_heads,
                D = cfg.head_dim(), Q = mul({checked_add(H, mul({2, KV}), what), D}), F = cfg.intermediate_size,
                FF = gelu_mlp ? F : mul({2, F}), V = cfg.vocab_size, L = cfg.num_hidden_layers;
  // Rows of the residual stream held here: S = N, or with sequence parallelism this rank's
  // ceil(N / tp) (norms, their statistics, residuals, their gradient); the gathered rows (tp*S >= N)
  // are the column-parallel GEMMs' input and the lm head's.
  const bool sp = shard.seq_parallel();
  const int64_t S = shard.rows_held(N), NG = sp ? mul({S, shard.parts}) : N;
  // Logit chunks of up to 256 rows keep the lm-head GEMMs large while holding at most
  // 256 x V floats of logits (51 MB at V=50257) instead of N x V.
  // The CPU 16-bit tables take 512: their dw GEMM (oneDNN, K = chunk rows) ran 20% faster at
  // K=512 than at 256 (bench/bench_lm_head.cpp: GPT-2 124M head 1.14x vs 1.07x of the previous
  // kernel) for 77 MB more scratch at V=50257.
  const bool cpu_half = std::string_view(ops.backend) == "cpu" && ops.dtype != DType::F32;
  const int64_t chunk_rows = std::min<int64_t>(N, cpu_half ? 512 : 256);
  // The scratch is shared by the kernels that need one (never two at a time): the backend says how much.
  const int64_t scratch = std::max(
      {static_cast<int64_t>(ops.attention_scratch_bytes(T, D)), static_cast<int64_t>(ops.layernorm_scratch_bytes(C)),
       static_cast<int64_t>(ops.rmsnorm_scratch_bytes(C)),
       static_cast<int64_t>(ops.lm_head_loss_scratch_bytes(chunk_rows, V)),
       qk_norm ? static_cast<int64_t>(ops.head_rmsnorm_scratch_bytes(D)) : int64_t{0},
       qk_full ? static_cast<int64_t>(ops.head_rmsnorm_scratch_bytes(mul({H, D}))) : int64_t{0}});
  const DType act = ops.dtype;
  const bool split = shared_bytes != nullptr;
  ArenaCursor arena{what, base, shared, plan, split};
  auto take = [&arena](const char* name, int64_t layer, int64_t count, DType dtype, bool transient = false) {
    return arena.take(name, layer, count, dtype, transient);
  };
  auto stat = [&arena](const char* name, int64_t layer, int64_t count, bool transient = false) {
    return arena.stat(name, layer, count, transient);
  };
  constexpr bool kPass = true;  // transient: a working buffer of one pass
  // Per layer: what the recompute mode keeps (none: everything; the layout of none is the layout
  // before recompute existed, entry for entry).
  const bool full = recompute == Recompute::Full, selective = recompute == Recompute::Selective;
  LayerActs unused{};
  auto layer = [&](int64_t l) -> LayerActs& { return m ? m->la_[static_cast<size_t>(l)] : unused; };
  const int64_t ME = moe ? cfg.num_local_experts : 0, MK = moe ? cfg.num_experts_per_tok : 0, NK = mul({N, MK});
  const int64_t FS = moe ? cfg.shared_expert_intermediate_size : 0;  // Arch::moe_shared_width
  for (int64_t l = 0; l < L; ++l) {
    LayerActs& a = layer(l);
    if (moe) layout_moe_acts(arena, a, l, N, C, F, ME, NK, FS, mul);
    if (full) {  // only the output, which is the next layer's (or the final norm's) input
      a.res2 = take("res2", l, mul({S, C}), act);
      continue;
    }
    if (!post_only) {
      if (!selective) a.ln1 = take("ln1", l, mul({S, C}), act);
      a.ln1_mean = stat("ln1_mean", l, S);
      a.ln1_rstd = stat("ln1_rstd", l, S);
    }
    a.qkv = take("qkv", l, mul({N, Q}), act);
    if (qk_any) {  // q and k before their norms, and the norms' rstd
      a.qk_saved = take("qk_saved", l, mul({N, H + KV, D}), act);
      a.qk_rstd = stat("qk_rstd", l, qk_full ? mul({N, 2}) : mul({N, H + KV}));
    }
    a.att = take("att", l, mul({N, H, D}), act);
    a.lse = stat("lse", l, mul({B, H, T}));
    if (sandwich_or_post) {  // the attention output before its norm, and the norm's rstd
      a.attn_out = take("attn_out", l, mul({S, C}), act);
      a.attn_out_rstd = stat("attn_out_rstd", l, S);
    }
    a.res1 = take("res1", l, mul({S, C}), act);
    if (!post_only) {
      if (!selective) a.ln2 = take("ln2", l, mul({S, C}), act);
      a.ln2_mean = stat("ln2_mean", l, S);
      a.ln2_rstd = stat("ln2_rstd", l, S);
    }
    if (!moe) a.fc = take("fc", l, mul({N, FF}), act);
    if (!selective && !moe) a.act = take("act", l, mul({N, F}), act);
    if (sandwich_or_post) {  // the MLP output before its norm, and the norm's rstd
      a.mlp_out = take("mlp_out", l, mul({S, C}), act);
      a.mlp_out_rstd = stat("mlp_out_rstd", l, S);
    }
    a.res2 = take("res2", l, mul({S, C}), act);
  }
  // The set shared by every layer: whichever layer runs (forward, or backward's recompute) writes it.
  if (full) {
    LayerActs s{};
    if (!post_only) {
      s.ln1 = take("shared.ln1", -1, mul({S, C}), act, kPass);
      s.ln1_mean = stat("shared.ln1_mean", -1, S, kPass);
      s.ln1_rstd = stat("shared.ln1_rstd", -1, S, kPass);
    }
    s.qkv = take("shared.qkv", -1, mul({N, Q}), act, kPass);
    if (qk_any) {
      s.qk_saved = take("shared.qk_saved", -1, mul({N, H + KV, D}), act, kPass);
      s.qk_rstd = stat("shared.qk_rstd", -1, qk_full ? mul({N, 2}) : mul({N, H + KV}), kPass);
    }
    s.att = take("shared.att", -1, mul({N, H, D}), act, kPass);
    s.lse = stat("shared.lse", -1, mul({B, H, T}), kPass);
    s.res1 = take("shared.res1", -1, mul({S, C}), act, kPass);
    if (!post_only) {
      s.ln2 = take("shared.ln2", -1, mul({S, C}), act, kPass);
      s.ln2_mean = stat("shared.ln2_mean", -1, S, kPass);
      s.ln2_rstd = stat("shared.ln2_rstd", -1, S, kPass);
    }
    s.fc = take("shared.fc", -1, mul({N, FF}), act, kPass);
    s.act = take("shared.act", -1, mul({N, F}), act, kPass);
    if (sandwich_or_post) {
      s.attn_out = take("shared.attn_out", -1, mul({S, C}), act, kPass);
      s.attn_out_rstd = stat("shared.attn_out_rstd", -1, S, kPass);
      s.mlp_out = take("shared.mlp_out", -1, mul({S, C}), act, kPass);
      s.mlp_out_rstd = stat("shared.mlp_out_rstd", -1, S, kPass);
    }
    for (int64_t l = 0; l < L; ++l) {
      LayerActs& a = layer(l);
      void* res2 = a.res2;
      a = s;
      a.res2 = res2;
    }
  } else if (selective) {
    // ln1 and ln2 are never needed at the same time: forward's qkv GEMM consumes ln1 before ln2 is
    // written, and backward recomputes ln1 only after the fc GEMM's backward has read ln2. So one
    // buffer holds both.
    void* ln = post_only ? nullptr : take("shared.ln", -1, mul({S, C}), act, kPass);
    void* mlp_act = take("shared.act", -1, mul({N, F}), act, kPass);
    for (int64_t l = 0; l < L; ++l) {
      LayerActs& a = layer(l);
      a.ln1 = a.ln2 = ln;
      a.act = mlp_act;
    }
  }
  void* sink = nullptr;
  float* fsink = nullptr;
  (m ? m->emb_ : sink) = take("emb", -1, mul({S, C}), act);
  (m ? m->lnf_ : sink) = take("lnf", -1, mul({NG, C}), act, kPass);  // gathered: the lm head's input
  (m ? m->lnf_mean_ : fsink) = stat("lnf_mean", -1, S, kPass);
  (m ? m->lnf_rstd_ : fsink) = stat("lnf_rstd", -1, S, kPass);
  (m ? m->losses_ : fsink) = stat("losses", -1, N, kPass);
  (m ? m->dres_ : sink) = take("dres", -1, mul({S, C}), act);
  (m ? m->dln_ : sink) = take("dln", -1, mul({N, C}), act, kPass);
  (m ? m->dqkv_ : sink) = take("dqkv", -1, mul({N, Q}), act, kPass);
  (m ? m->datt_ : sink) = take("datt", -1, mul({N, H, D}), act, kPass);
  if (!moe) {
    (m ? m->dfc_ : sink) = take("dfc", -1, mul({N, FF}), act, kPass);
    (m ? m->dact_ : sink) = take("dact", -1, mul({N, F}), act, kPass);
  } else {  // the MoE block's backward scratch and the balancing losses' router-logit gradient
    cpu::MoeShape ms;
    ms.N = N, ms.C = C, ms.F = F, ms.E = ME, ms.k = MK;
    (m ? m->moe_scratch_ : fsink) =
        stat("moe_scratch", -1, static_cast<int64_t>(cpu::moe_backward_scratch_floats(ms)), kPass);
    (m ? m->moe_dlogits_ : fsink) = stat("moe_dlogits", -1, mul({N, ME}), kPass);
    if (FS > 0)  // dy, dx [N, C], dz [N], the expert backward's 2 N Fs (moe_shared.cpp)
      (m ? m->moe_shared_scratch_ : fsink) = stat(
          "moe_shared_scratch", -1, checked_add(mul({2, N, C}), checked_add(N, mul({2, N, FS}), what), what), kPass);
  }
  if (sp) (m ? m->gathered_ : sink) = take("gathered", -1, mul({NG, C}), act, kPass);
  (m ? m->scratch_ : sink) = take("scratch", -1, scratch, DType::U8, kPass);
  // RoPE tables: one row per position a pass may hold (context parallelism: the whole sequence's).
  const int64_t RT = std::max(T, shard.context_T);
  (m ? m->rope_cos_ : fsink) = stat("rope_cos", -1, mul({RT, D}) / 2);
  (m ? m->rope_sin_ : fsink) = stat("rope_sin", -1, mul({RT, D}) / 2);
  if (m) m->chunk_rows_ = chunk_rows;
  if (plan) {
    plan->bytes = static_cast<size_t>(arena.off);
    plan->recompute = recompute;
    plan->shared_bytes = static_cast<size_t>(arena.soff);
  }
  if (split) *shared_bytes = static_cast<size_t>(arena.soff);
  return static_cast<size_t>(arena.off);
}

int64_t Model::activation_floats(const ModelConfig& cfg, int64_t B, int64_t T, Recompute recompute) {
  LATHE_CHECK(B >= 1 && T >= 1, "batch {} x seq_len {}: both must be >= 1", B, T);
  return static_cast<int64_t>(layout_activations(cfg, {}, B, T, ops_for(cpu_backend(), DType::F32), recompute, nullptr,
                                                 nullptr, nullptr)) /
         4;
}

ActivationPlan Model::plan_activations(const ModelConfig& cfg, int64_t B, int64_t T, const ComputeSpec& compute,
                                       Recompute recompute, const TensorShard& shard) {
  LATHE_CHECK(B >= 1 && T >= 1, "batch {} x seq_len {}: both must be >= 1", B, T);
  const Ops& ops = ops_for(compute.backend ? *compute.backend : cpu_backend(), compute.dtype);
  ActivationPlan plan;
  layout_activations(cfg, shard, B, T, ops, recompute, nullptr, nullptr, &plan);
  return plan;
}

void Model::allocate(int64_t B, int64_t T, int optimizer_moments, Recompute recompute, int64_t slots) {
  LATHE_CHECK(B >= 1 && T >= 1, "batch {} x seq_len {}: both must be >= 1", B, T);
  LATHE_CHECK(slots >= 1 && slots <= 4096, "activation slots {} must be in [1, 4096]", slots);
  LATHE_CHECK(params_.size() == table_.total() || table_.total() == 0,
              "model: allocate on a model built without parameters (ComputeSpec::parameters false)");
  LATHE_CHECK(!arch_.learned_pos || T <= cfg_.max_position_embeddings,
              "seq_len {} exceeds the model's max_position_embeddings {}", T, cfg_.max_position_embeddings);
  LATHE_CHECK(T <= kMaxPositions, "seq_len {} exceeds lathe's maximum {}", T, kMaxPositions);
  LATHE_CHECK(
      arch_.moe_experts == 0 || recompute == Recompute::None,
      "recompute: {}: a mixture-of-experts model ({}) does not support activation recompute yet; set recompute: "
      "none",
      recompute_name(recompute), cfg_.model_type);
  if (B == max_B_ && T == max_T_ && recompute == plan_.recompute && slots == slots_) return;
  // Before any allocation: refuse what cannot fit, with the figures (models/memory.h). The figures
  // are the host's: a device-resident model's allocations fail with the backend's error instead.
  if (!on_device())
    check_memory_fits(estimate_memory(cfg_, B, T, optimizer_moments, 1, ops_->dtype, recompute, shard_), cfg_, "model");
  // Several slots: [slot 0 | slot 1 | ... | the transient buffers, once].
  ActivationPlan plan;
  size_t shared = 0;
  const size_t per =
      layout_activations(cfg_, shard_, B, T, *ops_, recompute, nullptr, nullptr, &plan, slots > 1 ? &shared : nullptr);
  max_B_ = B;
  max_T_ = T;
  const int64_t total = checked_add(checked_mul(static_cast<int64_t>(per), slots, "activation slots x arena bytes"),
                                    static_cast<int64_t>(shared), "activation slots + shared buffers");
  acts_.resize(*backend_, static_cast<size_t>(total), DType::U8);
  plan_ = std::move(plan);
  slots_ = slots;
  la_.assign(static_cast<size_t>(cfg_.num_hidden_layers), {});
  if (on_device()) {  // per-pass ids in device memory (copied in by each pass)
    dtokens_.resize(*backend_, static_cast<size_t>(kIdSlots * B * T), DType::I32);
    dtargets_.resize(*backend_, static_cast<size_t>(kIdSlots * B * T), DType::I32);
    drop_staged_inputs();
    ddocs_.resize(*backend_, static_cast<size_t>(2 * B * T), DType::I32);
  }
  rope_len_.assign(static_cast<size_t>(slots), 0);
  for (int64_t i = slots - 1; i >= 0; --i) {  // every slot's RoPE tables; slot 0 current at the end
    use_slot(i);
    if (!arch_.learned_pos) build_rope_tables(T);
  }
}

// Tables [max_T_, rot/2] of the current slot, with the frequencies of a pass of seq_len tokens.
void Model::build_rope_tables(int64_t seq_len) {
  const RopeFrequencies f = rope_frequencies(cfg_, seq_len);
  ops_->rope_tables(rope_cos_, rope_sin_, std::max(max_T_, shard_.context_T), cfg_.rotary_dim() / 2, f.inv_freq.data(),
                    f.attention_factor);
  rope_len_[static_cast<size_t>(slot_)] = seq_len;
}

// Dynamic NTK: transformers recomputes the frequencies for a sequence longer than
// max_position_embeddings, from max(position_ids) + 1 (the pass length, or the longest document
// with positions restarting per document); all shorter ones share the plain tables. Called by the
// forward only: a slot's backward uses the tables of its forward. Under context parallelism the
// pass holds T = context_T / C rows of each sample: the scaling is chosen from the whole sequence
// (context_T, and set_documents' positions_len), as the single process chooses it.
void Model::rope_tables_for(int64_t T) {
  if (shard_.context_T > 0) T = shard_.context_T;
  if (cfg_.model_type == "phi3" && cfg_.rope_scaling.type == "longrope") {
    // Phi3LongRoPEScaledRotaryEmbedding (transformers 4.45.2): short or long factors by the pass
    // length T (its seq_len is the keys' length, whatever the position ids), rebuilt on a change.
    const int64_t P0 = cfg_.rope_scaling.config_original_max_position_embeddings.value_or(T);
    if ((T > P0) != (rope_len_[static_cast<size_t>(slot_)] > P0)) build_rope_tables(T);
    return;
  }
  if (cfg_.rope_scaling.type != "dynamic") return;
  const int64_t P = cfg_.max_position_embeddings;
  const int64_t L = doc_pos_.empty() ? T : doc_len_;
  if (std::max(L, P) != std::max(rope_len_[static_cast<size_t>(slot_)], P)) build_rope_tables(L);
}

void Model::use_slot(int64_t i) {
  LATHE_CHECK(i >= 0 && i < slots_ && max_B_ > 0, "activation slot {} of {} (allocated: {})", i, slots_, max_B_ > 0);
  slot_ = i;
  std::byte* base = static_cast<std::byte*>(acts_.data());
  size_t shared = 0;
  layout_activations(cfg_, shard_, max_B_, max_T_, *ops_, plan_.recompute, this,
                     base + static_cast<size_t>(i) * plan_.bytes, nullptr, slots_ > 1 ? &shared : nullptr,
                     base + static_cast<size_t>(slots_) * plan_.bytes);
}

void* Model::residual(int64_t l) {
  LATHE_CHECK(l >= 0 && l <= static_cast<int64_t>(la_.size()) && max_B_ > 0,
              "residual stream of layer {} (the model has {} layers; allocated: {})", l, la_.size(), max_B_ > 0);
  return const_cast<void*>(layer_input(l));
}

}  // namespace lathe
