// Context-parallel attention: ring and all-gather K/V over a context group (context_parallel.h).
#include "parallel/context_parallel.h"

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace lathe::parallel {
namespace {
// Point-to-point tags of the ring (a pair's messages with one tag arrive in order).
constexpr int kTagKv = 2701, kTagDkv = 2702;
}  // namespace

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
  kv_floats_ = s.B * Tl_ * 2 * s.KVH * s.D;
  const size_t kv = static_cast<size_t>(kv_floats_);
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

// kv[B, Tl, 2 KVH D] <- the K | V columns of this rank's qkv rows.
void ContextAttention::pack_kv(float* kv, const float* qkv) const {
  const int64_t W = (s_.H + 2 * s_.KVH) * s_.D, KV = 2 * s_.KVH * s_.D;
  for (int64_t n = 0; n < s_.B * Tl_; ++n) std::copy_n(qkv + n * W + s_.H * s_.D, KV, kv + n * KV);
}

void ContextAttention::forward_block(float* out, float* lse, const float* qkv, const float* kv, int src,
                                     const int32_t* q_doc) const {
  cpu::BlockAttention a;
  a.B = s_.B, a.Tq = Tl_, a.Tk = Tl_, a.H = s_.H, a.KVH = s_.KVH, a.D = s_.D;
  a.q = qkv, a.ldq = (s_.H + 2 * s_.KVH) * s_.D;
  a.k = kv, a.v = kv + s_.KVH * s_.D, a.ldk = a.ldv = 2 * s_.KVH * s_.D;
  a.q_pos = rows_[static_cast<size_t>(rank_)].data(), a.k_pos = rows_[static_cast<size_t>(src)].data();
  a.q_doc = q_doc, a.window = s_.window;
  cpu::attention_block_forward(a, out, s_.H * s_.D, lse);
}

void ContextAttention::backward_block(float* dq, float* dkv, const float* dout, const float* qkv, const float* out,
                                      const float* lse, const float* kv, int src, const int32_t* q_doc) const {
  cpu::BlockAttention a;
  a.B = s_.B, a.Tq = Tl_, a.Tk = Tl_, a.H = s_.H, a.KVH = s_.KVH, a.D = s_.D;
  a.q = qkv, a.ldq = (s_.H + 2 * s_.KVH) * s_.D;
  a.k = kv, a.v = kv + s_.KVH * s_.D, a.ldk = a.ldv = 2 * s_.KVH * s_.D;
  a.q_pos = rows_[static_cast<size_t>(rank_)].data(), a.k_pos = rows_[static_cast<size_t>(src)].data();
  a.q_doc = q_doc, a.window = s_.window;
  cpu::attention_block_backward(a, out, dout, s_.H * s_.D, lse, dq, a.ldq, dkv, a.ldk, dkv + s_.KVH * s_.D, a.ldk);
}

void ContextAttention::forward(float* out, float* lse, const float* qkv, const int32_t* q_doc) {
  const int next = (rank_ + 1) % N_, prev = (rank_ + N_ - 1) % N_;
  const size_t kv_bytes = static_cast<size_t>(kv_floats_) * sizeof(float);
  float* cur = kv_a_.data();
  if (impl_ == ContextImpl::AllGather) {
    pack_kv(kv_a_.data() + static_cast<size_t>(rank_) * kv_floats_, qkv);
    group_.all_gather(kv_a_.data() + static_cast<size_t>(rank_) * kv_floats_, kv_a_.data(),
                      std::vector<size_t>(static_cast<size_t>(N_), static_cast<size_t>(kv_floats_)), DType::F32);
  } else {
    pack_kv(cur, qkv);
  }
  float* nxt = kv_b_.data();
  for (int step = 0; step < N_; ++step) {
    const int src = (rank_ - step + N_) % N_;
    dist::WorkPtr w;
    if (impl_ == ContextImpl::Ring && step + 1 < N_)
      w = group_.sendrecv_async(cur, kv_bytes, next, nxt, kv_bytes, prev, kTagKv);  // overlaps the block
    const float* kv = impl_ == ContextImpl::Ring ? cur : kv_a_.data() + static_cast<size_t>(src) * kv_floats_;
    if (step == 0) {
      forward_block(out, lse, qkv, kv, src, q_doc);
    } else {
      forward_block(out_b_.data(), lse_b_.data(), qkv, kv, src, q_doc);
      cpu::attention_lse_merge(out, lse, out_b_.data(), lse_b_.data(), s_.B, Tl_, s_.H, s_.D, s_.H * s_.D);
    }
    if (w) {
      w->wait();
      std::swap(cur, nxt);
    }
  }
}

void ContextAttention::backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                                const int32_t* q_doc) {
  const int next = (rank_ + 1) % N_, prev = (rank_ + N_ - 1) % N_;
  const int64_t W = (s_.H + 2 * s_.KVH) * s_.D, KV = 2 * s_.KVH * s_.D;
  const size_t kv_bytes = static_cast<size_t>(kv_floats_) * sizeof(float);
  std::fill(dqkv, dqkv + s_.B * Tl_ * W, 0.0f);  // dq accumulates over the blocks
  const float* own_dkv = nullptr;
  if (impl_ == ContextImpl::AllGather) {
    float* own = kv_a_.data() + static_cast<size_t>(rank_) * kv_floats_;
    pack_kv(own, qkv);
    group_.all_gather(own, kv_a_.data(), std::vector<size_t>(static_cast<size_t>(N_), static_cast<size_t>(kv_floats_)),
                      DType::F32);
    std::fill(dkv_a_.begin(), dkv_a_.end(), 0.0f);
    for (int step = 0; step < N_; ++step) {
      const int src = (rank_ - step + N_) % N_;
      const size_t off = static_cast<size_t>(src) * kv_floats_;
      backward_block(dqkv, dkv_a_.data() + off, dout, qkv, out, lse, kv_a_.data() + off, src, q_doc);
    }
    // dK/dV of this rank's rows: the group's contributions summed in rank order (in place into
    // this rank's segment, the layout reduce_scatter stages in pieces).
    float* mine = dkv_a_.data() + static_cast<size_t>(rank_) * kv_floats_;
    group_.reduce_scatter(dkv_a_.data(), mine, std::vector<size_t>(static_cast<size_t>(N_), static_cast<size_t>(kv_floats_)),
                          DType::F32);
    own_dkv = mine;
  } else {
    float *cur = kv_a_.data(), *nxt = kv_b_.data(), *dcur = dkv_a_.data(), *dnxt = dkv_b_.data();
    pack_kv(cur, qkv);
    std::fill(dcur, dcur + kv_floats_, 0.0f);
    for (int step = 0; step < N_; ++step) {
      const int src = (rank_ - step + N_) % N_;
      dist::WorkPtr w;
      if (step + 1 < N_) w = group_.sendrecv_async(cur, kv_bytes, next, nxt, kv_bytes, prev, kTagKv);
      if (step == 0) {
        backward_block(dqkv, dcur, dout, qkv, out, lse, cur, src, q_doc);
      } else {  // this block's own contribution, then added to what the earlier ranks summed
        std::fill(dkv_tmp_.begin(), dkv_tmp_.end(), 0.0f);
        backward_block(dqkv, dkv_tmp_.data(), dout, qkv, out, lse, cur, src, q_doc);
        for (int64_t i = 0; i < kv_floats_; ++i) dcur[i] += dkv_tmp_[static_cast<size_t>(i)];
      }
      if (w) {
        w->wait();
        std::swap(cur, nxt);
      }
      // The dK/dV summed so far move on with their K/V; the N-th hop hands each owner its own.
      if (N_ > 1) {
        group_.sendrecv(dcur, kv_bytes, next, dnxt, kv_bytes, prev, kTagDkv);
        std::swap(dcur, dnxt);
      }
    }
    own_dkv = dcur;
  }
  for (int64_t n = 0; n < s_.B * Tl_; ++n) std::copy_n(own_dkv + n * KV, KV, dqkv + n * W + s_.H * s_.D);
}

}  // namespace lathe::parallel
