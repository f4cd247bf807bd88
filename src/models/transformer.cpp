// The decoder body shared by every family: pre-norm blocks of attention + MLP with residuals.
// Arch switches select LayerNorm/RMSNorm, learned/rotary positions and GELU/SwiGLU MLPs.
// Every kernel call goes through the model's op table (ops_, kernels/backend.h): the body names no
// backend, and the CPU fp32 table runs the kernels of kernels/cpu/ops.h exactly as direct calls did.
// This file: construction, the parameter pointers and initialisation, and the passes. Where the
// buffers live is models/residency.cpp; the activation arena's layout is models/activations.cpp.
#include <fmt/format.h>

#include <algorithm>

#include "core/checked.h"
#include "core/rng.h"
#include "core/trace.h"
#include "kernels/backend.h"
#include "kernels/cpu/ops_bf16.h"
#include "models/memory.h"
#include "models/model.h"
#include "models/traced_ops.h"

namespace lathe {

namespace {
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace

Model::Model(ModelConfig cfg, Arch arch, ParamTable table, ComputeSpec compute)
    : cfg_(std::move(cfg)),
      arch_(arch),
      table_(std::move(table)),
      attention_kernel_(compute.attention_kernel),
      backend_(compute.backend ? compute.backend : &cpu_backend()),
      // Before any allocation: refuses a missing table. Traced: each kernel call is a profiler span
      // of its kind when profiling is on (models/traced_ops.h).
      ops_(&traced_ops(ops_for(*backend_, compute.dtype, compute.attention_kernel))),
      act_size_(static_cast<int64_t>(dtype_size(compute.dtype))) {
  // Host parameters and gradients: the model's memory on the CPU backend, the staging copies of a
  // device-resident model (whose kernels read dparams_ / dgrads_, allocated here once).
  const bool weights = compute.parameters, grads = compute.parameters && compute.gradients;
  if (weights) params_.resize(table_.total(), compute.touch_parameters);
  if (grads) grads_.resize(table_.total(), compute.touch_parameters);
  if (weights && compute.dtype != DType::F32)
    cweights_.resize(*backend_, table_.total(), compute.dtype, compute.touch_parameters);
  if (on_device() && weights) {
    dparams_.resize(*backend_, table_.total(), DType::F32);
    if (grads) dgrads_.resize(*backend_, table_.total(), DType::F32);
  }
  if (weights) p_ = resolve(backend_param_data());
  if (grads) g_ = resolve(backend_grad_data());
  // Per-layer sliding windows (ModelConfig::layer_window): one entry per layer of this model (a
  // pipeline stage's config holds its own layers' entries, parallel/pipeline_stage.cpp).
  LATHE_CHECK(cfg_.sliding_layers.empty() || static_cast<int64_t>(cfg_.sliding_layers.size()) == cfg_.num_hidden_layers,
              "internal: {} per-layer sliding-window entries (layer_types / max_window_layers) for {} layers",
              cfg_.sliding_layers.size(), cfg_.num_hidden_layers);
  // Which block's backward completes each tensor's gradient (StepHooks numbering).
  const int64_t L = cfg_.num_hidden_layers;
  auto block_of = [L](const ParamSpec& s) -> int64_t {
    return s.layer >= 0 ? s.layer + 1 : (s.role == Role::Wte || s.role == Role::Wpe) ? 0 : L + 1;
  };
  grad_ranges_by_block_.clear();
  for (int64_t block = 0; block < L + 2; ++block)
    grad_ranges_by_block_.push_back(table_.ranges([&](const ParamSpec& s) { return block_of(s) == block; }));
  check_moe_support();  // a MoE model anywhere but host fp32
  check_olmo2_support();
}

std::vector<std::vector<std::pair<size_t, size_t>>> Model::param_ranges_by_block() const {
  const int64_t L = cfg_.num_hidden_layers;
  auto block_of = [L](const ParamSpec& s) -> int64_t {
    return s.layer >= 0 ? s.layer + 1 : (s.role == Role::Wte || s.role == Role::Wpe) ? 0 : L + 1;
  };
  std::vector<std::vector<std::pair<size_t, size_t>>> out;
  for (int64_t block = 0; block < L + 2; ++block)
    out.push_back(table_.ranges([&](const ParamSpec& s) {
      return block_of(s) == block || (block == L + 1 && arch_.tied_lm_head && s.role == Role::Wte);
    }));
  return out;
}

void Model::set_tensor_shard(const TensorShard& shard) {
  LATHE_CHECK(max_B_ == 0, "internal: set_tensor_shard after allocate (the activation arena's layout depends on it)");
  LATHE_CHECK(shard.parts >= 1 && (shard.global_vocab == 0 || shard.global_vocab >= cfg_.vocab_size),
              "internal: tensor shard of {} parts over {} vocabulary rows for a model holding {}", shard.parts,
              shard.global_vocab, cfg_.vocab_size);
  shard_ = shard;
}

ModelPtrs Model::resolve(float* base) const {
  const int64_t L = cfg_.num_hidden_layers;
  const int64_t C = cfg_.hidden_size, Q = (cfg_.num_attention_heads + 2 * cfg_.num_key_value_heads) * cfg_.head_dim(),
                FF = arch_.gelu_mlp ? cfg_.intermediate_size : 2 * cfg_.intermediate_size;
  ModelPtrs m;
  m.layers.assign(static_cast<size_t>(L), {});
  // Where each role's pointer goes, and whether this Arch needs it (a role present but unused
  // would be ignored silently, so it is an error too).
  auto slot = [&](Role r, int64_t layer, bool* needed) -> float** {
    LayerPtrs* lp = layer >= 0 && layer < L ? &m.layers[static_cast<size_t>(layer)] : nullptr;
    *needed = true;
    switch (r) {
      case Role::Wte:
        *needed = arch_.embedding || (arch_.head && arch_.tied_lm_head);
        return layer < 0 ? &m.wte : nullptr;
      case Role::Wpe:
        *needed = arch_.learned_pos && arch_.embedding;
        return layer < 0 ? &m.wpe : nullptr;
      case Role::LnfW:
        *needed = arch_.head;
        return layer < 0 ? &m.lnf_w : nullptr;
      case Role::LnfB:
        *needed = arch_.layernorm && arch_.head;
        return layer < 0 ? &m.lnf_b : nullptr;
      case Role::LmHead:
        *needed = !arch_.tied_lm_head && arch_.head;
        return layer < 0 ? &m.lm_head : nullptr;
      case Role::Ln1W:
        *needed = arch_.pre_norm;
        return lp ? &lp->ln1_w : nullptr;
      case Role::Ln1B:
        *needed = arch_.layernorm;
        return lp ? &lp->ln1_b : nullptr;
      case Role::QkvW:
        return lp ? &lp->qkv_w : nullptr;
      case Role::QkvB:
        *needed = arch_.qkv_bias;
        return lp ? &lp->qkv_b : nullptr;
      case Role::OW:
        return lp ? &lp->o_w : nullptr;
      case Role::OB:
        *needed = arch_.o_bias;
        return lp ? &lp->o_b : nullptr;
      case Role::Ln2W:
        *needed = arch_.pre_norm;
        return lp ? &lp->ln2_w : nullptr;
      case Role::Ln2B:
        *needed = arch_.layernorm;
        return lp ? &lp->ln2_b : nullptr;
      case Role::FcW:
        *needed = arch_.moe_experts == 0;
        return lp ? &lp->fc_w : nullptr;
      case Role::FcB:
        *needed = arch_.mlp_bias;
        return lp ? &lp->fc_b : nullptr;
      case Role::ProjW:
        *needed = arch_.moe_experts == 0;
        return lp ? &lp->proj_w : nullptr;
      case Role::ProjB:
        *needed = arch_.mlp_bias;
        return lp ? &lp->proj_b : nullptr;
      case Role::QNormW:
        *needed = arch_.qk_norm || arch_.qk_norm_full;
        return lp ? &lp->q_norm_w : nullptr;
      case Role::KNormW:
        *needed = arch_.qk_norm || arch_.qk_norm_full;
        return lp ? &lp->k_norm_w : nullptr;
      case Role::PostAttnNormW:
        *needed = arch_.sandwich_norm;
        return lp ? &lp->post_attn_w : nullptr;
      case Role::PostFfnNormW:
        *needed = arch_.sandwich_norm;
        return lp ? &lp->post_ffn_w : nullptr;
      default:  // the router and experts (models/moe_layer.cpp), the shared expert (moe_shared.cpp), or no place
        if (moe_shared_role(r)) return moe_shared_slot(r, lp, arch_.moe_shared_width > 0, needed);
        return moe_slot(r, lp, arch_.moe_experts > 0, needed);
    }
  };
  // Fused groups (q|k|v, gate|up) are a role tensor followed by its Continues tensors: their
  // total size must be what the body reads as one GEMM operand.
  const ParamSpec* group = nullptr;
  int64_t group_numel = 0;
  auto close_group = [&]() {
    if (!group) return;
    int64_t want = -1;
    if (group->role == Role::QkvW) want = Q * C;
    if (group->role == Role::QkvB) want = Q;
    if (group->role == Role::FcW) want = FF * C;
    if (group->role == Role::ExpertW1 || group->role == Role::ExpertW3 || group->role == Role::ExpertW2)
      want = arch_.moe_experts * cfg_.intermediate_size * C;
    if (want >= 0 && group_numel != want)
      throw_error("model table: '{}' ({} of layer {}) and the tensors continuing it hold {} values; the body reads {}",
                  group->name, role_name(group->role), group->layer, group_numel, want);
    group = nullptr;
  };
  const ParamSpec* prev = nullptr;
  for (const ParamSpec& s : table_.specs()) {
    if (s.role == Role::Continues) {
      LATHE_CHECK(
          group && prev && prev->offset + static_cast<size_t>(prev->numel()) == s.offset && s.layer == group->layer,
          "model table: '{}' continues a fused tensor but does not directly follow one in its layer", s.name);
      group_numel += s.numel();
      prev = &s;
      continue;
    }
    close_group();
    prev = &s;
    if (s.role == Role::None) continue;
    bool needed = true;
    float** p = slot(s.role, s.layer, &needed);
    LATHE_CHECK(p != nullptr, "model table: '{}' has role {} with layer {}, which this body has no place for", s.name,
                role_name(s.role), s.layer);
    LATHE_CHECK(needed, "model table: '{}' has role {}, which this {} architecture does not use", s.name,
                role_name(s.role), cfg_.model_type);
    LATHE_CHECK(*p == nullptr, "model table: role {} of layer {} is given twice (second: '{}')", role_name(s.role),
                s.layer, s.name);
    *p = base + s.offset;
    if (s.role == Role::QkvW || s.role == Role::QkvB || s.role == Role::FcW || s.role == Role::ExpertW1 ||
        s.role == Role::ExpertW3 || s.role == Role::ExpertW2)
      group = &s, group_numel = s.numel();
  }
  close_group();
  // Every role this Arch needs must be present.
  auto require = [&](float* ptr, Role r, int64_t layer) {
    bool needed = true;
    float** unused = slot(r, layer, &needed);
    (void)unused;
    LATHE_CHECK(!needed || ptr != nullptr, "model table has no tensor with role {}{} ({} needs one)", role_name(r),
                layer >= 0 ? fmt::format(" for layer {}", layer) : std::string(), cfg_.model_type);
  };
  require(m.wte, Role::Wte, -1);
  require(m.wpe, Role::Wpe, -1);
  require(m.lnf_w, Role::LnfW, -1);
  require(m.lnf_b, Role::LnfB, -1);
  require(m.lm_head, Role::LmHead, -1);
  for (int64_t i = 0; i < L; ++i) {
    const LayerPtrs& l = m.layers[static_cast<size_t>(i)];
    const std::pair<float*, Role> roles[] = {{l.ln1_w, Role::Ln1W}, {l.ln1_b, Role::Ln1B},   {l.qkv_w, Role::QkvW},
                                             {l.qkv_b, Role::QkvB}, {l.o_w, Role::OW},       {l.o_b, Role::OB},
                                             {l.ln2_w, Role::Ln2W}, {l.ln2_b, Role::Ln2B},   {l.fc_w, Role::FcW},
                                             {l.fc_b, Role::FcB},   {l.proj_w, Role::ProjW}, {l.proj_b, Role::ProjB}};
    for (auto& [ptr, role] : roles) require(ptr, role, i);
    require(l.q_norm_w, Role::QNormW, i);
    require(l.k_norm_w, Role::KNormW, i);
    require(l.post_attn_w, Role::PostAttnNormW, i);
    require(l.post_ffn_w, Role::PostFfnNormW, i);
    const std::pair<float*, Role> moe[] = {{l.router_w, Role::RouterW},
                                           {l.exp_w1, Role::ExpertW1},
                                           {l.exp_w3, Role::ExpertW3},
                                           {l.exp_w2, Role::ExpertW2},
                                           {l.sh_w1, Role::SharedW1},  // qwen2_moe's shared expert
                                           {l.sh_w3, Role::SharedW3},
                                           {l.sh_w2, Role::SharedW2},
                                           {l.sh_gate_w, Role::SharedGateW}};
    for (auto& [ptr, role] : moe) require(ptr, role, i);
  }
  if (arch_.tied_lm_head) m.lm_head = m.wte;
  return m;
}

void init_param_values(const ParamSpec& s, uint64_t seed, float* p, int64_t from, int64_t to) {
  LATHE_CHECK(0 <= from && from <= to && to <= s.numel(), "internal: elements [{}, {}) of '{}' ({} elements)", from,
              to, s.name, s.numel());
  switch (s.init) {
    case Init::Zeros:
    case Init::Ones:
      std::fill(p, p + (to - from), s.init == Init::Ones ? 1.0f : 0.0f);
      break;
    case Init::Normal: {
      Rng rng(seed ^ fnv1a(s.name));
      for (int64_t i = 0; i < 2 * from; ++i) (void)rng.next_u64();  // Rng::normal draws two words
      for (int64_t i = from; i < to; ++i) p[i - from] = rng.normal() * s.init_std;
      break;
    }
  }
}

void init_param_values(const ParamSpec& s, uint64_t seed, float* p) { init_param_values(s, seed, p, 0, s.numel()); }

void Model::init_weights(uint64_t seed) {
  LATHE_CHECK(params_.size() == table_.total() || table_.total() == 0,
              "model: init_weights on a model built without parameters (ComputeSpec::parameters false)");
  for (const ParamSpec& s : table_.specs()) init_param_values(s, seed, params_.data() + s.offset);
  upload_params();
  refresh_compute_weights();
}

double Model::flops_per_token(int64_t T) const {
  double n = static_cast<double>(num_params());
  if (arch_.learned_pos && p_.wpe) n -= static_cast<double>(cfg_.max_position_embeddings * cfg_.hidden_size);
  // Mixture of experts: a token runs through k of the E experts of each layer (active parameters).
  if (arch_.moe_experts > 0)
    n -= static_cast<double>(cfg_.num_hidden_layers) * static_cast<double>(arch_.moe_experts - arch_.moe_top_k) * 3.0 *
         static_cast<double>(cfg_.hidden_size) * static_cast<double>(cfg_.intermediate_size);
  // Attention scores and their weighted sum: 12 x (heads x head_dim) per layer and key a position
  // attends to (T, or the window of a sliding layer; heads x head_dim is C unless head_dim is explicit).
  return 6.0 * n + 12.0 * static_cast<double>(cfg_.attention_width()) * cfg_.attention_keys_over_layers(T);
}

// Shapes used below (per micro-batch): N = B*T rows; C hidden; H query heads, KV key/value heads
// of D dims; Q = (H + 2KV) * D the fused q|k|v width; F the MLP width (FF = 2F for gate|up).
#define LATHE_DIMS                                                                                            \
  const int64_t N = B * T, C = cfg_.hidden_size, H = cfg_.num_attention_heads, KV = cfg_.num_key_value_heads, \
                D = cfg_.head_dim(), Q = (H + 2 * KV) * D, F = cfg_.intermediate_size,                        \
                FF = arch_.gelu_mlp ? F : 2 * F;                                                              \
  (void)N, (void)C, (void)H, (void)KV, (void)D, (void)Q, (void)F, (void)FF

// Profiler spans (src/core/trace.h; one relaxed load when profiling is off): one per block pass, the
// layer index as the span's arg, so a trace shows forward and backward per layer whoever drives the
// blocks (forward_backward, the pipeline schedules, forward_logits).
void Model::embedding_forward(const int32_t* tokens, int64_t B, int64_t T) {
  trace::Scope span("embedding forward", trace::Cat::Compute);
  LATHE_CHECK(B <= max_B_ && T <= max_T_, "batch {}x{} exceeds the allocated {}x{}", B, T, max_B_, max_T_);
  check_compute_weights();  // every pass starts here
  check_moe_support();
  if (arch_.moe_experts > 0) moe_begin_pass();
  LATHE_DIMS;
  const int64_t V = global_vocab();
  for (int64_t i = 0; i < N; ++i)
    LATHE_CHECK(tokens[i] >= 0 && tokens[i] < V, "token id {} at position {} is outside the vocabulary [0, {})",
                tokens[i], i, V);
  // With T below the allocated length the RoPE tables still hold positions 0..T-1 in their
  // first T rows, so they can be used as they are.
  check_documents_shape(B, T);
  const VocabParallel* vp = vocab_parallel();
  const int64_t vb = vp ? vp->vocab_begin : 0;
  const int64_t S = stream_rows(B, T, false);
  // Vocab parallel: each shard writes its tokens' rows (zeros for the others'), the shard holding
  // row 0 adds wpe, and the partial outputs are summed: exactly one wte row and one wpe row per
  // token, so the sum is the whole lookup (bit for bit in fp32 and for 16-bit tables).
  // Sequence parallelism: every rank looks up all N rows (into gathered_; the padding rows of a
  // pass whose N is not a multiple of tp are zeros) and keeps its own: the partial lookups of a
  // split vocabulary are reduce-scattered (the all-reduce's sums, on the rank's rows), a whole
  // vocabulary's rows are taken.
  const bool sp = seq_parallel();
  ops_->embedding_forward(sp ? gathered_ : emb_, to_backend(tokens, N, true, true), cw(p_.wte),
                          vb == 0 ? cw(p_.wpe) : nullptr, B, T, C, doc_positions(), vb, cfg_.vocab_size);
  const TpMappings& tp = hooks_.tp;
  if (!sp) {
    if (vp) tp.reduce_from_tensor_region_forward(emb_, N * C);
    if (arch_.embed_scale) scale_by_normalizer(emb_, N * C);  // gemma2
    return;
  }
  const int64_t pad = S * shard_.parts - N;
  if (pad > 0) backend_->memset(act_at(gathered_, N * C), 0, static_cast<size_t>(pad * C * act_size_));
  if (vp)
    tp.reduce_scatter_to_sequence_region_forward(gathered_, emb_, S * C);
  else
    tp.scatter_to_sequence_region_forward(gathered_, emb_, S * C);
  if (arch_.embed_scale) scale_by_normalizer(emb_, S * C);  // gemma2: this rank's rows
}

const VocabParallel* Model::vocab_parallel() const {
  if (hooks_.tp.vocab.all_reduce == nullptr) {
    LATHE_CHECK(global_vocab() == cfg_.vocab_size,
                "model: this model holds {} of the {} vocabulary rows (a tensor-parallel shard) but has no "
                "vocab-parallel reduction; attach it with parallel::attach_tensor_parallel",
                cfg_.vocab_size, global_vocab());
    return nullptr;
  }
  LATHE_CHECK(hooks_.tp.tensor_parallel(),
              "model: the vocab-parallel head needs the tensor-parallel all-reduce too (StepHooks::tp.comm)");
  return &hooks_.tp.vocab;
}

int64_t Model::stream_rows(int64_t B, int64_t T, bool backward) const {
  const int64_t N = B * T;
  if (!seq_parallel()) return N;
  LATHE_CHECK(backend_->device() == DeviceKind::Host,
              "sequence parallelism runs on host memory only for now (the {} backend's model is in device memory); "
              "set parallel.sequence: false",
              backend_->name());
  LATHE_CHECK(hooks_.tp.sequence_parallel(),
              "model: a sequence-parallel shard ({} parts) needs the row collectives of StepHooks::tp; "
              "parallel::attach_tensor_parallel installs them",
              shard_.parts);
  LATHE_CHECK(!backward || N % shard_.parts == 0,
              "sequence parallelism: batch {} x seq_len {} = {} rows do not split over {} tensor-parallel ranks; "
              "choose training.micro_batch_size x training.seq_len divisible by parallel.tensor = {}",
              B, T, N, shard_.parts, shard_.parts);
  return shard_.rows_held(N);
}

void Model::reduce_input_grad(int64_t N, int64_t S) {
  if (seq_parallel())
    hooks_.tp.gather_from_sequence_region_backward(dln_, dln_, S * cfg_.hidden_size);
  else if (hooks_.tp.tensor_parallel())
    hooks_.tp.copy_to_tensor_region_backward(dln_, N * cfg_.hidden_size);
}

void Model::norm_backward(void* dx, float* dw, float* db, const void* dout, const void* x, const float* w,
                          const float* mean, const float* rstd, int64_t rows) {
  const int64_t C = cfg_.hidden_size;
  if (!arch_.layernorm) w = norm_weight(w, C);  // gemma2's 1 + w (w itself otherwise)
  auto run = [&](int64_t r0, int64_t n, float* gw, float* gb) {
    if (arch_.layernorm)
      ops_->layernorm_backward(act_at(dx, r0 * C), gw, gb, act_at(dout, r0 * C), act_at(x, r0 * C), w, mean + r0,
                               rstd + r0, n, C, scratch_);
    else
      ops_->rmsnorm_backward(act_at(dx, r0 * C), gw, act_at(dout, r0 * C), act_at(x, r0 * C), w, rstd + r0, n, C,
                             scratch_);
  };
  const bool sp = seq_parallel();
  // The chunk sums are added on the host (norm_acc_): a model in device memory runs the kernel whole.
  const bool host = backend_->device() == DeviceKind::Host;
  const int64_t parts = sp || !host || shard_.parts <= 1 || rows % shard_.parts != 0 ? 1 : shard_.parts;
  if (!sp && parts == 1) {  // one process, or a tensor-parallel pass that does not split evenly
    run(0, rows, dw, db);
    return;
  }
  // The weight gradients of the pass's rows are summed on their own, then added once: with
  // sequence parallelism ((0 + rank 0's rows) + rank 1's rows) + ... by reduce_sequence_norm_grads (the
  // communicator sums in rank order), and without it the same chunks in the same order here, so
  // tensor parallelism with and without sequence parallelism give the same bits.
  const int64_t nw = arch_.layernorm ? 2 * C : C;
  norm_acc_.assign(static_cast<size_t>(nw), 0.0f);
  float* aw = norm_acc_.data();
  float* ab = arch_.layernorm ? aw + C : nullptr;
  const int64_t chunk = rows / parts;
  for (int64_t k = 0; k < parts; ++k) run(k * chunk, chunk, aw, ab);
  if (sp) hooks_.tp.reduce_sequence_norm_grads(aw, nw);
  for (int64_t c = 0; c < C; ++c) dw[c] += aw[c];
  if (db != nullptr && ab != nullptr)
    for (int64_t c = 0; c < C; ++c) db[c] += ab[c];
}

void Model::norm_forward(int64_t l, bool second, int64_t rows) {
  if (!arch_.pre_norm) return;  // olmo2: the GEMMs read the stream itself (block_input)
  const int64_t C = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.norm_eps);
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  LayerActs& a = la_[static_cast<size_t>(l)];
  // The MLP's norm reads x + attn, or with the parallel residual the layer input itself.
  const void* in = second && !arch_.parallel_residual ? a.res1 : layer_input(l);
  void* out = second ? a.ln2 : a.ln1;
  float* mean = second ? a.ln2_mean : a.ln1_mean;
  float* rstd = second ? a.ln2_rstd : a.ln1_rstd;
  if (arch_.layernorm)
    ops_->layernorm_forward(out, mean, rstd, in, second ? w.ln2_w : w.ln1_w, second ? w.ln2_b : w.ln1_b, rows, C, eps);
  else
    ops_->rmsnorm_forward(out, rstd, in, norm_weight(second ? w.ln2_w : w.ln1_w, C), rows, C, eps);
}

void Model::mlp_activation_forward(int64_t l, int64_t N) {
  const int64_t F = cfg_.intermediate_size;
  LayerActs& a = la_[static_cast<size_t>(l)];
  if (arch_.gelu_mlp && arch_.gelu_exact)
    ops_->gelu_erf_forward(a.act, a.fc, N * F);
  else if (arch_.gelu_mlp)
    ops_->gelu_forward(a.act, a.fc, N * F);
  else if (arch_.geglu)
    ops_->geglu_forward(a.act, a.fc, N, F);
  else
    ops_->swiglu_forward(a.act, a.fc, N, F);
}

void Model::layer_forward(int64_t l, int64_t B, int64_t T) {
  trace::Scope span("layer forward", trace::Cat::Compute, l);
  layer_forward_into(l, B, T, true);
}

void Model::layer_forward_into(int64_t l, int64_t B, int64_t T, bool output) {
  LATHE_DIMS;
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  LayerActs& a = la_[static_cast<size_t>(l)];
  // S rows of the residual stream here (N; this rank's with sequence parallelism, whose norm
  // outputs are gathered to the N rows the column-parallel GEMMs read).
  const bool sp = seq_parallel();
  const int64_t S = stream_rows(B, T, false);
  const TpMappings& tp = hooks_.tp;
  const void* x = layer_input(l);  // [S, C] residual stream in
  norm_forward(l, false, S);
  const void* in1 = block_input(l, false);  // ln1, or x without pre-norms
  ops_->matmul_forward(a.qkv, sp ? tp.gather_from_sequence_region_forward(in1, gathered_, S * C) : in1, cw(w.qkv_w),
                       w.qkv_b, N, C, Q, false);
  if (arch_.qk_norm || arch_.qk_norm_full) qk_norm_forward(l, N);
  if (!arch_.learned_pos) {
    rope_tables_for(T);
    const int64_t rot = cfg_.rotary_dim();
    ops_->rope_forward(a.qkv, rope_cos_, rope_sin_, B, T, H, D, rot, Q, doc_positions());
    ops_->rope_forward(act_at(a.qkv, H * D), rope_cos_, rope_sin_, B, T, KV, D, rot, Q, doc_positions());
  }
  if (hooks_.cp.active()) {
    check_context_attention();
    hooks_.cp.attention_forward(a.att, a.lse, a.qkv, doc_starts(), B, cfg_.layer_window(l));
  } else {
    ops_->attention_forward(a.att, a.lse, a.qkv, B, T, H, KV, D, scratch_, doc_starts(), cfg_.layer_window(l),
                            cfg_.attention_scale(), cfg_.attn_softcap());
  }
  if (arch_.sandwich_norm) {  // res1 = x + norm(o(attn)) (gemma2)
    row_parallel_forward(a.attn_out, a.att, w.o_w, w.o_b, N, H * D, C);
    post_norm_forward(a.res1, a.attn_out, a.attn_out_rstd, w.post_attn_w, x, S);
  } else {
    row_parallel_forward(a.res1, a.att, w.o_w, w.o_b, N, H * D, C);
    ops_->residual_forward(a.res1, a.res1, x, S * C);
  }
  norm_forward(l, true, S);
  if (arch_.moe_experts > 0) {  // res2 = res1 + moe(ln2) (models/moe_layer.cpp)
    moe_layer_forward(l, N);
    return;
  }
  const void* in2 = block_input(l, true);  // ln2, or res1 without pre-norms
  // GELU MLP: fc and its GELU in one op (CUDA: cuBLASLt's GELU epilogue; CPU: the same pair). Not
  // under selective recompute, which recomputes the activation alone (mlp_activation_forward) and
  // must reproduce the forward's bits. (The exact GELU has no fused form: fc, then its GELU.)
  if (arch_.gelu_mlp && !arch_.gelu_exact && plan_.recompute != Recompute::Selective)
    ops_->matmul_bias_gelu_forward(a.act, a.fc,
                                   sp ? tp.gather_from_sequence_region_forward(in2, gathered_, S * C) : in2, cw(w.fc_w),
                                   w.fc_b, N, C, FF);
  else {
    ops_->matmul_forward(a.fc, sp ? tp.gather_from_sequence_region_forward(in2, gathered_, S * C) : in2, cw(w.fc_w),
                         w.fc_b, N, C, FF, false);
    mlp_activation_forward(l, N);
  }
  // Backward reads nothing past the MLP activation, except the sandwich's MLP output and its norm
  // statistics (recomputed here: res2 is rewritten with the values it holds).
  if (!output && !arch_.sandwich_norm) return;
  if (arch_.sandwich_norm) {  // res2 = res1 + norm(mlp) (gemma2)
    row_parallel_forward(a.mlp_out, a.act, w.proj_w, w.proj_b, N, F, C);
    post_norm_forward(a.res2, a.mlp_out, a.mlp_out_rstd, w.post_ffn_w, a.res1, S);
    return;
  }
  row_parallel_forward(a.res2, a.act, w.proj_w, w.proj_b, N, F, C);
  ops_->residual_forward(a.res2, a.res2, a.res1, S * C);
}

void Model::row_parallel_forward(void* out, const void* in, const float* w, const float* bias, int64_t N, int64_t K,
                                 int64_t C) {
  if (seq_parallel()) {
    // Partial products of all N rows into gathered_ (padding rows zero), reduce-scattered into this
    // rank's S rows of `out`; the bias is added once, after the reduction.
    const int64_t S = shard_.rows_held(N), pad = S * shard_.parts - N;
    ops_->matmul_forward(gathered_, in, cw(w), nullptr, N, K, C, false);
    if (pad > 0) backend_->memset(act_at(gathered_, N * C), 0, static_cast<size_t>(pad * C * act_size_));
    hooks_.tp.reduce_scatter_to_sequence_region_forward(gathered_, out, S * C);
    if (bias) ops_->bias_add(out, bias, S, C);
    return;
  }
  if (!hooks_.tp.tensor_parallel()) {  // whole layer: the bias is fused into the GEMM
    ops_->matmul_forward(out, in, cw(w), bias, N, K, C, false);
    return;
  }
  ops_->matmul_forward(out, in, cw(w), nullptr, N, K, C, false);  // this rank's partial product
  hooks_.tp.reduce_from_tensor_region_forward(out, N * C);
  if (bias) ops_->bias_add(out, bias, N, C);
}

void Model::final_norm_forward(int64_t B, int64_t T) {
  LATHE_DIMS;
  const float eps = static_cast<float>(cfg_.norm_eps);
  const void* x = la_.empty() ? emb_ : la_.back().res2;
  // Sequence parallelism: the norm of this rank's rows (into gathered_, free here), all-gathered
  // into lnf_, the lm head's input.
  const bool sp = seq_parallel();
  const int64_t S = stream_rows(B, T, false);
  void* out = sp ? gathered_ : lnf_;
  if (arch_.layernorm)
    ops_->layernorm_forward(out, lnf_mean_, lnf_rstd_, x, p_.lnf_w, p_.lnf_b, S, C, eps);
  else
    ops_->rmsnorm_forward(out, lnf_rstd_, x, norm_weight(p_.lnf_w, C), S, C, eps);
  if (sp) hooks_.tp.gather_from_sequence_region_forward(gathered_, lnf_, S * C);
}

// Forward up to the final norm (logits and generation use it without the loss).
void Model::forward_body(const int32_t* tokens, int64_t B, int64_t T) {
  embedding_forward(tokens, B, T);
  for (int64_t l = 0; l < static_cast<int64_t>(la_.size()); ++l) layer_forward(l, B, T);
  final_norm_forward(B, T);
}

double Model::head_loss(const int32_t* targets, int64_t B, int64_t T, float grad_scale, bool backward) {
  trace::Scope span(backward ? "head forward+backward" : "head forward", trace::Cat::Compute);
  LATHE_CHECK(!backward || has_gradients(), "model: backward pass on a model built without gradients");
  LATHE_DIMS;
  const int64_t V = cfg_.vocab_size;  // this rank's rows under vocab parallelism
  final_norm_forward(B, T);
  // targets are range-checked by lm_head_loss
  float* dlm = arch_.tied_lm_head ? g_.wte : g_.lm_head;
  const VocabParallel* vp = vocab_parallel();
  double loss_sum = ops_->lm_head_loss(losses_, dln_, dlm, lnf_, cw(p_.lm_head), to_backend(targets, N, false), N, C, V,
                                       grad_scale, backward, scratch_, chunk_rows_, vp, cfg_.final_softcap());
  // Mixture of experts: the balancing losses join a training pass's loss (models/moe_layer.cpp).
  if (arch_.moe_experts > 0) {
    const double moe = moe_head_loss(targets, N, backward ? grad_scale : 0.0f);
    if (backward) loss_sum += moe;
  }
  if (!backward) return loss_sum;
  // Each vocab shard's dlogits @ w covers its vocabulary rows only: summed over the group (the head
  // is a column-parallel region; with sequence parallelism the backward of final_norm_forward's
  // gather: reduce-scattered into the rank's rows, a whole vocabulary's rows are taken).
  const int64_t S = stream_rows(B, T, true);
  const TpMappings& tp = hooks_.tp;
  if (seq_parallel()) {
    if (vp)
      tp.gather_from_sequence_region_backward(dln_, dln_, S * C);
    else
      tp.gather_from_sequence_region_backward_whole(dln_, dln_, S * C);
  } else if (vp) {
    tp.copy_to_tensor_region_backward(dln_, N * C);
  }
  // dres_ carries dL/d(residual stream) downwards; norms add into it.
  backend_->memset(dres_, 0, static_cast<size_t>(S * C * act_size_));
  const void* x_last = la_.empty() ? emb_ : la_.back().res2;
  norm_backward(dres_, g_.lnf_w, g_.lnf_b, dln_, x_last, p_.lnf_w, lnf_mean_, lnf_rstd_, S);
  return loss_sum;
}

void Model::layer_backward(int64_t l, int64_t B, int64_t T) {
  trace::Scope span("layer backward", trace::Cat::Compute, l);
  LATHE_CHECK(has_gradients(), "model: backward pass on a model built without gradients");
  LATHE_DIMS;
  const LayerPtrs& w = p_.layers[static_cast<size_t>(l)];
  const LayerPtrs& gw = g_.layers[static_cast<size_t>(l)];
  LayerActs& a = la_[static_cast<size_t>(l)];
  // Sequence parallelism: dres_, x, res1 and the norms hold this rank's S rows; the GEMMs' operands
  // of all N rows are gathered again here (Megatron does the same rather than keep them).
  const bool sp = seq_parallel();
  const int64_t S = stream_rows(B, T, true);
  const TpMappings& tp = hooks_.tp;
  // Recompute what the plan did not keep for this layer: the same kernels on the same kept inputs
  // as the forward pass, so the values (and all that follows) are bit-identical to keeping them.
  if (plan_.recompute == Recompute::Full) {
    layer_forward_into(l, B, T, false);
  } else if (plan_.recompute == Recompute::Selective) {
    norm_forward(l, true, S);  // ln2 from res1 (its statistics are rewritten with the same values)
    mlp_activation_forward(l, N);
  }
  // Attention's output projection reads d(res1): dres_ once ln2's gradient is added (sequential),
  // or with the parallel residual (res2 = x + o(...) + mlp(norm2(x))) dres_ as it is now, before
  // ln2's gradient goes to x.
  auto o_backward = [&] {
    const void* datt_out = dres_;
    if (arch_.sandwich_norm) {  // res1 = x + norm(o(attn)): d(o) into dln_ (ln2's backward is done with it)
      post_norm_backward(gw.post_attn_w, dres_, a.attn_out, w.post_attn_w, a.attn_out_rstd, S);
      datt_out = dln_;
    }
    ops_->matmul_backward(datt_, gw.o_w, gw.o_b,
                          sp ? tp.reduce_scatter_to_sequence_region_backward(datt_out, gathered_, S * C) : datt_out,
                          a.att, cw(w.o_w), N, H * D, C, false);
  };
  if (arch_.moe_experts > 0) {  // res2 = res1 + moe(ln2): d(ln2) into dln_ (models/moe_layer.cpp)
    moe_layer_backward(l, N);
  } else {
    // MLP: res2 = res1 + proj(act(fc(norm2(res1)))); gemma2: res1 + norm(proj(...)), whose d(proj)
    // goes to dln_ (free until the fc GEMM's backward writes it).
    const void* dmlp = dres_;
    if (arch_.sandwich_norm) {
      post_norm_backward(gw.post_ffn_w, dres_, a.mlp_out, w.post_ffn_w, a.mlp_out_rstd, S);
      dmlp = dln_;
    }
    ops_->matmul_backward(dact_, gw.proj_w, gw.proj_b,
                          sp ? tp.reduce_scatter_to_sequence_region_backward(dmlp, gathered_, S * C) : dmlp, a.act,
                          cw(w.proj_w), N, F, C, false);
    if (arch_.parallel_residual) o_backward();
    if (arch_.gelu_mlp && arch_.gelu_exact)
      ops_->gelu_erf_backward(dfc_, a.fc, dact_, N * F);
    else if (arch_.gelu_mlp)
      ops_->gelu_backward(dfc_, a.fc, dact_, N * F);
    else if (arch_.geglu)
      ops_->geglu_backward(dfc_, a.fc, dact_, N, F);
    else
      ops_->swiglu_backward(dfc_, a.fc, dact_, N, F);
    const void* in2 = block_input(l, true);  // ln2, or res1 without pre-norms
    ops_->matmul_backward(dln_, gw.fc_w, gw.fc_b, dfc_,
                          sp ? tp.gather_from_sequence_region_forward(in2, gathered_, S * C) : in2, cw(w.fc_w), N, C,
                          FF, false);
    reduce_input_grad(N, S);
  }
  block_input_backward(l, true, S);
  // Attention: res1 = x + o(attn(qkv(norm1(x))))
  if (!arch_.parallel_residual) o_backward();
  if (hooks_.cp.active())
    hooks_.cp.attention_backward(dqkv_, datt_, a.qkv, a.att, a.lse, doc_starts(), B, cfg_.layer_window(l));
  else
    ops_->attention_backward(dqkv_, datt_, a.qkv, a.att, a.lse, B, T, H, KV, D, scratch_, doc_starts(),
                             cfg_.layer_window(l), cfg_.attention_scale(), cfg_.attn_softcap());
  if (!arch_.learned_pos) {
    const int64_t rot = cfg_.rotary_dim();
    ops_->rope_backward(dqkv_, rope_cos_, rope_sin_, B, T, H, D, rot, Q, doc_positions());
    ops_->rope_backward(act_at(dqkv_, H * D), rope_cos_, rope_sin_, B, T, KV, D, rot, Q, doc_positions());
  }
  if (arch_.qk_norm || arch_.qk_norm_full) qk_norm_backward(l, N);
  // ln1 into the shared buffer, now that the fc GEMM's backward is done with ln2.
  if (plan_.recompute == Recompute::Selective) norm_forward(l, false, S);
  const void* in1 = block_input(l, false);
  ops_->matmul_backward(dln_, gw.qkv_w, gw.qkv_b, dqkv_,
                        sp ? tp.gather_from_sequence_region_forward(in1, gathered_, S * C) : in1, cw(w.qkv_w), N, C, Q,
                        false);
  reduce_input_grad(N, S);
  block_input_backward(l, false, S);
}

void Model::embedding_backward(const int32_t* tokens, int64_t B, int64_t T) {
  trace::Scope span("embedding backward", trace::Cat::Compute);
  LATHE_CHECK(has_gradients(), "model: backward pass on a model built without gradients");
  // dres_ is whole on every rank (sequence parallelism: gathered from every rank's rows): each
  // vocab shard adds its own rows of dwte; dwpe (replicated) is the same on every rank.
  // The backward of embedding_forward's way into the stream: a split vocabulary's rows were
  // reduce-scattered, a whole one's scattered (both all-gather the gradient).
  const VocabParallel* vp = vocab_parallel();
  const int64_t S = stream_rows(B, T, true), SC = S * cfg_.hidden_size;
  const TpMappings& tp = hooks_.tp;
  // gemma2: the embedding was scaled by sqrt(hidden); so is its
  // gradient (this rank's rows, before they are gathered).
  if (arch_.embed_scale) scale_by_normalizer(dres_, SC);
  const void* dout = !seq_parallel() ? dres_
                     : vp            ? tp.reduce_scatter_to_sequence_region_backward(dres_, gathered_, SC)
                                     : tp.scatter_to_sequence_region_backward(dres_, gathered_, SC);
  // phi3 and gemma2: transformers' Phi3Model / Gemma2Model build nn.Embedding(..., padding_idx=pad_token_id), whose
  // lookups of the pad token add no gradient to its row (a tied lm_head's still do): those tokens
  // are given an id outside the vocabulary, which the kernel skips.
  std::vector<int32_t> unpadded;
  if ((cfg_.model_type == "phi3" || cfg_.model_type == "gemma2") && cfg_.pad_token_id >= 0) {
    unpadded.assign(tokens, tokens + B * T);
    for (int32_t& t : unpadded)
      if (t == cfg_.pad_token_id) t = -1;
    tokens = unpadded.data();
  }
  ops_->embedding_backward(g_.wte, g_.wpe, dout, to_backend(tokens, B * T, true), B, T, cfg_.hidden_size,
                           doc_positions(), vp ? vp->vocab_begin : 0, cfg_.vocab_size);
}
#undef LATHE_DIMS

void Model::report_grads(int64_t block) {
  if (!hooks_.grads_ready) return;
  for (const auto& [b, e] : grad_ranges_by_block_[static_cast<size_t>(block)]) hooks_.grads_ready(b, e);
}

double Model::forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, float grad_scale,
                               bool backward) {
  const int64_t L = static_cast<int64_t>(la_.size());
  auto before = [&](int64_t block, bool bwd) {
    if (hooks_.before_block) hooks_.before_block(block, bwd);
  };
  before(0, false);
  embedding_forward(tokens, B, T);
  for (int64_t l = 0; l < L; ++l) {
    before(l + 1, false);
    layer_forward(l, B, T);
  }
  before(L + 1, false);
  const double loss_sum = head_loss(targets, B, T, grad_scale, backward);
  if (!backward) return loss_sum;
  report_grads(L + 1);
  for (int64_t l = L - 1; l >= 0; --l) {
    before(l + 1, true);
    layer_backward(l, B, T);
    report_grads(l + 1);
  }
  before(0, true);
  embedding_backward(tokens, B, T);
  report_grads(0);
  return loss_sum;
}

void Model::forward_logits(const int32_t* tokens, int64_t B, int64_t T, float* logits) {
  embedding_forward(tokens, B, T);
  for (int64_t l = 0; l < static_cast<int64_t>(la_.size()); ++l) layer_forward(l, B, T);
  head_logits(B, T, logits);
}

void Model::head_logits(int64_t B, int64_t T, float* logits) {
  final_norm_forward(B, T);
  // fp32 logits from the compute-dtype final norm output and lm head (fp32 accumulation).
  // One process on a device (never vocab parallel): into a device buffer, then to the host.
  if (on_device()) {
    const size_t n = static_cast<size_t>(B * T * cfg_.vocab_size);
    DeviceBuffer d(*backend_, n, DType::F32);
    ops_->logits_forward(static_cast<float*>(d.data()), lnf_, cw(p_.lm_head), B * T, cfg_.hidden_size, cfg_.vocab_size);
    backend_->copy(logits, d.data(), n * sizeof(float), CopyKind::DeviceToHost);
    backend_->synchronize();
    apply_final_softcap(cfg_, logits, B * T * cfg_.vocab_size);
    return;
  }
  if (!vocab_parallel()) {
    ops_->logits_forward(logits, lnf_, cw(p_.lm_head), B * T, cfg_.hidden_size, cfg_.vocab_size);
    apply_final_softcap(cfg_, logits, B * T * cfg_.vocab_size);
    return;
  }
  // Vocab parallel: this rank's columns [B*T, V_local], then every rank's gathered into [B*T, V].
  LATHE_CHECK(hooks_.tp.comm.gather_vocab != nullptr,
              "model: vocab-parallel logits need StepHooks::tp.comm.gather_vocab (gather_from_tensor_region)");
  std::vector<float> local(static_cast<size_t>(B * T * cfg_.vocab_size));
  ops_->logits_forward(local.data(), lnf_, cw(p_.lm_head), B * T, cfg_.hidden_size, cfg_.vocab_size);
  hooks_.tp.gather_from_tensor_region_forward(local.data(), logits, B * T, cfg_.vocab_size);
  apply_final_softcap(cfg_, logits, B * T * global_vocab());  // every shard's columns
}

void Model::forward_last_logits(const int32_t* tokens, int64_t B, int64_t T, float* logits) {
  forward_body(tokens, B, T);
  const int64_t C = cfg_.hidden_size, V = cfg_.vocab_size;
  const bool vp = vocab_parallel() != nullptr;
  LATHE_CHECK(!vp || hooks_.tp.comm.gather_vocab != nullptr,
              "model: vocab-parallel logits need StepHooks::tp.comm.gather_vocab (gather_from_tensor_region)");
  std::vector<float> local(vp ? static_cast<size_t>(B * V) : 0);
  if (on_device()) {  // as forward_logits: into a device buffer, then to the host
    DeviceBuffer d(*backend_, static_cast<size_t>(B * V), DType::F32);
    for (int64_t b = 0; b < B; ++b)
      ops_->logits_forward(static_cast<float*>(d.data()) + b * V, act_at(lnf_, (b * T + T - 1) * C), cw(p_.lm_head), 1,
                           C, V);
    backend_->copy(logits, d.data(), static_cast<size_t>(B * V) * sizeof(float), CopyKind::DeviceToHost);
    backend_->synchronize();
    apply_final_softcap(cfg_, logits, B * V);
    return;
  }
  for (int64_t b = 0; b < B; ++b)
    ops_->logits_forward(vp ? local.data() + b * V : logits + b * V, act_at(lnf_, (b * T + T - 1) * C), cw(p_.lm_head),
                         1, C, V);
  if (vp) hooks_.tp.gather_from_tensor_region_forward(local.data(), logits, B, V);
  apply_final_softcap(cfg_, logits, B * global_vocab());  // every shard's columns
}

}  // namespace lathe
