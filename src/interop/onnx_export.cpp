// The decoder as an ONNX graph (layout in onnx_export.h). Per layer, with C hidden, H heads, KV
// key/value heads, D head size, n_rep = H / KV, S new tokens, T = past + S:
//   h = norm1(x)                                   [B, S, C]   (LayerNorm / RMSNorm, in fp32)
//   q|k|v = h @ Wq|Wk|Wv (+ b)                     [B, S, H*D | KV*D]  (fused c_attn split by rows)
//   -> [B, H|KV, S, D]; q, k RMSNorm over D (qwen3's per-head q_norm / k_norm, in fp32)
//   RoPE on q and k (llama family) from cos/sin tables gathered by position_ids
//   k, v = concat(past, new) on the sequence axis  [B, KV, T, D]  = present.{i}.key/value
//   scores = q [B, KV, n_rep, S, D] @ k^T [B, KV, 1, D, T] (GQA by broadcasting, no copies of k/v)
//   p = softmax(cap(scores * scale) + mask)        scale 1/sqrt(D) (gemma2: query_pre_attn_scalar), cap the
//                                                  gemma2 soft cap; mask: causal by absolute position (past + i),
//                                                  attention_mask padding, the sliding window
//                                                  (one mask per distinct layer window)
//   o = (p @ v) -> [B, S, H*D] @ Wo (+ b); x += o  (gemma2's sandwich norms: x += norm(o))
//   x += mlp(norm2(x))                             GELU-tanh (c_fc, c_proj), SwiGLU or GeGLU (gate, up, down)
// logits = norm_f(x) @ lm_head^T (tied: a Transpose of the embedding, stored once); gemma2 scales
// the embedding by sqrt(C), its norms by (1 + w) and caps the logits.
// fp16 graphs keep weights, activations, past/present and logits in fp16 and compute the norms,
// GELU and softmax in fp32 (Cast around them), as HF models do in fp16; norm weights stay fp32.
#include "interop/onnx_export.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "core/error.h"
#include "io/onnx_writer.h"

namespace lathe {

namespace {

using io::onnx::attr_float;
using io::onnx::attr_int;
using io::onnx::attr_ints;
using io::onnx::Attribute;
using io::onnx::Dim;
using io::onnx::ElemType;
using io::onnx::Node;
using io::onnx::Tensor;
using io::onnx::ValueInfo;

// Tensors of one role in one layer: the role's tensor and the adjacent ones that continue it
// (llama's k_proj, v_proj after q_proj; up after gate), in table order.
using RoleRun = std::vector<const ParamSpec*>;

class Exporter {
 public:
  Exporter(const Model& m, const OnnxExportOptions& o)
      : m_(m),
        cfg_(m.config()),
        arch_(m.arch()),
        o_(o),
        act_(o.dtype == DType::F16 ? ElemType::Float16 : ElemType::Float) {
    const ParamSpec* last = nullptr;
    for (const ParamSpec& s : m.params().specs()) {
      if (s.role == Role::Continues) {
        LATHE_CHECK(last != nullptr, "ONNX export: parameter '{}' continues no role", s.name);
        runs_[{last->layer, last->role}].push_back(&s);
        continue;
      }
      last = &s;
      if (s.role == Role::None) continue;
      auto& run = runs_[{s.layer, s.role}];
      LATHE_CHECK(run.empty(), "ONNX export: role {} of layer {} appears twice ('{}', '{}')", role_name(s.role),
                  s.layer, run.empty() ? "" : run[0]->name, s.name);
      run.push_back(&s);
    }
  }

  io::onnx::Graph build();

 private:
  // ---- graph plumbing ----
  std::string op(const std::string& type, std::vector<std::string> in, std::vector<Attribute> attrs = {},
                 std::string out = "") {
    if (out.empty()) out = fmt::format("{}_{}", prefix_.empty() ? type : prefix_ + type, n_++);
    Node n;
    n.op_type = type;
    n.inputs = std::move(in);
    n.outputs = {out};
    n.name = out;
    n.attributes = std::move(attrs);
    g_.nodes.push_back(std::move(n));
    return out;
  }
  std::string init(std::string name, ElemType type, std::vector<int64_t> dims, std::string data) {
    Tensor t;
    t.name = name;
    t.type = type;
    t.dims = std::move(dims);
    t.data = std::move(data);
    g_.initializers.push_back(std::move(t));
    return name;
  }
  // int64 constant (dims {} = scalar), one initializer per distinct value.
  std::string i64(std::vector<int64_t> v, bool scalar = false) {
    std::string key = scalar ? "s" : "v";
    for (int64_t x : v) key += fmt::format("_{}", x < 0 ? fmt::format("m{}", -x) : std::to_string(x));
    const std::string name = "const_i64" + key;
    if (consts_.emplace(name).second) {
      std::string d(v.size() * 8, '\0');
      std::memcpy(d.data(), v.data(), d.size());
      init(name, ElemType::Int64,
           scalar ? std::vector<int64_t>{} : std::vector<int64_t>{static_cast<int64_t>(v.size())}, std::move(d));
    }
    return name;
  }
  std::string scalar(float v, ElemType type) {
    const std::string name = fmt::format("const_{}_{}", type == ElemType::Float ? "f32" : "f16", n_++);
    return init(name, type, {}, encode(&v, 1, type, name));
  }
  static std::string encode(const float* src, int64_t n, ElemType type, const std::string& name) {
    if (type == ElemType::Float) return std::string(reinterpret_cast<const char*>(src), static_cast<size_t>(n) * 4);
    std::string d(static_cast<size_t>(n) * 2, '\0');
    for (int64_t i = 0; i < n; ++i) {
      LATHE_CHECK(std::isfinite(src[i]) && std::fabs(src[i]) <= 65504.0f,
                  "ONNX export --dtype fp16: tensor '{}' element {} is {}, outside the fp16 range (+-65504); "
                  "export with --dtype fp32",
                  name, i, src[i]);
      const uint16_t h = fp32_to_fp16(src[i]);
      std::memcpy(d.data() + 2 * i, &h, 2);
    }
    return d;
  }
  // fp16 graphs: every weight must be finite and within +-65504, checked in the tensor's own
  // [rows, cols] layout so the error names the element as the user sees it.
  // cols = 0: a 1-D tensor of `rows` elements.
  void check_fp16(const float* src, int64_t rows, int64_t cols, const std::string& name, ElemType type) const {
    if (type != ElemType::Float16) return;
    const int64_t n = cols > 0 ? rows * cols : rows;
    for (int64_t i = 0; i < n; ++i)
      LATHE_CHECK(std::isfinite(src[i]) && std::fabs(src[i]) <= 65504.0f,
                  "ONNX export --dtype fp16: tensor '{}' element {} is {}, outside the fp16 range (+-65504); "
                  "export with --dtype fp32",
                  name, cols > 0 ? fmt::format("[{}, {}]", i / cols, i % cols) : fmt::format("[{}]", i), src[i]);
  }
  std::string to_f32(const std::string& x) {
    return act_ == ElemType::Float ? x : op("Cast", {x}, {attr_int("to", static_cast<int64_t>(ElemType::Float))});
  }
  std::string to_act(const std::string& x) {
    return act_ == ElemType::Float ? x : op("Cast", {x}, {attr_int("to", static_cast<int64_t>(act_))});
  }

  // ---- weights by role ----
  const RoleRun* find(int64_t layer, Role r) const {
    auto it = runs_.find({layer, r});
    return it == runs_.end() ? nullptr : &it->second;
  }
  const RoleRun& need(int64_t layer, Role r) const {
    const RoleRun* run = find(layer, r);
    LATHE_CHECK(run != nullptr, "ONNX export: the model has no tensor with role {}{}", role_name(r),
                layer >= 0 ? fmt::format(" in layer {}", layer) : "");
    return *run;
  }
  static int64_t run_rows(const RoleRun& run) {
    int64_t n = 0;
    for (const ParamSpec* s : run) n += s->shape[0];
    return n;
  }
  // The name of rows [r0, r1) of a run: the tensor's own name when one tensor is exactly that slice
  // (llama q_proj), else the first tensor's name with a suffix (GPT-2 c_attn.weight.q).
  static std::string slice_name(const RoleRun& run, int64_t r0, int64_t r1, const char* suffix) {
    int64_t at = 0;
    for (const ParamSpec* s : run) {
      if (at == r0 && at + s->shape[0] == r1) return s->name;
      at += s->shape[0];
    }
    return suffix[0] ? fmt::format("{}.{}", run[0]->name, suffix) : run[0]->name;
  }
  // Rows [r0, r1) of a [rows, cols] weight run, stored transposed [cols, r1 - r0] for MatMul.
  std::string weight_t(const RoleRun& run, int64_t r0, int64_t r1, const char* suffix) {
    const int64_t cols = run[0]->shape.size() == 2 ? run[0]->shape[1] : 1;
    const float* base = m_.param_data() + run[0]->offset;
    const int64_t R = r1 - r0;
    const std::string name = slice_name(run, r0, r1, suffix);
    check_fp16(base + r0 * cols, R, cols, name, act_);
    std::vector<float> t(static_cast<size_t>(R * cols));
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * R + r)] = base[(r0 + r) * cols + c];
    return init(name, act_, {cols, R}, encode(t.data(), R * cols, act_, name));
  }
  // Elements [r0, r1) of a 1-D run (biases, norm weights) in `type`.
  std::string vector(const RoleRun& run, int64_t r0, int64_t r1, const char* suffix, ElemType type) {
    const std::string name = slice_name(run, r0, r1, suffix);
    check_fp16(m_.param_data() + run[0]->offset + r0, r1 - r0, 0, name, type);
    return init(name, type, {r1 - r0}, encode(m_.param_data() + run[0]->offset + r0, r1 - r0, type, name));
  }
  // gemma2's RMSNorm scales by (offset + w) in fp32 (transformers: 1.0 + weight.float()); the sum is
  // baked into the fp32 initializer, named after the tensor with an ".offset" suffix.
  std::string offset_vector(const RoleRun& run) {
    const int64_t n = run_rows(run);
    const float* w = m_.param_data() + run[0]->offset;
    std::vector<float> sum(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) sum[static_cast<size_t>(i)] = arch_.norm_weight_offset + w[i];
    const std::string name = run[0]->name + ".offset";
    return init(name, ElemType::Float, {n}, encode(sum.data(), n, ElemType::Float, name));
  }
  // cap * tanh(x / cap) in fp32 (gemma2's attention and final logit soft caps); cap 0: x unchanged.
  std::string softcap(const std::string& x, float cap) {
    if (cap == 0.0f) return x;
    const auto F = ElemType::Float;
    return op("Mul", {op("Tanh", {op("Div", {x, scalar(cap, F)})}), scalar(cap, F)});
  }
  // y = x @ W[r0:r1]^T (+ b[r0:r1]) for the weight role `w` and bias role `b` (when the model has it).
  std::string linear(const std::string& x, int64_t layer, Role w, Role b, int64_t r0, int64_t r1,
                     const char* suffix = "") {
    std::string y = op("MatMul", {x, weight_t(need(layer, w), r0, r1, suffix)});
    if (const RoleRun* bias = find(layer, b)) y = op("Add", {y, vector(*bias, r0, r1, suffix, act_)});
    return y;
  }

  // ---- blocks ----
  std::string norm(const std::string& x, int64_t layer, Role w, Role b) {
    const std::string xf = to_f32(x);
    const RoleRun& wr = need(layer, w);
    const std::string W =
        arch_.norm_weight_offset == 0.0f ? vector(wr, 0, run_rows(wr), "", ElemType::Float) : offset_vector(wr);
    const float eps = static_cast<float>(cfg_.norm_eps);
    std::string y;
    if (arch_.layernorm) {
      const RoleRun& br = need(layer, b);
      y = op("LayerNormalization", {xf, W, vector(br, 0, run_rows(br), "", ElemType::Float)},
             {attr_int("axis", -1), attr_float("epsilon", eps)});
    } else {  // x / sqrt(mean(x^2) + eps) * w
      const std::string ms =
          op("ReduceMean", {op("Mul", {xf, xf})}, {attr_ints("axes", {-1}), attr_int("keepdims", 1)});
      y = op("Mul", {op("Div", {xf, op("Sqrt", {op("Add", {ms, scalar(eps, ElemType::Float)})})}), W});
    }
    return to_act(y);
  }
  // [B, S, n*D] -> [B, n, S, D]
  std::string heads(const std::string& x, int64_t n) {
    return op("Transpose", {op("Reshape", {x, i64({0, 0, n, cfg_.head_dim()})})}, {attr_ints("perm", {0, 2, 1, 3})});
  }
  // x [B, n, S, D]: (x1*cos - x2*sin, x2*cos + x1*sin), x1/x2 the two halves of the first rot
  // dims (partial rotary: the dims from rot on pass through).
  std::string rope(const std::string& x) {
    const int64_t D = cfg_.head_dim(), rot = cfg_.rotary_dim(), half = rot / 2;
    const std::string x1 = op("Slice", {x, i64({0}), i64({half}), i64({3})});
    const std::string x2 = op("Slice", {x, i64({half}), i64({rot}), i64({3})});
    const std::string a = op("Sub", {op("Mul", {x1, cos_}), op("Mul", {x2, sin_})});
    const std::string b = op("Add", {op("Mul", {x2, cos_}), op("Mul", {x1, sin_})});
    if (rot == D) return op("Concat", {a, b}, {attr_int("axis", 3)});
    const std::string pass = op("Slice", {x, i64({rot}), i64({D}), i64({3})});
    return op("Concat", {a, b, pass}, {attr_int("axis", 3)});
  }
  std::string gelu_tanh(const std::string& x) {  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    const std::string xf = to_f32(x);
    const auto F = ElemType::Float;
    const std::string x3 = op("Mul", {op("Mul", {xf, xf}), xf});
    const std::string u =
        op("Mul", {op("Add", {xf, op("Mul", {x3, scalar(0.044715f, F)})}), scalar(0.7978845608028654f, F)});
    const std::string y = op("Mul", {op("Mul", {xf, scalar(0.5f, F)}), op("Add", {op("Tanh", {u}), scalar(1.0f, F)})});
    return to_act(y);
  }
  std::string gelu_erf(const std::string& x) {  // 0.5 x (1 + erf(x / sqrt 2))
    const std::string xf = to_f32(x);
    const auto F = ElemType::Float;
    const std::string e = op("Erf", {op("Mul", {xf, scalar(0.70710678118654752f, F)})});
    return to_act(op("Mul", {op("Mul", {xf, scalar(0.5f, F)}), op("Add", {e, scalar(1.0f, F)})}));
  }
  void embedding_and_mask();
  std::string layer(const std::string& x, int64_t l);

  const Model& m_;
  const ModelConfig& cfg_;
  const Arch& arch_;
  OnnxExportOptions o_;
  ElemType act_;
  std::map<std::pair<int64_t, Role>, RoleRun> runs_;
  io::onnx::Graph g_;
  std::set<std::string> consts_;
  std::string prefix_;
  int64_t n_ = 0;
  std::string x0_, cos_, sin_, wte_;
  std::map<int64_t, std::string> bias_;  // the additive mask of each layer window (0: none)
};

void Exporter::embedding_and_mask() {
  prefix_ = "embed/";
  const RoleRun& wte = need(-1, Role::Wte);
  check_fp16(m_.param_data() + wte[0]->offset, wte[0]->shape[0], wte[0]->shape[1], wte[0]->name, act_);
  wte_ = init(wte[0]->name, act_, wte[0]->shape,
              encode(m_.param_data() + wte[0]->offset, wte[0]->numel(), act_, wte[0]->name));
  x0_ = op("Gather", {wte_, "input_ids"});  // [B, S, C]
  if (arch_.embed_scale)  // gemma2: x sqrt(hidden), the factor rounded to the activation dtype as transformers'
    x0_ = op("Mul", {x0_, scalar(static_cast<float>(std::sqrt(static_cast<double>(cfg_.hidden_size))), act_)});
  if (arch_.learned_pos) {
    const RoleRun& wpe = need(-1, Role::Wpe);
    check_fp16(m_.param_data() + wpe[0]->offset, wpe[0]->shape[0], wpe[0]->shape[1], wpe[0]->name, act_);
    const std::string w = init(wpe[0]->name, act_, wpe[0]->shape,
                               encode(m_.param_data() + wpe[0]->offset, wpe[0]->numel(), act_, wpe[0]->name));
    x0_ = op("Add", {x0_, op("Gather", {w, "position_ids"})});
  } else {
    // cos/sin [P, rot/2] as lathe's RoPE kernel computes them (fp32 angles, RoPE scaling and its
    // attention factor included), gathered by position: [B, S, rot/2] -> [B, 1, S, rot/2], shared
    // by every layer. Dynamic NTK scaling has tables that depend on the sequence length, which
    // baked tables cannot follow.
    LATHE_CHECK(cfg_.rope_scaling.type != "dynamic",
                "onnx export: rope_scaling type 'dynamic' (NTK) recomputes the RoPE frequencies from the sequence "
                "length, which the exported graph's baked cos/sin tables cannot represent; export a copy whose "
                "config.json has rope_scaling null (identical up to max_position_embeddings = {} tokens)",
                cfg_.max_position_embeddings);
    const int64_t P = cfg_.max_position_embeddings, half = cfg_.rotary_dim() / 2;
    std::vector<float> c(static_cast<size_t>(P * half)), s(c.size());
    const RopeFrequencies f = rope_frequencies(cfg_, P);
    m_.ops().rope_tables(c.data(), s.data(), P, half, f.inv_freq.data(), f.attention_factor);
    const std::string ct = init("rope.cos", act_, {P, half}, encode(c.data(), P * half, act_, "rope.cos"));
    const std::string st = init("rope.sin", act_, {P, half}, encode(s.data(), P * half, act_, "rope.sin"));
    cos_ = op("Unsqueeze", {op("Gather", {ct, "position_ids"}), i64({1})}, {}, "rope/cos");
    sin_ = op("Unsqueeze", {op("Gather", {st, "position_ids"}), i64({1})}, {}, "rope/sin");
  }
  // Additive mask [B, 1, 1, S, T] (fp32): 0 where query i (absolute position T - S + i) may see key
  // j: j <= T - S + i, attention_mask[b, j] != 0 and, with a sliding window W, T - S + i - j < W;
  // the lowest float elsewhere (exp underflows to 0; a fully masked row stays finite).
  prefix_ = "mask/";
  const std::string S = op("Gather", {op("Shape", {"input_ids"}), i64({1}, true)});
  const std::string T = op("Gather", {op("Shape", {"attention_mask"}), i64({1}, true)});
  const std::string kpos = op("Unsqueeze", {op("Range", {i64({0}, true), T, i64({1}, true)}), i64({0})});     // [1, T]
  const std::string qpos = op("Unsqueeze", {op("Range", {op("Sub", {T, S}), T, i64({1}, true)}), i64({1})});  // [S, 1]
  const std::string causal = op("LessOrEqual", {kpos, qpos});                                                 // [S, T]
  std::string pad;
  // One mask per distinct layer window, in layer order (gemma2 and layer_types alternate sliding and
  // full layers); the first is named mask/bias.
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    const int64_t w = cfg_.layer_window(l);  // the keys the layer's window reaches (phi3: sliding_window + 1)
    if (bias_.count(w) != 0) continue;
    std::string allowed = causal;
    if (w > 0) allowed = op("And", {allowed, op("Less", {op("Sub", {qpos, kpos}), i64({w}, true)})});
    if (pad.empty())
      pad = op("Unsqueeze", {op("Cast", {"attention_mask"}, {attr_int("to", static_cast<int64_t>(ElemType::Bool))}),
                             i64({1, 2, 3})});  // [B, 1, 1, 1, T]
    bias_[w] = op("Where",
                  {op("And", {allowed, pad}), scalar(0.0f, ElemType::Float),
                   scalar(std::numeric_limits<float>::lowest(), ElemType::Float)},
                  {}, bias_.empty() ? "mask/bias" : fmt::format("mask/bias_window{}", w));
  }
}

std::string Exporter::layer(const std::string& x, int64_t l) {
  prefix_ = fmt::format("layers.{}/", l);
  const int64_t H = cfg_.num_attention_heads, KV = cfg_.num_key_value_heads, D = cfg_.head_dim(), C = cfg_.hidden_size;
  const std::string h = norm(x, l, Role::Ln1W, Role::Ln1B);
  std::string q = heads(linear(h, l, Role::QkvW, Role::QkvB, 0, H * D, "q"), H);              // [B, H, S, D]
  std::string k = heads(linear(h, l, Role::QkvW, Role::QkvB, H * D, (H + KV) * D, "k"), KV);  // [B, KV, S, D]
  std::string v = heads(linear(h, l, Role::QkvW, Role::QkvB, (H + KV) * D, (H + 2 * KV) * D, "v"), KV);
  if (arch_.qk_norm) {  // Qwen3: RMSNorm over each head's D features (the last axis), before RoPE
    q = norm(q, l, Role::QNormW, Role::None);
    k = norm(k, l, Role::KNormW, Role::None);
  }
  if (!arch_.learned_pos) {
    q = rope(q);
    k = rope(k);
  }
  const bool fp16 = act_ == ElemType::Float16;
  const float scale = cfg_.attention_scale() != 0.0f ? cfg_.attention_scale() : 1.0f / std::sqrt(static_cast<float>(D));
  // fp16: scale q before the product so the fp16 scores cannot overflow; fp32: after, as lathe.
  if (fp16) q = op("Mul", {q, scalar(scale, act_)});
  if (o_.static_seq_len == 0) {
    k = op("Concat", {fmt::format("past_key_values.{}.key", l), k}, {attr_int("axis", 2)},
           fmt::format("present.{}.key", l));
    v = op("Concat", {fmt::format("past_key_values.{}.value", l), v}, {attr_int("axis", 2)},
           fmt::format("present.{}.value", l));
  }
  const std::string q5 = op("Reshape", {q, i64({0, KV, H / KV, -1, D})});  // [B, KV, n_rep, S, D]
  const std::string kt = op("Transpose", {op("Unsqueeze", {k, i64({2})})}, {attr_ints("perm", {0, 1, 2, 4, 3})});
  std::string s = to_f32(op("MatMul", {q5, kt}));  // [B, KV, n_rep, S, T]
  if (!fp16) s = op("Mul", {s, scalar(scale, ElemType::Float)});
  s = softcap(s, cfg_.attn_softcap());  // gemma2: cap * tanh(s / cap), before the mask
  const std::string p = to_act(op("Softmax", {op("Add", {s, bias_.at(cfg_.layer_window(l))})}, {attr_int("axis", -1)}));
  std::string o = op("MatMul", {p, op("Unsqueeze", {v, i64({2})})});  // [B, KV, n_rep, S, D]
  o = op("Reshape", {op("Transpose", {op("Reshape", {o, i64({0, H, -1, D})})}, {attr_ints("perm", {0, 2, 1, 3})}),
                     i64({0, 0, H * D})});  // [B, S, H*D]
  std::string attn = linear(o, l, Role::OW, Role::OB, 0, C);
  if (arch_.sandwich_norm) attn = norm(attn, l, Role::PostAttnNormW, Role::None);  // gemma2
  const std::string x1 = op("Add", {x, attn});
  // The MLP's norm reads x + attn, or with the parallel residual (gpt_neox) the layer input.
  const std::string h2 = norm(arch_.parallel_residual ? x : x1, l, Role::Ln2W, Role::Ln2B);
  const int64_t F = cfg_.intermediate_size;
  std::string a;
  if (arch_.gelu_mlp) {
    const std::string fc = linear(h2, l, Role::FcW, Role::FcB, 0, F);
    a = arch_.gelu_exact ? gelu_erf(fc) : gelu_tanh(fc);
  } else {  // act(gate) * up, act SiLU or (gemma2's GeGLU) the tanh GELU; gate|up are rows [0, F) and [F, 2F) of FcW
    const std::string gate = linear(h2, l, Role::FcW, Role::FcB, 0, F, "gate");
    const std::string up = linear(h2, l, Role::FcW, Role::FcB, F, 2 * F, "up");
    a = op("Mul", {arch_.geglu ? gelu_tanh(gate) : op("Mul", {gate, op("Sigmoid", {gate})}), up});
  }
  std::string mlp = linear(a, l, Role::ProjW, Role::ProjB, 0, C);
  if (arch_.sandwich_norm) mlp = norm(mlp, l, Role::PostFfnNormW, Role::None);  // gemma2
  return op("Add", {x1, mlp}, {}, fmt::format("layers.{}/out", l));
}

io::onnx::Graph Exporter::build() {
  const int64_t L = cfg_.num_hidden_layers, KV = cfg_.num_key_value_heads, D = cfg_.head_dim(), V = cfg_.vocab_size;
  const bool stat = o_.static_seq_len > 0;
  g_.name = fmt::format("lathe_{}", cfg_.model_type);
  const Dim batch = stat ? Dim::fixed(1) : Dim::named("batch_size");
  const Dim seq = stat ? Dim::fixed(o_.static_seq_len) : Dim::named("sequence_length");
  const Dim total = stat ? Dim::fixed(o_.static_seq_len) : Dim::named("total_sequence_length");
  g_.inputs.push_back(ValueInfo{"input_ids", ElemType::Int64, {batch, seq}});
  g_.inputs.push_back(ValueInfo{"attention_mask", ElemType::Int64, {batch, total}});
  g_.inputs.push_back(ValueInfo{"position_ids", ElemType::Int64, {batch, seq}});
  g_.outputs.push_back(ValueInfo{"logits", act_, {batch, seq, Dim::fixed(V)}});
  if (!stat) {
    for (int64_t l = 0; l < L; ++l)
      for (const char* kv : {"key", "value"}) {
        g_.inputs.push_back(ValueInfo{fmt::format("past_key_values.{}.{}", l, kv),
                                      act_,
                                      {batch, Dim::fixed(KV), Dim::named("past_sequence_length"), Dim::fixed(D)}});
        g_.outputs.push_back(
            ValueInfo{fmt::format("present.{}.{}", l, kv), act_, {batch, Dim::fixed(KV), total, Dim::fixed(D)}});
      }
  }
  embedding_and_mask();
  std::string x = x0_;
  for (int64_t l = 0; l < L; ++l) x = layer(x, l);
  prefix_ = "head/";
  const std::string h = norm(x, -1, Role::LnfW, Role::LnfB);
  std::string head;
  if (arch_.tied_lm_head) {
    head = op("Transpose", {wte_}, {attr_ints("perm", {1, 0})});  // [C, V], folded by the runtime
  } else {
    const RoleRun& lm = need(-1, Role::LmHead);
    head = weight_t(lm, 0, run_rows(lm), "");
  }
  if (cfg_.final_softcap() == 0.0f) {
    op("MatMul", {h, head}, {}, "logits");
  } else {  // gemma2: cap * tanh(logits / cap) in fp32
    const std::string capped = softcap(to_f32(op("MatMul", {h, head})), cfg_.final_softcap());
    op(act_ == ElemType::Float ? "Identity" : "Cast", {capped},
       act_ == ElemType::Float ? std::vector<Attribute>{}
                               : std::vector<Attribute>{attr_int("to", static_cast<int64_t>(act_))},
       "logits");
  }
  return std::move(g_);
}

}  // namespace

std::string save_onnx(const Model& model, const std::string& path, const OnnxExportOptions& opts) {
  const ModelConfig& cfg = model.config();
  LATHE_CHECK(!cfg.moe(),
              "ONNX export: {} (mixture of experts) is not supported yet (the graph builder has no router, top-k or "
              "expert dispatch); export the HF directory (lathe export) instead",
              cfg.model_type);
  LATHE_CHECK(cfg.model_type != "olmo2",  // olmo2
              "ONNX export: olmo2 is not supported yet (the graph builder has no post-only norms or whole-projection "
              "q/k norms); export the HF directory (lathe export) instead");
  LATHE_CHECK(cfg.family == "gpt2" || cfg.family == "llama" || cfg.family == "gpt_neox",
              "ONNX export: model_type '{}' (family '{}') has no ONNX graph builder; supported: gpt2, llama, qwen2, "
              "mistral, qwen3, phi3, gemma2, gpt_neox",
              cfg.model_type, cfg.family);
  // gpt_neox: exact (gelu) or tanh (gelu_new) GELU, both built.
  const char* act =
      cfg.gelu_mlp() ? (cfg.gelu_exact() ? "gelu" : "gelu_new") : (model.arch().geglu ? "gelu_pytorch_tanh" : "silu");
  LATHE_CHECK(cfg.hidden_act == act, "ONNX export: {} with hidden_act '{}' is not supported (the graph builds {})",
              cfg.model_type, cfg.hidden_act, act);
  LATHE_CHECK(opts.dtype == DType::F32 || opts.dtype == DType::F16,
              "ONNX export writes fp32 or fp16 graphs; --dtype {} is not supported (onnxruntime's CPU provider has "
              "no bf16 kernels for most operators)",
              dtype_name(opts.dtype));
  LATHE_CHECK(opts.static_seq_len >= 0 && opts.static_seq_len <= cfg.max_position_embeddings,
              "--static-seq-len {} must be in [1, max_position_embeddings = {}] (leave it out for dynamic shapes "
              "with past key/values)",
              opts.static_seq_len, cfg.max_position_embeddings);
  // phi3's longrope switches short / long factors with the sequence length (rope_frequencies):
  // the graph's baked tables hold one set.
  LATHE_CHECK(cfg.model_type != "phi3" || cfg.rope_scaling.type != "longrope" ||
                  cfg.rope_scaling.short_factor == cfg.rope_scaling.long_factor,
              "ONNX export: this phi3 has longrope with different short_factor and long_factor; transformers' Phi3 "
              "picks them by the sequence length (long ones past original_max_position_embeddings = {}), which the "
              "graph's baked cos/sin tables cannot follow; not exported",
              cfg.rope_scaling.config_original_max_position_embeddings.value_or(0));
  Exporter ex(model, opts);
  const io::onnx::Graph g = ex.build();
  io::onnx::ModelProtoInfo info;
  info.producer_version = LATHE_VERSION;
  info.doc_string = fmt::format("lathe export of a {} decoder", cfg.model_type);
  info.metadata = {{"model_type", cfg.model_type},
                   {"num_hidden_layers", std::to_string(cfg.num_hidden_layers)},
                   {"num_attention_heads", std::to_string(cfg.num_attention_heads)},
                   {"num_key_value_heads", std::to_string(cfg.num_key_value_heads)},
                   {"head_dim", std::to_string(cfg.head_dim())},
                   {"vocab_size", std::to_string(cfg.vocab_size)},
                   {"max_position_embeddings", std::to_string(cfg.max_position_embeddings)},
                   {"static_seq_len", std::to_string(opts.static_seq_len)}};
  io::onnx::WriteOptions wo;
  wo.external_data = opts.external_data;
  wo.inline_limit = opts.inline_limit;
  const io::onnx::WriteResult r = io::onnx::write_model(path, g, info, wo);
  std::string shape = opts.static_seq_len > 0 ? fmt::format("static [1, {}], no past key/values", opts.static_seq_len)
                                              : "dynamic shapes with past key/values";
  std::string ext =
      r.data_path.empty() ? "" : fmt::format(", weights in {} ({:.1f} MB)", r.data_path, r.data_bytes / 1e6);
  return fmt::format("wrote {} (ONNX opset 17, {} {}, {}, {} nodes, {} initializers, {:.1f} MB{})", path,
                     cfg.model_type, opts.dtype == DType::F16 ? "fp16" : "fp32", shape, g.nodes.size(),
                     g.initializers.size(), r.model_bytes / 1e6, ext);
}

}  // namespace lathe
