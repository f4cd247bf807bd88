// Context-parallel attention: ring and all-gather K/V over a context group (context_parallel.h).
#include "parallel/context_parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <utility>

#include "core/error.h"
#include "core/trace.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/storage.h"
#include "models/documents.h"
#include "models/model.h"

namespace lathe::parallel {
namespace {
// Point-to-point tags of the ring (a pair's messages with one tag arrive in order).
constexpr int kTagKv = 2701, kTagDkv = 2702;
std::atomic<int64_t> g_wait_ns{0};
// Adds the time from its construction to its end to context_comm_wait_seconds().
class WaitClock {
 public:
  WaitClock() : t0_(std::chrono::steady_clock::now()) {}
  ~WaitClock() {
    g_wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_)
                            .count(),
                        std::memory_order_relaxed);
  }

 private:
  std::chrono::steady_clock::time_point t0_;
};
}  // namespace

double context_comm_wait_seconds() { return static_cast<double>(g_wait_ns.load(std::memory_order_relaxed)) * 1e-9; }

ContextImpl parse_context_impl(const std::string& s) {
  if (s == "ring") return ContextImpl::Ring;
  if (s == "allgather") return ContextImpl::AllGather;
  throw_error("parallel.context_impl: '{}' is not one of ring, allgather", s);
}

const char* context_impl_name(ContextImpl impl) { return impl == ContextImpl::Ring ? "ring" : "allgather"; }

void check_context_split(int64_t T, int N) {
  LATHE_CHECK(N >= 1, "parallel.context = {} must be >= 1", N);
  LATHE_CHECK(T % (2 * static_cast<int64_t>(N)) == 0,
              "parallel.context = {}: the sequence length {} is not divisible by 2 x context = {} (each context "
              "rank holds two of 2N equal chunks); choose a seq_len that is a multiple of {}",
              N, T, 2 * N, 2 * N);
}

std::vector<int32_t> context_rows(int64_t T, int N, int r) {
  check_context_split(T, N);
  LATHE_CHECK(r >= 0 && r < N, "context rank {} outside [0, {})", r, N);
  const int64_t C = T / (2 * N);
  std::vector<int32_t> rows;
  rows.reserve(static_cast<size_t>(2 * C));
  for (int64_t c : {static_cast<int64_t>(r), 2 * static_cast<int64_t>(N) - 1 - r})
    for (int64_t t = c * C; t < (c + 1) * C; ++t) rows.push_back(static_cast<int32_t>(t));
  return rows;
}

ContextAttention::ContextAttention(dist::Communicator& group, ContextImpl impl, const ContextAttentionShape& s)
    : group_(group), impl_(impl), s_(s), N_(group.size()), rank_(group.rank()) {
  LATHE_CHECK(s.B >= 1 && s.H >= 1 && s.KVH >= 1 && s.D >= 1 && s.H % s.KVH == 0,
              "context attention: invalid shape B={} H={} KVH={} D={}", s.B, s.H, s.KVH, s.D);
  for (int r = 0; r < N_; ++r) rows_.push_back(context_rows(s.T, N_, r));
  Tl_ = s.T / N_;
  const size_t kv = static_cast<size_t>(s.B * Tl_ * 2 * s.KVH * s.D);
  const size_t copies = impl == ContextImpl::AllGather ? static_cast<size_t>(N_) : 1;
  kv_a_.resize(kv * copies);
  dkv_a_.resize(kv * copies);
  if (impl == ContextImpl::Ring) {
    kv_b_.resize(kv);
    dkv_b_.resize(kv);
    dkv_tmp_.resize(kv);
  }
  out_b_.resize(static_cast<size_t>(s.B * Tl_ * s.H * s.D));
  lse_b_.resize(static_cast<size_t>(s.B * s.H * Tl_));
}

ContextAttention::Call ContextAttention::call(const char* fn, int64_t B, int64_t window, const int32_t* q_doc) const {
  LATHE_CHECK(B >= 1 && B <= s_.B, "{}: micro-batch {} outside [1, {}] (the context attention's allocation)", fn, B,
              s_.B);
  LATHE_CHECK(window >= 0, "{}: window = {} must be >= 0 (0 = none)", fn, window);
  return Call{B, window, B * Tl_ * 2 * s_.KVH * s_.D, q_doc};
}

// kv[B, Tl, 2 KVH D] <- the K | V columns of this rank's qkv rows.
void ContextAttention::pack_kv(float* kv, const float* qkv, int64_t B) const {
  const int64_t W = (s_.H + 2 * s_.KVH) * s_.D, KV = 2 * s_.KVH * s_.D;
  for (int64_t n = 0; n < B * Tl_; ++n) std::copy_n(qkv + n * W + s_.H * s_.D, KV, kv + n * KV);
}

cpu::BlockAttention ContextAttention::block(const Call& c, const float* qkv, const float* kv, int src) const {
  cpu::BlockAttention a;
  a.B = c.B, a.Tq = Tl_, a.Tk = Tl_, a.H = s_.H, a.KVH = s_.KVH, a.D = s_.D;
  a.q = qkv, a.ldq = (s_.H + 2 * s_.KVH) * s_.D;
  a.k = kv, a.v = kv + s_.KVH * s_.D, a.ldk = a.ldv = 2 * s_.KVH * s_.D;
  a.q_pos = rows_[static_cast<size_t>(rank_)].data(), a.k_pos = rows_[static_cast<size_t>(src)].data();
  a.q_doc = c.q_doc, a.window = c.window;
  a.scale = s_.scale, a.softcap = s_.softcap;
  return a;
}

void ContextAttention::forward(float* out, float* lse, const float* qkv, const int32_t* q_doc, int64_t B,
                               int64_t window) {
  const Call c = call("context attention forward", B, window, q_doc);
  const int next = (rank_ + 1) % N_, prev = (rank_ + N_ - 1) % N_;
  const size_t kv_bytes = static_cast<size_t>(c.kv_floats) * sizeof(float);
  const int64_t ldo = s_.H * s_.D;
  float* cur = kv_a_.data();
  if (impl_ == ContextImpl::AllGather) {
    float* own = kv_a_.data() + static_cast<size_t>(rank_) * c.kv_floats;
    pack_kv(own, qkv, B);
    const WaitClock clock;
    group_.all_gather(own, kv_a_.data(), std::vector<size_t>(static_cast<size_t>(N_), static_cast<size_t>(c.kv_floats)),
                      DType::F32);
  } else {
    pack_kv(cur, qkv, B);
  }
  float* nxt = kv_b_.data();
  for (int step = 0; step < N_; ++step) {
    const int src = (rank_ - step + N_) % N_;
    dist::WorkPtr w;
    if (impl_ == ContextImpl::Ring && step + 1 < N_)
      w = group_.sendrecv_async(cur, kv_bytes, next, nxt, kv_bytes, prev, kTagKv);  // overlaps the block
    const float* kv = impl_ == ContextImpl::Ring ? cur : kv_a_.data() + static_cast<size_t>(src) * c.kv_floats;
    trace::Scope span("context attention block forward", trace::Cat::Compute, src);  // arg: the K/V's rank
    if (step == 0) {
      cpu::attention_block_forward(block(c, qkv, kv, src), out, ldo, lse);
    } else {
      cpu::attention_block_forward(block(c, qkv, kv, src), out_b_.data(), ldo, lse_b_.data());
      cpu::attention_lse_merge(out, lse, out_b_.data(), lse_b_.data(), B, Tl_, s_.H, s_.D, ldo);
    }
    if (w) {
      trace::Scope wait_span("context ring wait (K/V)", trace::Cat::Comm, step);
      const WaitClock clock;
      w->wait();
      std::swap(cur, nxt);
    }
  }
}

void ContextAttention::backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                                const int32_t* q_doc, int64_t B, int64_t window) {
  const Call c = call("context attention backward", B, window, q_doc);
  const int next = (rank_ + 1) % N_, prev = (rank_ + N_ - 1) % N_;
  const int64_t W = (s_.H + 2 * s_.KVH) * s_.D, KV = 2 * s_.KVH * s_.D, ldo = s_.H * s_.D;
  const size_t kv_bytes = static_cast<size_t>(c.kv_floats) * sizeof(float);
  const size_t n_kv = static_cast<size_t>(c.kv_floats);
  // One block's backward: dq += into dqkv, dk/dv += into dkv (a packed K|V-shaped buffer).
  auto run_block = [&](float* dkv, const float* kv, int src) {
    trace::Scope span("context attention block backward", trace::Cat::Compute, src);
    cpu::attention_block_backward(block(c, qkv, kv, src), out, dout, ldo, lse, dqkv, W, dkv, KV, dkv + s_.KVH * s_.D,
                                  KV);
  };
  std::fill(dqkv, dqkv + B * Tl_ * W, 0.0f);  // dq accumulates over the blocks
  const float* own_dkv = nullptr;
  if (impl_ == ContextImpl::AllGather) {
    float* own = kv_a_.data() + static_cast<size_t>(rank_) * n_kv;
    pack_kv(own, qkv, B);
    const std::vector<size_t> counts(static_cast<size_t>(N_), n_kv);
    {
      const WaitClock clock;
      group_.all_gather(own, kv_a_.data(), counts, DType::F32);
    }
    std::fill(dkv_a_.begin(), dkv_a_.begin() + static_cast<std::ptrdiff_t>(N_ * n_kv), 0.0f);
    for (int step = 0; step < N_; ++step) {
      const int src = (rank_ - step + N_) % N_;
      run_block(dkv_a_.data() + static_cast<size_t>(src) * n_kv, kv_a_.data() + static_cast<size_t>(src) * n_kv, src);
    }
    // dK/dV of this rank's rows: the group's contributions summed in rank order (in place into
    // this rank's segment, the layout reduce_scatter stages in pieces).
    float* mine = dkv_a_.data() + static_cast<size_t>(rank_) * n_kv;
    {
      const WaitClock clock;
      group_.reduce_scatter(dkv_a_.data(), mine, counts, DType::F32);
    }
    own_dkv = mine;
  } else {
    float *cur = kv_a_.data(), *nxt = kv_b_.data(), *dcur = dkv_a_.data(), *dnxt = dkv_b_.data();
    pack_kv(cur, qkv, B);
    std::fill(dcur, dcur + n_kv, 0.0f);
    for (int step = 0; step < N_; ++step) {
      const int src = (rank_ - step + N_) % N_;
      dist::WorkPtr w;
      if (step + 1 < N_) w = group_.sendrecv_async(cur, kv_bytes, next, nxt, kv_bytes, prev, kTagKv);
      if (step == 0) {
        run_block(dcur, cur, src);
      } else {  // this block's own contribution, then added to what the earlier ranks summed
        std::fill(dkv_tmp_.begin(), dkv_tmp_.begin() + static_cast<std::ptrdiff_t>(n_kv), 0.0f);
        run_block(dkv_tmp_.data(), cur, src);
        for (size_t i = 0; i < n_kv; ++i) dcur[i] += dkv_tmp_[i];
      }
      if (w) {
        trace::Scope wait_span("context ring wait (K/V)", trace::Cat::Comm, step);
        const WaitClock clock;
        w->wait();
        std::swap(cur, nxt);
      }
      // The dK/dV summed so far move on with their K/V; the N-th hop hands each owner its own.
      if (N_ > 1) {
        trace::Scope dkv_span("context ring dK/dV exchange", trace::Cat::Comm, step);
        const WaitClock clock;
        group_.sendrecv(dcur, kv_bytes, next, dnxt, kv_bytes, prev, kTagDkv);
        std::swap(dcur, dnxt);
      }
    }
    own_dkv = dcur;
  }
  for (int64_t n = 0; n < B * Tl_; ++n) std::copy_n(own_dkv + n * KV, KV, dqkv + n * W + s_.H * s_.D);
}

namespace {
// 16-bit compute (bf16 / fp16 tables): the rank's rows widened to fp32, the fp32 context attention,
// each output rounded once (as the tables' own attention: fp32 math on widened copies).
template <class P>
void widen(float* dst, const void* src, int64_t n) {
  P::to_f32(dst, static_cast<const uint16_t*>(src), n);
}
template <class P>
void narrow(void* dst, const float* src, int64_t n) {
  P::from_f32(static_cast<uint16_t*>(dst), src, n);
}
struct Widened {
  std::vector<float> qkv, out, dout, dqkv;
};
template <class P>
void attach_half(Model& m, std::shared_ptr<ContextAttention> ca, int64_t B, int64_t Tl) {
  const ModelConfig& c = m.config();
  const int64_t W = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim();
  const int64_t O = c.num_attention_heads * c.head_dim();
  auto w = std::make_shared<Widened>();
  w->qkv.resize(static_cast<size_t>(B * Tl * W));
  w->dqkv.resize(w->qkv.size());
  w->out.resize(static_cast<size_t>(B * Tl * O));
  w->dout.resize(w->out.size());
  m.hooks().cp.attention_forward = [ca, w, W, O, Tl](void* out, float* lse, const void* qkv, const int32_t* ds,
                                                     int64_t b, int64_t window) {
    widen<P>(w->qkv.data(), qkv, b * Tl * W);
    ca->forward(w->out.data(), lse, w->qkv.data(), ds, b, window);
    narrow<P>(out, w->out.data(), b * Tl * O);
  };
  m.hooks().cp.attention_backward = [ca, w, W, O, Tl](void* dqkv, const void* dout, const void* qkv, const void* out,
                                                      const float* lse, const int32_t* ds, int64_t b, int64_t window) {
    widen<P>(w->qkv.data(), qkv, b * Tl * W);
    widen<P>(w->out.data(), out, b * Tl * O);
    widen<P>(w->dout.data(), dout, b * Tl * O);
    ca->backward(w->dqkv.data(), w->dout.data(), w->qkv.data(), w->out.data(), lse, ds, b, window);
    narrow<P>(dqkv, w->dqkv.data(), b * Tl * W);
  };
}
}  // namespace

void attach_context_parallel(Model& m, dist::Communicator& group, ContextImpl impl, int64_t B, int64_t T) {
  check_context_split(T, group.size());
  TensorShard shard = m.tensor_shard();
  shard.context_T = T;
  m.set_tensor_shard(shard);
  const ModelConfig& c = m.config();
  auto ca =
      std::make_shared<ContextAttention>(group, impl,
                                         ContextAttentionShape{B, T, c.num_attention_heads, c.num_key_value_heads,
                                                               c.head_dim(), c.attention_scale(), c.attn_softcap()});
  const DType dt = m.compute_dtype();
  if (dt == DType::BF16) return attach_half<cpu::Bf16>(m, ca, B, T / group.size());
  if (dt == DType::F16) return attach_half<cpu::Fp16>(m, ca, B, T / group.size());
  LATHE_CHECK(dt == DType::F32, "parallel.context: compute dtype {} has no context-parallel attention",
              dtype_name(dt));
  m.hooks().cp.attention_forward = [ca](void* out, float* lse, const void* qkv, const int32_t* ds, int64_t b,
                                        int64_t window) {
    ca->forward(static_cast<float*>(out), lse, static_cast<const float*>(qkv), ds, b, window);
  };
  m.hooks().cp.attention_backward = [ca](void* dqkv, const void* dout, const void* qkv, const void* out,
                                         const float* lse, const int32_t* ds, int64_t b, int64_t window) {
    ca->backward(static_cast<float*>(dqkv), static_cast<const float*>(dout), static_cast<const float*>(qkv),
                 static_cast<const float*>(out), lse, ds, b, window);
  };
}

void context_batch(const std::vector<int32_t>& rows, int64_t B, int64_t T, const int32_t* full, int32_t* local) {
  const int64_t Tl = static_cast<int64_t>(rows.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tl; ++i) local[b * Tl + i] = full[b * T + rows[static_cast<size_t>(i)]];
}

void context_positions(const std::vector<int32_t>& rows, int64_t B, int64_t T, const int32_t* positions_full,
                       int32_t* positions) {
  const int64_t Tl = static_cast<int64_t>(rows.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tl; ++i)
      positions[b * Tl + i] = positions_full ? positions_full[b * T + rows[static_cast<size_t>(i)]] : rows[i];
}

void set_context_pass(Model& m, const DocumentOptions& o, const std::vector<int32_t>& rows, const int32_t* tokens,
                      const int32_t* targets, int64_t B, int64_t T, std::vector<int32_t>& tokens_l,
                      std::vector<int32_t>& targets_l, std::vector<int32_t>& ds, std::vector<int32_t>& pos) {
  const int64_t Tl = static_cast<int64_t>(rows.size());
  const size_t n = static_cast<size_t>(B * T), nl = static_cast<size_t>(B * Tl);
  tokens_l.resize(nl);
  targets_l.resize(nl);
  context_batch(rows, B, T, tokens, tokens_l.data());
  context_batch(rows, B, T, targets, targets_l.data());
  std::vector<int32_t> full_ds, full_pos;
  if (o.model_needs_documents()) {
    full_ds.resize(n);
    full_pos.resize(n);
    documents_from_eod(tokens, B, T, o.eod, full_ds.data(), full_pos.data());
  }
  ds.resize(nl);
  pos.resize(nl);
  if (o.document_attention) context_batch(rows, B, T, full_ds.data(), ds.data());
  context_positions(rows, B, T, o.reset_positions ? full_pos.data() : nullptr, pos.data());
  // max(position) + 1 over the whole samples (dynamic NTK RoPE reads it; this rank's rows may stop
  // short of it): the one-process run's.
  const int64_t len = o.reset_positions ? int64_t{*std::max_element(full_pos.begin(), full_pos.end())} + 1 : T;
  m.set_documents(o.document_attention ? ds.data() : nullptr, pos.data(), B, Tl, len);
}

}  // namespace lathe::parallel
