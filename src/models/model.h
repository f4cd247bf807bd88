// A decoder-only language model: parameters and gradients in flat buffers described by a
// ParamTable, activations preallocated for a maximum (B, T) in one arena described by an
// ActivationPlan, forward and backward built from the kernels of one backend op table
// (kernels/backend.h; CPU fp32 by default). Model code knows nothing of parallelism or optimizers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/buffer.h"
#include "kernels/backend.h"
#include "kernels/cpu/ops.h"  // MoeActs (mixture of experts)
#include "models/param_table.h"
#include "models/recompute.h"
#include "models/tensor_shard.h"
#include "models/tp_mappings.h"

namespace lathe {

// What distinguishes the families inside the shared transformer body.
struct Arch {
  bool layernorm = true;    // LayerNorm (with bias) vs RMSNorm
  bool learned_pos = true;  // wpe vs rotary
  bool gelu_mlp = true;     // GELU MLP (c_fc, c_proj) vs SwiGLU (gate|up, down)
  bool qkv_bias = true;
  bool o_bias = true;
  bool mlp_bias = true;
  bool tied_lm_head = true;
  // Per-head RMSNorm of q and k (weights [head_dim], Role::QNormW / KNormW) between the q|k|v GEMM
  // and RoPE (Qwen3); its backward between RoPE's backward and the GEMM's.
  bool qk_norm = false;
  // GPT-NeoX (use_parallel_residual): the MLP's norm reads the layer input x, not x + attn, so the
  // layer is x + attn(ln1(x)) + mlp(ln2(x)); false: the sequential pre-norm order.
  bool parallel_residual = false;
  // The GELU MLP's activation is the exact (erf) GELU (gelu_erf_*), not the tanh approximation.
  bool gelu_exact = false;
  // Gemma 2 (models/gemma2.cpp):
  //  * sandwich_norm: the attention output and the MLP output are RMSNormed before their residual
  //    adds (Role::PostAttnNormW, PostFfnNormW): res1 = x + n(o(attn)), res2 = res1 + n(mlp);
  //  * norm_weight_offset: every RMSNorm scales by (offset + w) (Gemma's 1 + w, weights zero-init);
  //  * geglu: the gate|up MLP's gate activation is the tanh GELU (geglu_*), not SiLU;
  //  * embed_scale: the embedding rows are multiplied by sqrt(hidden_size), rounded to the compute
  //    dtype as transformers' normalizer is (its backward scales the gradient likewise).
  bool sandwich_norm = false;
  float norm_weight_offset = 0.0f;
  bool geglu = false;
  bool embed_scale = false;
  // --- OLMo 2 (models/olmo2.cpp) ---
  //  * pre_norm false: no input / pre-MLP norms (no Role::Ln1W / Ln2W): the attention reads the
  //    layer input x and the MLP reads res1 themselves; with sandwich_norm the layer is
  //    res1 = x + n(o(attn(x))), res2 = res1 + n(mlp(res1)). Backward adds the GEMMs' input
  //    gradients straight into the residual stream's.
  //  * qk_norm_full: RMSNorm of each token's whole q projection (weight [H*D], Role::QNormW) and
  //    whole k projection ([KV*D], Role::KNormW) between the q|k|v GEMM and RoPE (Qwen3's qk_norm
  //    normalises each head on its own).
  bool pre_norm = true;
  bool qk_norm_full = false;
  // --- end OLMo 2 ---
  // A pipeline stage's model (src/parallel/pipeline_stage.h) may hold only part of the network:
  // without `embedding` its table has no wte/wpe (the residual stream enters layer 0 from outside,
  // residual(0)); without `head` no final norm / lm_head (the stream leaves after its last layer).
  // A tied wte is held whenever either is. The body itself knows nothing of pipelines.
  bool embedding = true;
  bool head = true;
  // ---- mixture of experts (issue 28; models/moe_layer.cpp, kernels/cpu/moe.cpp) ----
  // moe_experts > 0: every layer's MLP is a sparse MoE block (Role::RouterW, ExpertW1/W3/W2) of
  // that many SwiGLU experts, moe_top_k per token, scores softmax and the top-k weights divided by
  // their sum when moe_renormalize. moe_aux_loss_coef x the load-balancing loss over the pass's
  // layers and tokens (and moe_z_loss_coef x the mean router z-loss) join the loss.
  int64_t moe_experts = 0, moe_top_k = 0;
  bool moe_renormalize = true;
  float moe_aux_loss_coef = 0.0f, moe_z_loss_coef = 0.0f;
  // moe_shared_width > 0 (Qwen2-MoE; models/moe_shared.cpp): each MoE block also runs a shared
  // SwiGLU expert of that width on every token (Role::SharedW1/W3/W2) and adds its output times
  // sigmoid(x . g) (Role::SharedGateW, g [1, C]) to the routed output.
  int64_t moe_shared_width = 0;
  // ---- end mixture of experts ----
};

// Pointers to one layer's tensors inside a flat buffer (parameters or gradients).
struct LayerPtrs {
  float *ln1_w = nullptr, *ln1_b = nullptr;
  float *qkv_w = nullptr, *qkv_b = nullptr;  // [(H+2KV)*D, C], q|k|v contiguous
  float *o_w = nullptr, *o_b = nullptr;      // [C, H*D]
  float *ln2_w = nullptr, *ln2_b = nullptr;
  float *fc_w = nullptr, *fc_b = nullptr;               // gpt2: [F, C]; llama: gate|up [2F, C]
  float *proj_w = nullptr, *proj_b = nullptr;           // [C, F]
  float *q_norm_w = nullptr, *k_norm_w = nullptr;       // [D] each (Arch::qk_norm); [H*D], [KV*D] (qk_norm_full)
  float *post_attn_w = nullptr, *post_ffn_w = nullptr;  // [C] each (Arch::sandwich_norm)
  // Arch::moe_experts: router [E, C], experts' w1 / w3 [E, F, C] and w2 [E, C, F]
  float *router_w = nullptr, *exp_w1 = nullptr, *exp_w3 = nullptr, *exp_w2 = nullptr;
  // Arch::moe_shared_width (Fs): the shared expert's gate / up [Fs, C], down [C, Fs], its gate [1, C]
  float *sh_w1 = nullptr, *sh_w3 = nullptr, *sh_w2 = nullptr, *sh_gate_w = nullptr;
};
struct ModelPtrs {
  float *wte = nullptr, *wpe = nullptr, *lnf_w = nullptr, *lnf_b = nullptr, *lm_head = nullptr;
  std::vector<LayerPtrs> layers;
};

// Where a model computes: the backend and the compute dtype of its op table (kernels/backend.h).
// Parameters, gradients and optimizer state stay fp32 whatever the compute dtype.
struct ComputeSpec {
  const Backend* backend = nullptr;  // nullptr: cpu_backend()
  DType dtype = DType::F32;
  // false: no gradient buffer (a model that only holds weights: the whole model a tensor-parallel
  // run assembles for checkpoints and export); backward passes are then an error.
  bool gradients = true;
  // The attention slots' kernels: "lathe" (the table's own) or "cudnn" (cuDNN's fused SDPA; the
  // recipe's model.attention_kernel; kernels/backend.h's ops_for with a kernel).
  std::string attention_kernel = "lathe";
  // false: no parameter buffers either, only the table and the config (the whole model of a tensor
  // or pipeline parallel run, whose ranks each initialise or read their own share: no rank ever
  // holds every weight). param_data() is then null and every pass is an error.
  bool parameters = true;
  // false: the parameter and gradient buffers (and a bf16/fp16 weight copy) are reserved zeroed but
  // not made resident (core/buffer.h zero_untouched): a ZeRO 3 rank writes only its shard
  // (init_weights(seed, begin, end)), so its startup holds the shard, not the whole model.
  bool touch_parameters = true;
};

// One buffer of the activation arena: what it holds, how many elements of which dtype, and where.
// Activations and their gradients are in the compute dtype; norm statistics, attention's lse, the
// losses and the RoPE tables are fp32; the scratch is untyped bytes (U8).
struct ActivationEntry {
  const char* name;  // "ln1", "qkv", ..., "scratch"
  int64_t layer;     // decoder layer, or -1 for buffers of the whole model
  int64_t count;     // elements
  DType dtype;
  size_t offset;  // bytes from the start of the arena (64-byte aligned)
  // A working buffer of one pass (gradients of the layer being run, the head's buffers, the
  // scratch, recompute sets): nothing in it outlives the forward or backward call that writes it,
  // so an arena of several slots (Model::allocate) holds it once for all of them.
  bool transient = false;
  std::string label() const;  // "layers.3.qkv", "lnf_rstd"
};
// The arena's layout, in order: every buffer forward/backward use, from one walk (so the sizes the
// memory check reads are the sizes allocate() hands out).
// With recompute, buffers of one set shared by every layer have layer -1 and names "shared.*".
struct ActivationPlan {
  std::vector<ActivationEntry> entries;
  size_t bytes = 0;  // total, a multiple of 64 (a split layout: one slot's)
  Recompute recompute = Recompute::None;
  size_t shared_bytes = 0;  // a split layout (several slots): the transient entries' region
};

// Context parallelism (parallel/context_parallel.h, issue 27): the attention of this rank's rows
// across the context group, in place of the op table's attention. Host buffers of the model's
// compute dtype laid out as Ops::attention_*'s for this rank's B x T rows (qkv [B, T, (H + 2 KV) D],
// out [B, T, H D]; lse [B, H, T] fp32); doc_start: the rows' GLOBAL document starts (set_documents)
// or nullptr; window: the layer's sliding window (0 = none). The model's TensorShard::context_T is
// the whole sequence.
struct ContextHooks {
  std::function<void(void* out, float* lse, const void* qkv, const int32_t* doc_start, int64_t B, int64_t window)>
      attention_forward;
  std::function<void(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                     const int32_t* doc_start, int64_t B, int64_t window)>
      attention_backward;
  bool active() const { return static_cast<bool>(attention_forward); }
};

// Expert parallelism (parallel/expert_parallel.h, issue 28): the MoE block of layer `layer` with its
// experts spread over an expert group, in place of cpu::moe_forward / moe_backward (same arguments
// and contracts; the rows of each token's k choices travel to the rank owning the expert).
struct ExpertHooks {
  std::function<void(float* out, const cpu::MoeActs& a, const float* x, const float* wr, const float* w1,
                     const float* w3, const float* w2, const cpu::MoeShape& s, int64_t layer)>
      forward;
  std::function<void(float* dx, float* dwr, float* dw1, float* dw3, float* dw2, const float* dout,
                     const float* dlogits_add, const cpu::MoeActs& a, const float* x, const float* wr, const float* w1,
                     const float* w3, const float* w2, const cpu::MoeShape& s, float* scratch, int64_t layer)>
      backward;
  bool active() const { return static_cast<bool>(forward); }
};

// Called by the model at fixed points of a pass (all optional). Parallelism, recompute and
// pipeline schedules attach here from outside; the model itself knows nothing of them.
struct StepHooks {
  // Before block `block` runs forward or backward: 0 = embedding, 1..L = decoder layers, L+1 = head.
  std::function<void(int64_t block, bool backward)> before_block;
  // The gradients in [begin, end) of the flat buffer are complete for this backward pass (every
  // tensor is reported once, after the last block that adds to it: a tied wte after the embedding).
  std::function<void(size_t begin, size_t end)> grads_ready;
  // Tensor and sequence parallelism (parallel/tensor_parallel.h): the group's collectives and the
  // vocabulary shard, called as the named forward/backward pairs of models/tp_mappings.h.
  // Unset: the layers are whole.
  TpMappings tp;
  // Context parallelism: unset, attention runs over the pass's own rows.
  ContextHooks cp;
  // Expert parallelism: unset, every expert runs here.
  ExpertHooks ep;
};

// The initial values of one tensor of the table (what Model::init_weights writes at s.offset):
// its own stream seeded by (seed, s.name), so a tensor-parallel shard can take its slice of
// exactly the values one process would have.
void init_param_values(const ParamSpec& s, uint64_t seed, float* out);
// Elements [from, to) of the tensor only (out[0] is element `from`): the same values, the stream
// advanced past the first `from` draws (two 64-bit draws per normal element).
void init_param_values(const ParamSpec& s, uint64_t seed, float* out, int64_t from, int64_t to);

class Model {
 public:
  // Finds every tensor the Arch needs by role in the table; a missing or duplicated required role
  // is an error naming the role and layer (a misspelt bias cannot be dropped silently).
  // The op table is looked up here: a (backend, dtype) without a complete table is an error naming
  // the missing op and the implemented dtypes, before anything is allocated.
  Model(ModelConfig cfg, Arch arch, ParamTable table, ComputeSpec compute = {});

  const ModelConfig& config() const { return cfg_; }
  // A tensor-parallel shard's model: the whole vocabulary, the degree and sequence parallelism
  // (models/tensor_shard.h; whole model by default). Set by the tensor-parallel code before
  // allocate() (error after: the arena's layout depends on it).
  const TensorShard& tensor_shard() const { return shard_; }
  void set_tensor_shard(const TensorShard& shard);
  // The vocabulary token ids and targets range over (the config's vocab_size but in a vocab shard).
  int64_t global_vocab() const { return shard_.vocab(cfg_); }
  const Arch& arch() const { return arch_; }
  const ParamTable& params() const { return table_; }
  const Backend& backend() const { return *backend_; }
  const Ops& ops() const { return *ops_; }
  DType compute_dtype() const { return ops_->dtype; }
  // How a model like this one computes (backend, dtype, attention kernel), with gradients: what
  // the shards and stages built from a whole model use (parallel/model_parallel.h).
  ComputeSpec compute_spec() const { return ComputeSpec{backend_, compute_dtype(), true, attention_kernel_}; }
  size_t num_params() const { return table_.total(); }
  // The fp32 master of every tensor by role, resolved from the table (incremental decoding,
  // models/kv_cache.h), and the weight a kernel of the op table reads for one of them.
  const ModelPtrs& weights() const { return p_; }
  const void* compute_weight(const float* master) const { return cw(master); }
  void verify_compute_weights() const { check_compute_weights(); }  // what every forward pass checks first
  // Host memory. On a backend with its own memory (CUDA) these are the host staging copies (init,
  // HF load, checkpoints, export): upload_params() after writing them, download_params() /
  // download_grads() before reading them; the kernels use the backend copies below.
  float* param_data() { return params_.data(); }
  const float* param_data() const { return params_.data(); }
  float* grad_data() { return grads_.data(); }  // nullptr when built without gradients (ComputeSpec)
  bool has_gradients() const { return grads_.size() > 0; }
  void zero_grad() {
    if (on_device())
      dgrads_.zero();
    else
      grads_.zero();
  }
  // Device-resident models (backend memory is not host memory): parameters, gradients, the weight
  // copies and the activations live in backend memory, allocated once; param_data()/grad_data()
  // are host staging. On the CPU backend the backend buffers ARE param_data()/grad_data() and the
  // transfers below do nothing (the CPU path is unchanged).
  bool on_device() const { return backend_->device() != DeviceKind::Host; }
  float* backend_param_data() { return on_device() ? static_cast<float*>(dparams_.data()) : params_.data(); }
  float* backend_grad_data() { return on_device() ? static_cast<float*>(dgrads_.data()) : grads_.data(); }
  void upload_params();    // param_data() -> backend (then refresh_compute_weights() as after any write)
  void download_params();  // backend -> param_data()
  void download_grads();   // backend -> grad_data()
  float* param(const std::string& name) { return params_.data() + table_.at(name).offset; }
  float* grad(const std::string& name) { return grads_.data() + table_.at(name).offset; }

  // Deterministic init: each tensor draws from its own stream seeded by (seed, name), so the
  // values do not depend on the thread count or on the order tensors sit in the buffer.
  // Refreshes the compute-dtype weight copies.
  void init_weights(uint64_t seed);
  // Only the elements [begin, end) of the flat buffer, with exactly the values init_weights gives
  // them (each tensor's stream is advanced past the elements before the range; ZeRO 3's shard).
  // Refreshes the compute copies of keep_compute_weights' range.
  void init_weights(uint64_t seed, size_t begin, size_t end);

  // Compute-dtype copies of the weights (bf16/fp16 models; fp32 models read the masters and this
  // is a no-op). The GEMM and embedding kernels of a 16-bit table read one DeviceBuffer of the
  // compute dtype laid out as the ParamTable (same offsets), rounded from the fp32 masters here.
  // Whoever writes the masters calls it before the next forward: the trainer after every
  // optimizer step and after loading a checkpoint; init_weights and load_hf_weights call it.
  // Forward refuses copies that were never refreshed, and compares a fixed sample of elements
  // with the masters (cheap: kWeightSamples conversions), naming a tensor whose copy is stale.
  void refresh_compute_weights();
  // Bytes of the weight copies (0 for fp32).
  size_t compute_weight_bytes() const { return cweights_.bytes(); }
  // ZeRO 3 (parallel/param_gather.h; host models): the copies of [begin, end) of the flat buffer
  // only (the weights this rank owns) are kept current between passes; the others are converted
  // block by block as their fp32 weights are gathered (refresh_compute_weights(begin, end) per
  // block range) and their pages handed back with them. From here refresh_compute_weights()
  // converts [begin, end) and the forward's stale-copy check samples that range.
  void keep_compute_weights(size_t begin, size_t end);
  // The copies of [begin, end) from the fp32 weights (host models; a no-op for fp32).
  void refresh_compute_weights(size_t begin, size_t end);
  void* compute_weight_data() { return cweights_.size() ? cweights_.data() : nullptr; }

  // Preallocates every activation for up to B x T tokens. Called once before training;
  // forward/backward never allocate. First checks (models/memory.h) that parameters, gradients,
  // `optimizer_moments` fp32 copies of the parameters (the trainer passes 2 for AdamW/LAMB) and the
  // activations fit the machine, and refuses with the figures otherwise.
  // `recompute` (models/recompute.h) chooses what the arena keeps per layer; whatever it is,
  // losses, gradients and the StepHooks calls are the same, bit for bit and in order.
  // `slots` > 1 reserves that many arenas of the same layout (a pipeline stage keeps the
  // activations of several micro-batches at once); use_slot(i) points every pass at arena i. The
  // transient buffers (ActivationEntry::transient: gradients, scratch, head) exist once, shared
  // by the slots.
  void allocate(int64_t B, int64_t T, int optimizer_moments = 0, Recompute recompute = Recompute::None,
                int64_t slots = 1);
  void use_slot(int64_t i);
  int64_t slots() const { return slots_; }
  // In the current slot: the residual stream [B*T, C] (compute dtype) entering decoder layer l
  // (l = 0: the embeddings' output; l = L: the last layer's output, the final norm's input), and
  // dL/d(residual stream) [B*T, C], which head_loss starts and each layer_backward(l) turns into
  // the gradient of layer l's input. Pipeline stages read and write them around the block passes.
  void* residual(int64_t l);
  void* residual_grad() { return dres_; }
  Recompute recompute() const { return plan_.recompute; }
  int64_t max_batch() const { return max_B_; }
  int64_t max_seq() const { return max_T_; }

  // tokens/targets [B, T] (targets < 0 are ignored). Returns the SUM of token losses.
  // With backward, gradients ACCUMULATE into grad_data() scaled by grad_scale (pass 1 / number of
  // target tokens of the whole global batch, so micro-batches add up to the mean loss).
  // Composes the per-block passes below and calls the hooks.
  double forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, float grad_scale,
                          bool backward);
  // Device-resident models: starts the upload of a coming pass's token ids and targets (host [n]
  // each; either may be nullptr) through the backend's staging (Backend::stage_upload: pinned ring,
  // copy stream), so that the copy overlaps the work issued before that pass: the trainer stages
  // micro-batch i+1 before running micro-batch i. The host arrays must stay unchanged until that
  // pass has run or drop_staged_inputs(). A pass whose tokens (targets) pointer and length match a
  // staged array uses its device copy (its compute waits for the copy, the host does not); other
  // passes upload their own ids the same way. Both do nothing on host-memory models.
  void stage_inputs(const int32_t* tokens, const int32_t* targets, int64_t n);
  void drop_staged_inputs();
  // The flat parameter ranges each block's passes read (StepHooks numbering; a tied wte in the
  // embedding's and the head's): what a ZeRO 3 run gathers before a block (parallel/param_gather.h).
  std::vector<std::vector<std::pair<size_t, size_t>>> param_ranges_by_block() const;
  void set_hooks(StepHooks hooks) { hooks_ = std::move(hooks); }
  StepHooks& hooks() { return hooks_; }
  const StepHooks& hooks() const { return hooks_; }

  // Documents packed in the samples of the following passes (models/documents.h builds both arrays
  // from EOD tokens): doc_start [B, T] makes attention document-causal (token t of row b sees keys
  // [doc_start[b,t], t]; nullptr: plain causal), positions [B, T] replace 0..T-1 for the learned
  // position embedding and RoPE (nullptr: 0..T-1; each must be in [0, t]). Both are copied and stay
  // in force until the next call; a pass of another B x T while they are set is an error.
  // set_documents(nullptr, nullptr, 0, 0) returns to plain causal attention.
  // positions_len: max(positions) + 1 over the WHOLE samples, which dynamic NTK RoPE scaling reads
  // (a context-parallel rank holds some rows only, so the caller gives it; 0: from these rows).
  // (Defined in models/documents.cpp.)
  void set_documents(const int32_t* doc_start, const int32_t* positions, int64_t B, int64_t T,
                     int64_t positions_len = 0);

  // Per-block passes over the activations of (B, T) (block numbering as in StepHooks). Forward
  // runs embedding, layers 0..L-1, head_loss in order; backward the reverse, after head_loss with
  // backward = true. Gradients accumulate (+=).
  void embedding_forward(const int32_t* tokens, int64_t B, int64_t T);
  void layer_forward(int64_t l, int64_t B, int64_t T);
  // Final norm, lm head and loss: returns the SUM of token losses; with backward also the head's
  // gradients and d(final norm input), the start of layer_backward(L-1).
  double head_loss(const int32_t* targets, int64_t B, int64_t T, float grad_scale, bool backward);
  void layer_backward(int64_t l, int64_t B, int64_t T);
  void embedding_backward(const int32_t* tokens, int64_t B, int64_t T);
  // logits [B, T, V] of every position (tests and parity checks; V = global_vocab()).
  void forward_logits(const int32_t* tokens, int64_t B, int64_t T, float* logits);
  // The head's part of forward_logits: the final norm of residual(L) and the logits [B, T, V]
  // (a pipeline's last stage, after its layers; collective over the tensor group when vocab parallel).
  void head_logits(int64_t B, int64_t T, float* logits);
  // logits [B, V] of the last position only (generation).
  void forward_last_logits(const int32_t* tokens, int64_t B, int64_t T, float* logits);

  size_t activation_bytes() const { return acts_.bytes(); }
  // The layout allocate() made (empty before).
  const ActivationPlan& activation_plan() const { return plan_; }
  // Parameters + gradients + activations + scratch (optimizer state is the trainer's).
  size_t estimated_bytes() const { return 2 * params_.bytes() + acts_.bytes() + cweights_.bytes(); }

  // Floats (4-byte units) of the activation arena allocate(B, T) reserves for `cfg` computing in
  // CPU fp32 (the same layout walk); overflow-checked, throws lathe::Error for sizes beyond 64 bits.
  static int64_t activation_floats(const ModelConfig& cfg, int64_t B, int64_t T, Recompute recompute = Recompute::None);
  // The arena's layout for `cfg` (a shard's: with `shard`) at (B, T) computing with `compute`:
  // entries and total bytes.
  static ActivationPlan plan_activations(const ModelConfig& cfg, int64_t B, int64_t T, const ComputeSpec& compute = {},
                                         Recompute recompute = Recompute::None, const TensorShard& shard = {});

  // Mixture of experts (Arch::moe_experts): the last pass's load-balancing loss (over its layers
  // and tokens, transformers' load_balancing_loss_func) and mean router z-loss, unweighted, and
  // the target count the pass's loss sum weighted them by (head_loss adds
  // n x (aux_coef x aux + z_coef x z) to the returned sum). NaN / 0 before a pass with a loss.
  double moe_aux_loss() const { return moe_aux_; }
  double moe_z_loss() const { return moe_z_; }
  int64_t moe_loss_targets() const { return moe_targets_; }

  // 6*N + 12*L*(H*D)*T FLOP per token (N excludes position embeddings; H*D = C unless head_dim is
  // explicit), the convention of the bench.
  double flops_per_token(int64_t T) const;

 private:
  void forward_body(const int32_t* tokens, int64_t B, int64_t T);
  void final_norm_forward(int64_t B, int64_t T);
  void report_grads(int64_t block);
  // Layer l's forward from its input x into `a`; without `output` it stops before the output
  // projection (res2), which is all backward reads: the recompute of Recompute::Full.
  void layer_forward_into(int64_t l, int64_t B, int64_t T, bool output);
  // Norm forward of layer l over `rows` rows of the stream (second = ln2 from res1, else ln1 from
  // the layer input): the forward pass and the recompute of Recompute::Selective call the same code.
  void norm_forward(int64_t l, bool second, int64_t rows);
  // LayerNorm / RMSNorm backward over `rows` rows: dx += (rows x C), weight (and bias) gradients
  // added to dw (db). Tensor-parallel shards sum the weight gradients in TensorShard::parts row
  // chunks (sequence parallelism: this rank's rows, then reduce_sequence_norm_grads), see
  // TensorShard::parts.
  void norm_backward(void* dx, float* dw, float* db, const void* dout, const void* x, const float* w, const float* mean,
                     const float* rstd, int64_t rows);
  // Sequence parallelism is on (TensorShard::sequence_parallel with parts > 1).
  bool seq_parallel() const { return shard_.seq_parallel(); }
  // Rows of the stream a pass over B x T holds (N, or this rank's S with sequence parallelism);
  // checks the row hooks are installed, and with `backward` that TensorShard::parts divides B*T.
  int64_t stream_rows(int64_t B, int64_t T, bool backward) const;
  // The input gradient of a column-parallel GEMM in dln_ [N, C]: copy_to_tensor_region's backward
  // (an all-reduce), with sequence parallelism gather_from_sequence_region's (a reduce-scatter into
  // dln_'s first S rows).
  void reduce_input_grad(int64_t N, int64_t S);
  // GELU / SwiGLU of layer l's MLP pre-activation (fc -> act).
  void mlp_activation_forward(int64_t l, int64_t N);
  // Arch::qk_norm: the per-head q and k RMSNorms of layer l in place on a.qkv (forward), and their
  // backward in place on dqkv_ (weight gradients summed over the tensor group's heads).
  void qk_norm_forward(int64_t l, int64_t N);
  void qk_norm_backward(int64_t l, int64_t N);
  // Gemma 2's body options (models/gemma2.cpp). norm_weight: the weights an RMSNorm kernel reads,
  // w itself, or with Arch::norm_weight_offset offset + w in norm_w_ (valid until the next call).
  const float* norm_weight(const float* w, int64_t n);
  // Arch::sandwich_norm: out = RMSNorm(in) with weight w (rstd saved), then out += residual; its
  // backward: d(in) into dln_ (overwritten) from dout (the residual stream's gradient, unchanged).
  void post_norm_forward(void* out, const void* in, float* rstd, const float* w, const void* residual, int64_t rows);
  void post_norm_backward(float* dw, const void* dout, const void* in, const float* w, const float* rstd, int64_t rows);
  // Arch::embed_scale: rows [0, n) of x (compute dtype, backend memory) times sqrt(hidden_size) rounded to
  // the compute dtype: the embedding's forward and, on its gradient, its backward.
  void scale_by_normalizer(void* x, int64_t n) const;
  // ---- mixture of experts (models/moe_layer.cpp) ----
  // resolve()'s place for a MoE role (router, experts' w1 / w3 / w2) in `lp` (nullable), needed when
  // `moe`; nullptr for any other role.
  static float** moe_slot(Role r, LayerPtrs* lp, bool moe, bool* needed);
  // The shared expert's roles (models/moe_shared.cpp): its place in `lp`, needed when `shared`.
  static bool moe_shared_role(Role r);
  static float** moe_shared_slot(Role r, LayerPtrs* lp, bool shared, bool* needed);
  // Arch::moe_shared_width: out[N,C] += sigmoid(ln2 . g) x shared_expert(ln2) of layer l (forward,
  // saving what the backward reads), and its backward: dln_ += the input gradient from dres_, the
  // shared weights' gradients +=.
  void moe_shared_forward(int64_t l, int64_t N, float* out);
  void moe_shared_backward(int64_t l, int64_t N);
  // Where a MoE model runs (host fp32, one process or data parallel): throws naming the key.
  void check_moe_support() const;
  // Layer l's MoE block: res2 = res1 + moe(ln2) (load statistics of the pass accumulated), and its
  // backward: d(ln2) into dln_ (overwritten) from dres_, the router's aux / z-loss gradients added.
  void moe_layer_forward(int64_t l, int64_t N);
  void moe_layer_backward(int64_t l, int64_t N);
  // Start of a pass: zero the load statistics. head_loss: the pass's aux / z losses and their
  // weight n x grad_scale (n = the micro-batch's targets); returns what joins the loss sum.
  void moe_begin_pass();
  double moe_head_loss(const int32_t* targets, int64_t N, float grad_scale);
  // OLMo 2's options (Arch::pre_norm false, qk_norm_full) run on host memory (models/olmo2.cpp);
  // throws naming what is missing otherwise.
  void check_olmo2_support() const;
  // The input a column-parallel GEMM of layer l reads: the norm's output (ln1 / ln2), or without
  // pre-norms the stream itself (x / res1). And the backward of that norm: its gradient from dln_
  // added into dres_ (without pre-norms dln_ itself is added).
  const void* block_input(int64_t l, bool second) const;
  void block_input_backward(int64_t l, bool second, int64_t S);
  // Arch::qk_norm_full under tensor parallelism (host memory): one norm (q or k) of N tokens whose
  // rows this rank holds W of `full` elements of, the sums reduced over the tensor group.
  void qk_norm_full_tp_forward(void* x, void* saved, float* rstd, const float* w, int64_t N, int64_t W, int64_t full,
                               int64_t stride);
  void qk_norm_full_tp_backward(void* dx, float* dw, const void* saved, const float* w, const float* rstd, int64_t N,
                                int64_t W, int64_t full, int64_t stride);
  // out[N, C] = in[N, K] @ w^T (+ bias): a GEMM whose input features may be split over
  // tensor-parallel ranks (reduce_from_tensor_region / reduce_scatter_to_sequence_region sum the
  // partial products before the bias).
  void row_parallel_forward(void* out, const void* in, const float* w, const float* bias, int64_t N, int64_t K,
                            int64_t C);
  // The residual stream entering layer l ([N, C]: the embeddings or layer l-1's output).
  const void* layer_input(int64_t l) const { return l == 0 ? emb_ : la_[static_cast<size_t>(l) - 1].res2; }
  // The activation arena's layout: returns its size in bytes; with `plan` also lists the entries;
  // with `m` also points m's activations into `base` (m->la_ sized to the layer count by the caller).
  // Split (shared_bytes given: an arena of several slots): the transient entries are laid out
  // apart, from `shared` (their size in *shared_bytes), and the return value is one slot's size.
  static size_t layout_activations(const ModelConfig& cfg, const TensorShard& shard, int64_t B, int64_t T,
                                   const Ops& ops, Recompute recompute, Model* m, std::byte* base, ActivationPlan* plan,
                                   size_t* shared_bytes = nullptr, std::byte* shared = nullptr);
  // The element `i` elements past `p` in a compute-dtype buffer.
  void* act_at(void* p, int64_t i) const { return static_cast<std::byte*>(p) + i * act_size_; }
  const void* act_at(const void* p, int64_t i) const { return static_cast<const std::byte*>(p) + i * act_size_; }
  ModelPtrs resolve(float* base) const;
  // The documents of set_documents in the backend's memory (host on the CPU), nullptr when unset.
  const int32_t* doc_starts() const {
    return doc_start_.empty() ? nullptr : on_device() ? static_cast<const int32_t*>(ddocs_.data()) : doc_start_.data();
  }
  const int32_t* doc_positions() const {
    if (doc_pos_.empty()) return nullptr;
    if (!on_device()) return doc_pos_.data();
    return static_cast<const int32_t*>(ddocs_.data()) + static_cast<size_t>(max_B_ * max_T_);
  }
  // A host int32 array of token ids (`tokens`) or targets in backend memory: itself on the CPU,
  // else a staged device copy (stage_inputs) or one uploaded now through Backend::stage_upload.
  // `pass_start` (embedding forward): copies uploaded by earlier passes are stale (the caller may
  // have refilled the same host array); the backward of the pass reuses the forward's copy.
  const int32_t* to_backend(const int32_t* host, int64_t n, bool tokens, bool pass_start = false);
  void check_documents_shape(int64_t B, int64_t T) const;
  // Context parallelism's attention hooks are usable here (host model, context_T set, learned
  // positions within their table); errors name what is not.
  void check_context_attention() const;
  // The weight a kernel of the op table reads for the fp32 master `m`: the master itself in an
  // fp32 model, else the element at the same offset of the compute-dtype copy (nullptr stays null).
  const void* cw(const float* m) const {
    if (m == nullptr || cweights_.size() == 0) return m;
    return static_cast<const std::byte*>(cweights_.data()) + (m - params_.data()) * act_size_;
  }
  // Throws when the weight copies were never refreshed or a sampled element differs from the
  // rounding of its master (see refresh_compute_weights).
  void check_compute_weights() const;
  static constexpr int64_t kWeightSamples = 256;
  // Tensors whose gradients are complete after each block's backward (block numbering of StepHooks).
  std::vector<std::vector<std::pair<size_t, size_t>>> grad_ranges_by_block_;
  StepHooks hooks_;
  // &hooks_.tp.vocab when the embedding and head are vocab-parallel, else nullptr (error for a vocab
  // shard's model without the hook).
  const VocabParallel* vocab_parallel() const;

  ModelConfig cfg_;
  TensorShard shard_;
  Arch arch_;
  ParamTable table_;
  std::string attention_kernel_;  // ComputeSpec::attention_kernel
  const Backend* backend_;
  const Ops* ops_;
  int64_t act_size_;  // bytes per element of the compute dtype
  Buffer<float> params_, grads_;
  // Device-resident models only (on_device()): backend copies of params_ / grads_, the token ids
  // and targets of the current pass, and the documents ([2, max_B, max_T]: doc_start | positions).
  DeviceBuffer dparams_, dgrads_, dtokens_, dtargets_, ddocs_;
  // What each of the kIdSlots device slots (max_B x max_T ids each) of dtokens_ / dtargets_ holds:
  // the host array it was copied from (nullptr: nothing valid), the staging ticket, when it was
  // staged (age: a counter), and whether stage_inputs put it there for a coming pass.
  struct StagedIds {
    const int32_t* host = nullptr;
    int64_t n = 0;
    uint64_t ticket = 0, age = 0;
    bool prefetched = false;
  };
  static constexpr int kIdSlots = 3;  // the staged next pass, the current pass, one spare
  StagedIds staged_[2][kIdSlots];     // [0]: tokens, [1]: targets
  uint64_t staged_age_ = 0;
  // Uploads host[n] into a free (else the oldest) slot of `kind`; returns the slot.
  int stage_ids(const int32_t* host, int64_t n, int kind, bool prefetched);
  DeviceBuffer cweights_;  // compute-dtype copy of params_ (empty for fp32)
  bool cweights_refreshed_ = false;
  size_t cw_begin_ = 0, cw_end_ = SIZE_MAX;  // keep_compute_weights (SIZE_MAX: the whole buffer)
  ModelPtrs p_, g_;

  // activations (pointers into acts_, laid out by plan_), sized for max_B_ x max_T_. void* ones are
  // in the compute dtype, float* ones fp32 (see ActivationEntry). With recompute, the pointers of
  // buffers that are not kept per layer are the same in every la_[l] (the shared set).
  int64_t max_B_ = 0, max_T_ = 0, chunk_rows_ = 0, slots_ = 1;
  DeviceBuffer acts_;
  ActivationPlan plan_;
  struct LayerActs {
    void *ln1, *qkv, *att, *res1, *ln2, *fc, *act, *res2;
    float *ln1_mean, *ln1_rstd, *lse, *ln2_mean, *ln2_rstd;
    // Arch::qk_norm: q then k rows before their norm [N, H + KV, D] (q block [N*H*D], then k), and
    // their rstd [N*(H + KV)] (q then k); nullptr otherwise.
    void* qk_saved;
    float* qk_rstd;
    // Arch::sandwich_norm: the attention's and the MLP's output before their norms [S, C] and the
    // norms' rstd [S]; nullptr otherwise.
    void *attn_out, *mlp_out;
    float *attn_out_rstd, *mlp_out_rstd;
    // Arch::moe_experts: what the MoE block's forward saves (kernels/cpu/ops.h MoeActs; fp32).
    cpu::MoeActs moe;
    // Arch::moe_shared_width (Fs): the shared expert's gate / up / act [N, Fs], output y [N, C]
    // and its sigmoid gate [N] (models/moe_shared.cpp); nullptr otherwise.
    float *sh_gate = nullptr, *sh_up = nullptr, *sh_act = nullptr, *sh_y = nullptr, *sh_sig = nullptr;
  };
  std::vector<LayerActs> la_;
  void *emb_ = nullptr, *lnf_ = nullptr;
  // Sequence parallelism: [tp*S, C] rows gathered from every rank (the column-parallel GEMMs' input,
  // the row-parallel GEMMs' partial output, the gathered residual gradient); nullptr otherwise.
  void* gathered_ = nullptr;
  std::vector<float> norm_acc_;  // [2C] norm weight/bias gradients of one pass's rows (norm_backward)
  DeviceBuffer norm_w_;          // Arch::norm_weight_offset: offset + w of the norm being run (fp32)
  float *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr, *losses_ = nullptr;
  void *dres_ = nullptr, *dln_ = nullptr, *dqkv_ = nullptr, *datt_ = nullptr, *dfc_ = nullptr, *dact_ = nullptr;
  void* scratch_ = nullptr;
  // Mixture of experts: the backward's scratch and the aux / z-loss router gradient [N, E]
  // (transient), the pass's load statistics and losses (moe_begin_pass / moe_head_loss).
  float *moe_scratch_ = nullptr, *moe_dlogits_ = nullptr;
  std::vector<double> moe_psum_;
  std::vector<int64_t> moe_counts_;
  int64_t moe_rows_ = 0, moe_targets_ = 0;
  double moe_aux_ = std::numeric_limits<double>::quiet_NaN(), moe_z_ = std::numeric_limits<double>::quiet_NaN(),
         moe_z_sum_ = 0.0;
  float moe_grad_weight_ = 0.0f;  // n x grad_scale of the pass (0: no backward)
  // Arch::moe_shared_width: the shared expert's backward scratch (transient; models/moe_shared.cpp).
  float* moe_shared_scratch_ = nullptr;
  float *rope_cos_ = nullptr, *rope_sin_ = nullptr;
  // RoPE tables of each slot: the sequence length their frequencies were computed for (dynamic NTK
  // scaling depends on it; rope_tables_for() rebuilds the current slot's when a pass differs).
  std::vector<int64_t> rope_len_;
  int64_t slot_ = 0;
  void build_rope_tables(int64_t seq_len);
  void rope_tables_for(int64_t T);
  std::vector<int32_t> doc_start_, doc_pos_;  // [docs_B_, docs_T_] each, or empty
  int64_t doc_len_ = 0;                       // max(positions) + 1 of the whole samples (0: no positions)
  int64_t docs_B_ = 0, docs_T_ = 0;
};

// model_type -> builder. Registering a name twice is an error naming both registrants.
// A ModelBuilder builds CPU fp32 models only; a ComputeModelBuilder takes the ComputeSpec.
using ModelBuilder = std::unique_ptr<Model> (*)(const ModelConfig&);
using ComputeModelBuilder = std::unique_ptr<Model> (*)(const ModelConfig&, const ComputeSpec&);
class ModelRegistry {
 public:
  void add(const std::string& model_type, ModelBuilder builder, const std::string& registrant);
  void add(const std::string& model_type, ComputeModelBuilder builder, const std::string& registrant);
  std::unique_ptr<Model> build(const ModelConfig& cfg, const ComputeSpec& compute = {}) const;
  std::vector<std::string> names() const;

 private:
  struct Entry {
    ModelBuilder builder = nullptr;  // one of the two is set
    ComputeModelBuilder compute_builder = nullptr;
    std::string registrant;
  };
  std::vector<std::pair<std::string, Entry>> entries_;
};
// The registry with the built-in families (gpt2; llama, qwen2, mistral, qwen3).
ModelRegistry& model_registry();
std::unique_ptr<Model> build_model(const ModelConfig& cfg, const ComputeSpec& compute = {});

// Family builders (src/models/gpt2.cpp, src/models/llama.cpp).
std::unique_ptr<Model> build_gpt2(const ModelConfig& cfg, const ComputeSpec& compute = {});
std::unique_ptr<Model> build_llama(const ModelConfig& cfg, const ComputeSpec& compute = {});
std::unique_ptr<Model> build_gpt_neox(const ModelConfig& cfg, const ComputeSpec& compute = {});  // gpt_neox.cpp
std::unique_ptr<Model> build_gemma2(const ModelConfig& cfg, const ComputeSpec& compute = {});    // gemma2.cpp
std::unique_ptr<Model> build_mixtral(const ModelConfig& cfg, const ComputeSpec& compute = {});   // mixtral.cpp
std::unique_ptr<Model> build_qwen2_moe(const ModelConfig& cfg, const ComputeSpec& compute = {});  // moe_shared.cpp
std::unique_ptr<Model> build_olmo2(const ModelConfig& cfg, const ComputeSpec& compute = {});     // olmo2.cpp

// Final-logit soft-capping of returned fp32 host logits (Gemma 2's final_logit_softcapping; models/
// softcap.cpp): logits[i] <- cap * tanh(logits[i] / cap), as the lm-head loss kernels compute it;
// nothing when the config has no cap.
void apply_final_softcap(const ModelConfig& cfg, float* logits, int64_t n);
// Gemma 2's embedding scale (models/gemma2.cpp): sqrt(hidden) rounded to the compute dtype dt, as
// transformers' normalizer (fp32, bf16 and fp16); the ops' scale_forward multiplies by it.
float sqrt_hidden_in(DType dt, int64_t hidden);

}  // namespace lathe
