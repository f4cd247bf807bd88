// cuDNN's fused scaled-dot-product attention (SDPA) as the attention slots of the CUDA bf16/fp16
// tables (model.attention_kernel: cudnn; kernels/cuda/ops.h), through cuDNN's frontend graph API
// (the header-only cudnn-frontend; scripts/setup.sh installs its headers). Same contract as
// attention.cu's kernels: causal GQA over the fused qkv, out and dqkv "=", lse [B, H, T] fp32.
//
// Layouts (row-major, Q = (H + 2 KV) D the fused width): qkv [B, T, Q] holds q of head h at
// columns h D, k of kv head j at (H + j) D, v at (H + KV + j) D, so cuDNN's logical [B, heads, T, D]
// tensors are strided views of it (strides [T Q, D, Q, 1]) at those element offsets; out and dout
// [B, T, H D] (strides [T H D, D, H D, 1]); lse = cuDNN's softmax stats [B, H, T, 1] (natural-log
// log-sum-exp of the scaled scores, as lathe's lse); dq, dk, dv are written into dqkv's columns the
// same way (dk, dv summed over each kv head's query group by cuDNN). Scale 1/sqrt(D).
//
// Per (B, T, H, KV, D, dtype) both graphs (forward with stats, backward with the deterministic
// algorithm, so repeated runs stay bit-identical) are built once, on first use, and cached. When
// cuDNN cannot run a shape (e.g. a head dim it does not support), both directions of that shape use
// attention.cu's kernels instead (one line on stderr says so, once per shape): forward and backward
// must agree on what lse is. Document-masked passes (doc_start != nullptr) always use attention.cu.
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"

#ifdef LATHE_HAVE_CUDNN
#include <cudnn.h>
#include <cudnn_frontend.h>
#endif

namespace lathe::cuda {

#ifdef LATHE_HAVE_CUDNN
namespace fe = cudnn_frontend;

namespace {

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

struct Shape {
  int64_t B, T, H, KV, D;
  DType dt;
  auto tie() const { return std::tie(B, T, H, KV, D, dt); }
  bool operator<(const Shape& o) const { return tie() < o.tie(); }
};

struct Graphs {
  bool ok = false;  // false: attention.cu's kernels run this shape
  std::shared_ptr<fe::graph::Graph> fwd, bwd;
  TensorPtr q, k, v, o, stats;                        // forward
  TensorPtr bq, bk, bv, bo, bdo, bstats, dq, dk, dv;  // backward
  int64_t fwd_ws = 0, bwd_ws = 0;
};

std::string status_text(cudnnStatus_t s) { return cudnnGetErrorString(s); }

cudnnHandle_t handle() {
  static cudnnHandle_t h = [] {
    cudnnHandle_t x = nullptr;
    const cudnnStatus_t s = cudnnCreate(&x);
    if (s != CUDNN_STATUS_SUCCESS) fail("cudnn attention: cudnnCreate: " + status_text(s));
    const cudnnStatus_t t = cudnnSetStream(x, stream());  // the backend's one stream
    if (t != CUDNN_STATUS_SUCCESS) fail("cudnn attention: cudnnSetStream: " + status_text(t));
    return x;
  }();
  return h;
}

fe::DataType_t io_type(DType d) { return d == DType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF; }

// Builds one graph through the frontend's steps; "" on success, else the failing step's message.
std::string build(fe::graph::Graph& g, int64_t* ws) {
  auto step = [](fe::error_t e, const char* what) -> std::string {
    return e.is_bad() ? std::string(what) + ": " + e.get_message() : std::string();
  };
  std::string e;
  if (!(e = step(g.validate(), "validate")).empty()) return e;
  if (!(e = step(g.build_operation_graph(handle()), "build_operation_graph")).empty()) return e;
  if (!(e = step(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans")).empty()) return e;
  if (!(e = step(g.check_support(), "check_support")).empty()) return e;
  if (!(e = step(g.build_plans(), "build_plans")).empty()) return e;
  return step(g.get_workspace_size(*ws), "get_workspace_size");
}

std::string make_graphs(const Shape& s, Graphs& gr) {
  const int64_t B = s.B, T = s.T, H = s.H, KV = s.KV, D = s.D, Q = (H + 2 * KV) * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  auto heads = [&](fe::graph::Graph& g, const char* name, int64_t n) {  // a strided view of qkv / dqkv
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_dim({B, n, T, D}).set_stride({T * Q, D, Q, 1}));
  };
  auto rows = [&](fe::graph::Graph& g, const char* name) {  // out / dout [B, T, H D]
    return g.tensor(
        fe::graph::Tensor_attributes().set_name(name).set_dim({B, H, T, D}).set_stride({T * H * D, D, H * D, 1}));
  };
  {
    gr.fwd = std::make_shared<fe::graph::Graph>();
    fe::graph::Graph& g = *gr.fwd;
    g.set_io_data_type(io_type(s.dt))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    gr.q = heads(g, "q", H);
    gr.k = heads(g, "k", KV);
    gr.v = heads(g, "v", KV);
    auto a =
        fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_causal_mask(true).set_attn_scale(
            scale);
    auto [o, stats] = g.sdpa(gr.q, gr.k, gr.v, a);
    o->set_output(true).set_dim({B, H, T, D}).set_stride({T * H * D, D, H * D, 1});
    stats->set_output(true).set_data_type(fe::DataType_t::FLOAT).set_dim({B, H, T, 1}).set_stride({H * T, T, 1, 1});
    gr.o = o;
    gr.stats = stats;
    if (std::string e = build(g, &gr.fwd_ws); !e.empty()) return "forward: " + e;
  }
  {
    gr.bwd = std::make_shared<fe::graph::Graph>();
    fe::graph::Graph& g = *gr.bwd;
    g.set_io_data_type(io_type(s.dt))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    gr.bq = heads(g, "q", H);
    gr.bk = heads(g, "k", KV);
    gr.bv = heads(g, "v", KV);
    gr.bo = rows(g, "o");
    gr.bdo = rows(g, "do");
    gr.bstats = g.tensor(fe::graph::Tensor_attributes()
                             .set_name("stats")
                             .set_dim({B, H, T, 1})
                             .set_stride({H * T, T, 1, 1})
                             .set_data_type(fe::DataType_t::FLOAT));
    auto a = fe::graph::SDPA_backward_attributes()
                 .set_name("sdpa_backward")
                 .set_causal_mask(true)
                 .set_attn_scale(scale)
                 .set_deterministic_algorithm(true);
    auto [dq, dk, dv] = g.sdpa_backward(gr.bq, gr.bk, gr.bv, gr.bo, gr.bdo, gr.bstats, a);
    dq->set_output(true).set_dim({B, H, T, D}).set_stride({T * Q, D, Q, 1});
    dk->set_output(true).set_dim({B, KV, T, D}).set_stride({T * Q, D, Q, 1});
    dv->set_output(true).set_dim({B, KV, T, D}).set_stride({T * Q, D, Q, 1});
    gr.dq = dq;
    gr.dk = dk;
    gr.dv = dv;
    if (std::string e = build(g, &gr.bwd_ws); !e.empty()) return "backward: " + e;
  }
  return {};
}

std::mutex g_mu;
// The cached graphs of a shape (built on first use); nullptr when cuDNN cannot run it.
const Graphs* graphs_for(const Shape& s) {
  static auto* cache = new std::map<Shape, Graphs>;  // process lifetime
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = cache->find(s);
  if (it == cache->end()) {
    Graphs gr;
    const std::string e = (s.D % 8 != 0) ? std::string("head dim not a multiple of 8") : make_graphs(s, gr);
    gr.ok = e.empty();
    if (!gr.ok) {
      std::fprintf(stderr,
                   "lathe: cuDNN SDPA cannot run B=%lld T=%lld H=%lld KV=%lld D=%lld (%s); lathe's attention kernels "
                   "run this shape\n",
                   static_cast<long long>(s.B), static_cast<long long>(s.T), static_cast<long long>(s.H),
                   static_cast<long long>(s.KV), static_cast<long long>(s.D), e.c_str());
      gr = Graphs{};
    }
    it = cache->emplace(s, std::move(gr)).first;
  }
  return it->second.ok ? &it->second : nullptr;
}

void run(const fe::graph::Graph& g, std::unordered_map<TensorPtr, void*>& pack, int64_t ws_bytes, const char* what) {
  void* ws = ws_bytes > 0 ? workspace(kSlotCudnn, static_cast<size_t>(ws_bytes)) : nullptr;
  fe::error_t e = g.execute(handle(), pack, ws);
  if (e.is_bad()) fail(std::string("cudnn attention: ") + what + ": execute: " + e.get_message());
}

}  // namespace

std::string cudnn_unavailable_reason() {
  const size_t v = cudnnGetVersion();
  if (v < 90000)
    return "the cuDNN library loaded is version " + std::to_string(v) + "; cuDNN's SDPA here needs 9.0 or newer";
  return {};
}

template <DType Dt>
void cudnn_attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                             int64_t D, void* scratch, const int32_t* doc_start, int64_t window, float scale,
                             float softcap) {
  // A sliding window shorter than the sample runs lathe's kernels (as documents do), and so does a
  // score scale other than 1/sqrt(D) or soft-capping (Gemma 2): the SDPA graphs here are built with
  // neither (cuDNN's graph has no tanh score modifier in this frontend path).
  const bool masked = doc_start || (window > 0 && window < T) || scale > 0.0f || softcap > 0.0f;
  const Graphs* g = masked ? nullptr : graphs_for({B, T, H, KVH, D, Dt});
  if (!g) return attention_forward<Dt>(out, lse, qkv, B, T, H, KVH, D, scratch, doc_start, window, scale, softcap);
  auto* base = static_cast<std::byte*>(const_cast<void*>(qkv));
  const int64_t e = 2;  // bytes per bf16 / fp16 element
  std::unordered_map<TensorPtr, void*> pack = {
      {g->q, base}, {g->k, base + H * D * e}, {g->v, base + (H + KVH) * D * e}, {g->o, out}, {g->stats, lse}};
  run(*g->fwd, pack, g->fwd_ws, "forward");
}

template <DType Dt>
void cudnn_attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                              int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, void* scratch,
                              const int32_t* doc_start, int64_t window, float scale, float softcap) {
  const bool masked = doc_start || (window > 0 && window < T) || scale > 0.0f || softcap > 0.0f;
  const Graphs* g = masked ? nullptr : graphs_for({B, T, H, KVH, D, Dt});
  if (!g)
    return attention_backward<Dt>(dqkv, dout, qkv, out, lse, B, T, H, KVH, D, scratch, doc_start, window, scale,
                                  softcap);
  auto* base = static_cast<std::byte*>(const_cast<void*>(qkv));
  auto* dbase = static_cast<std::byte*>(dqkv);
  const int64_t e = 2;
  std::unordered_map<TensorPtr, void*> pack = {{g->bq, base},
                                               {g->bk, base + H * D * e},
                                               {g->bv, base + (H + KVH) * D * e},
                                               {g->bo, const_cast<void*>(out)},
                                               {g->bdo, const_cast<void*>(dout)},
                                               {g->bstats, const_cast<float*>(lse)},
                                               {g->dq, dbase},
                                               {g->dk, dbase + H * D * e},
                                               {g->dv, dbase + (H + KVH) * D * e}};
  run(*g->bwd, pack, g->bwd_ws, "backward");
}

#else  // built without cuDNN's frontend headers or library: the tables are not offered

std::string cudnn_unavailable_reason() {
  return "this lathe was built without cuDNN (CMake found no cudnn_frontend.h or libcudnn; scripts/setup.sh installs "
         "the frontend headers, then reconfigure with -DLATHE_CUDA=ON)";
}

template <DType Dt>
void cudnn_attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                             int64_t D, void* scratch, const int32_t* doc_start, int64_t window, float scale,
                             float softcap) {
  fail("cudnn attention: " + cudnn_unavailable_reason());
}
template <DType Dt>
void cudnn_attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                              int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, void* scratch,
                              const int32_t* doc_start, int64_t window, float scale, float softcap) {
  fail("cudnn attention: " + cudnn_unavailable_reason());
}

#endif

template void cudnn_attention_forward<DType::BF16>(void*, float*, const void*, int64_t, int64_t, int64_t, int64_t,
                                                   int64_t, void*, const int32_t*, int64_t, float, float);
template void cudnn_attention_forward<DType::F16>(void*, float*, const void*, int64_t, int64_t, int64_t, int64_t,
                                                  int64_t, void*, const int32_t*, int64_t, float, float);
template void cudnn_attention_backward<DType::BF16>(void*, const void*, const void*, const void*, const float*, int64_t,
                                                    int64_t, int64_t, int64_t, int64_t, void*, const int32_t*, int64_t,
                                                    float, float);
template void cudnn_attention_backward<DType::F16>(void*, const void*, const void*, const void*, const float*, int64_t,
                                                   int64_t, int64_t, int64_t, int64_t, void*, const int32_t*, int64_t,
                                                   float, float);

}  // namespace lathe::cuda
