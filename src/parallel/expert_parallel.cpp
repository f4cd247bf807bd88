// Expert parallelism: the MoE block's dispatch / experts / combine over an expert group
// (parallel/expert_parallel.h).
#include "parallel/expert_parallel.h"

#include <fmt/format.h>

#include <cstring>

#include "core/error.h"
#include "models/model.h"

namespace lathe::parallel {

ExpertParallel::ExpertParallel(dist::Communicator& group, int64_t experts)
    : group_(group), experts_(experts), local_(0), first_(0) {
  const int64_t g = group.size();
  LATHE_CHECK(g >= 1 && experts >= 1 && experts % g == 0,
              "parallel.expert = {} does not divide the model's {} experts (num_local_experts): choose a divisor of "
              "{}",
              g, experts, experts);
  local_ = experts / g;
  first_ = local_ * group.rank();
}

ExpertParallel::Layer& ExpertParallel::layer(int64_t l) {
  LATHE_CHECK(l >= 0, "internal: expert-parallel layer {}", l);
  if (static_cast<size_t>(l) >= layers_.size()) layers_.resize(static_cast<size_t>(l) + 1);
  return layers_[static_cast<size_t>(l)];
}

void ExpertParallel::exchange(const float* src, const std::vector<size_t>& send, float* dst,
                              const std::vector<size_t>& recv, int64_t C) {
  std::vector<size_t> sc(send.size()), rc(recv.size());
  for (size_t i = 0; i < send.size(); ++i) {
    sc[i] = send[i] * static_cast<size_t>(C);
    rc[i] = recv[i] * static_cast<size_t>(C);
  }
  group_.all_to_all(src, sc, dst, rc, DType::F32);
}

namespace {
// Rows r of `src` [.., W] -> dst[r] = src[perm[r]] (gather) or dst[perm[r]] = src[r] (scatter).
void permute_rows(float* dst, const float* src, const std::vector<int64_t>& perm, int64_t W, bool scatter) {
  const size_t w = static_cast<size_t>(W);
#pragma omp parallel for schedule(static) if (perm.size() * w >= 65536)
  for (size_t r = 0; r < perm.size(); ++r) {
    const size_t p = static_cast<size_t>(perm[r]);
    if (scatter)
      std::memcpy(dst + p * w, src + r * w, w * sizeof(float));
    else
      std::memcpy(dst + r * w, src + p * w, w * sizeof(float));
  }
}
}  // namespace

void ExpertParallel::forward(float* out, const cpu::MoeActs& a, const float* x, const float* wr, const float* w1,
                             const float* w3, const float* w2, const cpu::MoeShape& s, int64_t l) {
  LATHE_CHECK(s.E == experts_, "internal: expert parallelism set up for {} experts, the layer has {}", experts_, s.E);
  const int64_t N = s.N, k = s.k, C = s.C, F = s.F, S = N * k, L = local_;
  const size_t G = static_cast<size_t>(group_.size());
  // 1. Router, top-k and the expert-sorted slots, as on one process (kernels/cpu/moe.cpp).
  cpu::matmul_forward(a.logits, x, wr, nullptr, N, C, s.E);
  cpu::moe_router_forward(a.probs, a.topk_idx, a.topk_w, a.logits, N, s.E, k, s.score, s.renormalize);
  cpu::moe_permute(a.offsets, a.slot_token, a.slot_k, a.token_slot, a.topk_idx, N, s.E, k);
  cpu::moe_gather(a.xp, x, a.slot_token, S, C);
  // 2. Counts first: member m owns experts [m L, (m+1) L), i.e. the slot run
  // [offsets[m L], offsets[(m+1) L]); it learns how many rows each source has for each of them.
  Layer& ly = layer(l);
  std::vector<int64_t> send_cnt(G * static_cast<size_t>(L));
  ly.send_rows.assign(G, 0);
  for (size_t m = 0; m < G; ++m)
    for (int64_t j = 0; j < L; ++j) {
      const int64_t e = static_cast<int64_t>(m) * L + j;
      send_cnt[m * static_cast<size_t>(L) + static_cast<size_t>(j)] = a.offsets[e + 1] - a.offsets[e];
      ly.send_rows[m] += static_cast<size_t>(a.offsets[e + 1] - a.offsets[e]);
    }
  ly.recv_cnt.assign(G * static_cast<size_t>(L), 0);
  const std::vector<size_t> per_peer(G, static_cast<size_t>(L));
  group_.all_to_all(send_cnt.data(), per_peer, ly.recv_cnt.data(), per_peer, DType::I64);
  // 3. The rows: received source-major [source][local expert][token order]; the owner computes them
  // expert-major [local expert][source][token order] (perm: expert-major row -> received row).
  ly.recv_rows.assign(G, 0);
  std::vector<int64_t> block_start(G * static_cast<size_t>(L));  // received row where (source, expert) starts
  int64_t R = 0;
  for (size_t i = 0; i < G; ++i)
    for (int64_t j = 0; j < L; ++j) {
      const size_t b = i * static_cast<size_t>(L) + static_cast<size_t>(j);
      block_start[b] = R;
      R += ly.recv_cnt[b];
      ly.recv_rows[i] += static_cast<size_t>(ly.recv_cnt[b]);
    }
  ly.offsets.assign(static_cast<size_t>(L) + 1, 0);
  ly.perm.resize(static_cast<size_t>(R));
  size_t at = 0;
  for (int64_t j = 0; j < L; ++j) {
    for (size_t i = 0; i < G; ++i) {
      const size_t b = i * static_cast<size_t>(L) + static_cast<size_t>(j);
      for (int64_t r = 0; r < ly.recv_cnt[b]; ++r) ly.perm[at++] = block_start[b] + r;
    }
    ly.offsets[static_cast<size_t>(j) + 1] = static_cast<int32_t>(at);
  }
  std::vector<float> recv(static_cast<size_t>(R * C)), y(static_cast<size_t>(R * C));
  exchange(a.xp, ly.send_rows, recv.data(), ly.recv_rows, C);
  ly.xp.resize(static_cast<size_t>(R * C));
  permute_rows(ly.xp.data(), recv.data(), ly.perm, C, false);
  // 4. This rank's experts over every row routed to them.
  ly.gate.resize(static_cast<size_t>(R * F));
  ly.up.resize(static_cast<size_t>(R * F));
  ly.act.resize(static_cast<size_t>(R * F));
  cpu::moe_experts_forward(y.data(), ly.gate.data(), ly.up.data(), ly.act.data(), ly.xp.data(), w1 + first_ * F * C,
                           w3 + first_ * F * C, w2 + first_ * C * F, ly.offsets.data(), L, C, F);
  // 5. Outputs back to their sources, into the source's slot order (a.y), then the combine.
  permute_rows(recv.data(), y.data(), ly.perm, C, true);
  exchange(recv.data(), ly.recv_rows, a.y, ly.send_rows, C);
  cpu::moe_combine(out, a.y, a.topk_w, a.token_slot, N, k, C);
}

void ExpertParallel::backward(float* dx, float* dwr, float* dw1, float* dw3, float* dw2, const float* dout,
                              const float* dlogits_add, const cpu::MoeActs& a, const float* x, const float* wr,
                              const float* w1, const float* w3, const float* w2, const cpu::MoeShape& s, float* scratch,
                              int64_t l) {
  LATHE_CHECK(static_cast<size_t>(l) < layers_.size() && !layers_[static_cast<size_t>(l)].offsets.empty(),
              "internal: expert-parallel backward of layer {} before its forward", l);
  Layer& ly = layers_[static_cast<size_t>(l)];
  const int64_t N = s.N, k = s.k, C = s.C, F = s.F, S = N * k, L = local_;
  const int64_t R = static_cast<int64_t>(ly.perm.size());
  // scratch as cpu::moe_backward's: dy, dxp [S, C]; (unused here) [2 S F]; dtopk_w [S]; dlogits [N, E]
  float* dy = scratch;
  float* dxp = dy + S * C;
  float* dtopk_w = dxp + S * C + 2 * S * F;
  float* dlogits = dtopk_w + S;
  cpu::moe_combine_backward(dy, dtopk_w, dout, a.y, a.topk_w, a.token_slot, N, k, C);
  // Slot gradients to the owners, the owner's expert backward (its experts' weight gradients only),
  // input gradients back to the sources.
  std::vector<float> recv(static_cast<size_t>(R * C)), dyl(static_cast<size_t>(R * C)), dxl(static_cast<size_t>(R * C)),
      dgu(static_cast<size_t>(2 * R * F));
  exchange(dy, ly.send_rows, recv.data(), ly.recv_rows, C);
  permute_rows(dyl.data(), recv.data(), ly.perm, C, false);
  cpu::moe_experts_backward(dxl.data(), dw1 + first_ * F * C, dw3 + first_ * F * C, dw2 + first_ * C * F, dyl.data(),
                            ly.xp.data(), ly.gate.data(), ly.up.data(), ly.act.data(), w1 + first_ * F * C,
                            w3 + first_ * F * C, w2 + first_ * C * F, ly.offsets.data(), L, C, F, dgu.data());
  permute_rows(recv.data(), dxl.data(), ly.perm, C, true);
  exchange(recv.data(), ly.recv_rows, dxp, ly.send_rows, C);
  // The rest is local, as in cpu::moe_backward.
  cpu::moe_gather_backward(dx, dxp, a.token_slot, N, k, C);
  cpu::moe_router_backward(dlogits, dtopk_w, dlogits_add, a.probs, a.topk_idx, N, s.E, k, s.score, s.renormalize);
  cpu::matmul_backward(dx, dwr, nullptr, dlogits, x, wr, N, C, s.E, /*accumulate_dinp=*/true);
}

ExpertAttachment attach_expert_parallel(Model& m, dist::Communicator& data, int expert) {
  const int64_t experts = m.arch().moe_experts;
  LATHE_CHECK(experts > 0,
              "parallel.expert = {} needs a mixture-of-experts model (this model has no experts); set "
              "parallel.expert: 1",
              expert);
  LATHE_CHECK(expert >= 1 && data.size() % expert == 0,
              "parallel.expert = {} does not divide the data degree {} (expert groups are carved from the data "
              "ranks): choose a divisor of {}",
              expert, data.size(), data.size());
  ExpertAttachment out;
  // Expert group g: data ranks g*expert .. g*expert + expert-1, in data-rank order.
  out.group = data.split(data.rank() / expert, data.rank(), "expert");
  out.ep = std::make_unique<ExpertParallel>(*out.group, experts);
  ExpertParallel* ep = out.ep.get();
  m.hooks().ep.forward = [ep](float* o, const cpu::MoeActs& a, const float* x, const float* wr, const float* w1,
                              const float* w3, const float* w2, const cpu::MoeShape& s,
                              int64_t l) { ep->forward(o, a, x, wr, w1, w3, w2, s, l); };
  m.hooks().ep.backward = [ep](float* dx, float* dwr, float* dw1, float* dw3, float* dw2, const float* dout,
                               const float* add, const cpu::MoeActs& a, const float* x, const float* wr,
                               const float* w1, const float* w3, const float* w2, const cpu::MoeShape& s,
                               float* scratch, int64_t l) {
    ep->backward(dx, dwr, dw1, dw3, dw2, dout, add, a, x, wr, w1, w3, w2, s, scratch, l);
  };
  return out;
}

LocalExperts::LocalExperts(Model& m) : m_(m), saved_(std::move(m.hooks().ep)) { m.hooks().ep = {}; }
LocalExperts::~LocalExperts() { m_.hooks().ep = std::move(saved_); }

}  // namespace lathe::parallel
