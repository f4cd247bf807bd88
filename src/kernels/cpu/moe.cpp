// Mixture-of-experts block on the CPU (issue 28): router scores and top-k, the stable permutation
// of tokens by expert, the grouped SwiGLU expert GEMMs, the weighted combine, their backward, and
// the load-balancing and z losses. Contract and shapes in kernels/cpu/ops.h ("mixture of experts").
//
// Determinism: every loop writes rows it alone owns, sums run in a fixed order (token order, j
// order, row order), and the per-expert GEMMs run inside one OpenMP loop over the experts, where
// OpenBLAS (the OpenMP build) runs single-threaded: each expert's GEMM is the single-threaded one
// whatever the thread count, so results are bit-identical for 1, 2 or any number of threads.
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace lathe::cpu {

namespace {

// Below this many floats an OpenMP fork costs more than the loop itself.
constexpr int64_t kParallelMin = 1 << 14;

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }
inline float sigmoidf(float g) { return 1.0f / (1.0f + std::exp(-g)); }

void check_shape(const MoeShape& s) {
  LATHE_CHECK(s.N >= 0 && s.C > 0 && s.F > 0 && s.E > 0, "moe: bad shape N={} C={} F={} E={}; all must be positive",
              s.N, s.C, s.F, s.E);
  LATHE_CHECK(s.k >= 1 && s.k <= s.E, "moe: top-k k={} must be in [1, E={}]; set moe top_k within the expert count",
              s.k, s.E);
  LATHE_CHECK(s.N * s.k <= INT32_MAX, "moe: N*k={} slots do not fit the int32 permutation; use smaller micro-batches",
              s.N * s.k);
}

// Scores of one row: softmax (max-subtracted, fp32, sum in index order) or elementwise sigmoid.
void score_row(float* p, const float* l, int64_t E, MoeScore score) {
  if (score == MoeScore::sigmoid) {
    for (int64_t e = 0; e < E; ++e) p[e] = sigmoidf(l[e]);
    return;
  }
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) m = l[e] > m ? l[e] : m;
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    p[e] = std::exp(l[e] - m);
    sum += p[e];
  }
  const float inv = 1.0f / sum;
  for (int64_t e = 0; e < E; ++e) p[e] *= inv;
}

// dlogit = J_score^T dp for one row (dp overwritten by dlogit may alias).
void score_row_backward(float* dl, const float* dp, const float* p, int64_t E, MoeScore score) {
  if (score == MoeScore::sigmoid) {
    for (int64_t e = 0; e < E; ++e) dl[e] = dp[e] * p[e] * (1.0f - p[e]);
    return;
  }
  float dot = 0.0f;
  for (int64_t e = 0; e < E; ++e) dot += dp[e] * p[e];
  for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dp[e] - dot);
}

}  // namespace

// ============================================ router ============================================

void moe_router_forward(float* probs, int32_t* topk_idx, float* topk_w, const float* logits, int64_t N, int64_t E,
                        int64_t k, MoeScore score, bool renormalize, const float* select_bias) {
  LATHE_CHECK(E > 0 && k >= 1 && k <= E, "moe router: top-k k={} must be in [1, E={}]", k, E);
#pragma omp parallel for schedule(static) if (N * E >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    float* p = probs + n * E;
    score_row(p, logits + n * E, E, score);
    int32_t* idx = topk_idx + n * k;
    float* w = topk_w + n * k;
    // k passes of an arg-max over the experts not chosen yet: strict '>' keeps the lower index
    // on ties (and a NaN never displaces a choice, so the k indices are always distinct).
    auto rank = [&](int64_t e) { return select_bias != nullptr ? p[e] + select_bias[e] : p[e]; };
    float wsum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken = taken || idx[i] == e;
        if (taken) continue;
        if (best < 0 || rank(e) > rank(best)) best = e;
      }
      idx[j] = static_cast<int32_t>(best);
      w[j] = p[best];
      wsum += w[j];
    }
    if (renormalize) {
      for (int64_t j = 0; j < k; ++j) w[j] /= wsum;
    }
  }
}

void moe_router_backward(float* dlogits, const float* dtopk_w, const float* dlogits_add, const float* probs,
                         const int32_t* topk_idx, int64_t N, int64_t E, int64_t k, MoeScore score, bool renormalize) {
#pragma omp parallel for schedule(static) if (N * E >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* p = probs + n * E;
    const int32_t* idx = topk_idx + n * k;
    const float* dw = dtopk_w + n * k;
    float* dl = dlogits + n * E;
    // dp: the gradient w.r.t. the scores, nonzero at the chosen experts only. With
    // renormalisation w_j = s_j / S (S = sum of the chosen scores):
    //   d s_j = (dw_j - sum_i dw_i w_i) / S = (dw_j - sum_i dw_i s_i / S) / S.
    for (int64_t e = 0; e < E; ++e) dl[e] = 0.0f;
    if (renormalize) {
      float S = 0.0f, dws = 0.0f;
      for (int64_t j = 0; j < k; ++j) S += p[idx[j]];
      for (int64_t j = 0; j < k; ++j) dws += dw[j] * (p[idx[j]] / S);
      for (int64_t j = 0; j < k; ++j) dl[idx[j]] = (dw[j] - dws) / S;
    } else {
      for (int64_t j = 0; j < k; ++j) dl[idx[j]] = dw[j];
    }
    score_row_backward(dl, dl, p, E, score);
    if (dlogits_add != nullptr) {
      const float* a = dlogits_add + n * E;
      for (int64_t e = 0; e < E; ++e) dl[e] += a[e];
    }
  }
}

// ========================================= permutation ==========================================

void moe_permute(int32_t* offsets, int32_t* slot_token, int32_t* slot_k, int32_t* token_slot, const int32_t* topk_idx,
                 int64_t N, int64_t E, int64_t k) {
  const int64_t S = N * k;
  LATHE_CHECK(S <= INT32_MAX, "moe permute: N*k={} slots do not fit int32; use smaller micro-batches", S);
  std::vector<int64_t> count(static_cast<size_t>(E) + 1, 0);
  for (int64_t i = 0; i < S; ++i) {
    const int32_t e = topk_idx[i];
    LATHE_CHECK(e >= 0 && e < E, "moe permute: expert index {} of token {} choice {} is outside [0, E={})", e, i / k,
                i % k, E);
    ++count[static_cast<size_t>(e) + 1];
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    count[e + 1] += count[e];
    offsets[e + 1] = static_cast<int32_t>(count[e + 1]);
  }
  // Stable: assignments visited in (token, j) order, so within an expert the slots follow token
  // order (the k choices of one token are distinct experts).
  for (int64_t i = 0; i < S; ++i) {
    const int64_t slot = count[topk_idx[i]]++;
    slot_token[slot] = static_cast<int32_t>(i / k);
    slot_k[slot] = static_cast<int32_t>(i % k);
    token_slot[i] = static_cast<int32_t>(slot);
  }
}

void moe_gather(float* xp, const float* x, const int32_t* slot_token, int64_t S, int64_t C) {
#pragma omp parallel for schedule(static) if (S * C >= kParallelMin)
  for (int64_t s = 0; s < S; ++s) std::memcpy(xp + s * C, x + int64_t{slot_token[s]} * C, sizeof(float) * C);
}

void moe_gather_backward(float* dx, const float* dxp, const int32_t* token_slot, int64_t N, int64_t k, int64_t C) {
#pragma omp parallel for schedule(static) if (N * k * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    float* __restrict d = dx + n * C;
    std::memcpy(d, dxp + int64_t{token_slot[n * k]} * C, sizeof(float) * C);
    for (int64_t j = 1; j < k; ++j) {
      const float* __restrict g = dxp + int64_t{token_slot[n * k + j]} * C;
      for (int64_t c = 0; c < C; ++c) d[c] += g[c];
    }
  }
}

// ========================================= expert MLPs ==========================================

void moe_experts_forward(float* y, float* gate, float* up, float* act, const float* xp, const float* w1,
                         const float* w3, const float* w2, const int32_t* offsets, int64_t E, int64_t C, int64_t F) {
  // One expert per iteration; dynamic so that a few heavily loaded experts do not serialise.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], M = offsets[e + 1] - r0;
    if (M == 0) continue;
    float* g = gate + r0 * F;
    float* u = up + r0 * F;
    float* a = act + r0 * F;
    matmul_forward(g, xp + r0 * C, w1 + e * F * C, nullptr, M, C, F);
    matmul_forward(u, xp + r0 * C, w3 + e * F * C, nullptr, M, C, F);
    for (int64_t i = 0; i < M * F; ++i) a[i] = silu(g[i]) * u[i];
    matmul_forward(y + r0 * C, a, w2 + e * C * F, nullptr, M, F, C);
  }
}

void moe_experts_backward(float* dxp, float* dw1, float* dw3, float* dw2, const float* dy, const float* xp,
                          const float* gate, const float* up, const float* act, const float* w1, const float* w3,
                          const float* w2, const int32_t* offsets, int64_t E, int64_t C, int64_t F, float* scratch) {
  const int64_t S = offsets[E];
  float* dgate = scratch;
  float* dup = scratch + S * F;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], M = offsets[e + 1] - r0;
    if (M == 0) continue;
    const float* g = gate + r0 * F;
    const float* u = up + r0 * F;
    float* dg = dgate + r0 * F;
    float* du = dup + r0 * F;
    // d act = dy @ w2_e (into dg), dw2_e += dy^T @ act
    matmul_backward(dg, dw2 + e * C * F, nullptr, dy + r0 * C, act + r0 * F, w2 + e * C * F, M, F, C);
    for (int64_t i = 0; i < M * F; ++i) {
      const float sg = sigmoidf(g[i]);
      const float da = dg[i];
      du[i] = da * g[i] * sg;                                // silu(g) = g * sigmoid(g)
      dg[i] = da * u[i] * sg * (1.0f + g[i] * (1.0f - sg));  // silu'(g)
    }
    matmul_backward(dxp + r0 * C, dw1 + e * F * C, nullptr, dg, xp + r0 * C, w1 + e * F * C, M, C, F);
    matmul_backward(dxp + r0 * C, dw3 + e * F * C, nullptr, du, xp + r0 * C, w3 + e * F * C, M, C, F,
                    /*accumulate_dinp=*/true);
  }
}

// =========================================== combine ============================================

void moe_combine(float* out, const float* y, const float* topk_w, const int32_t* token_slot, int64_t N, int64_t k,
                 int64_t C) {
#pragma omp parallel for schedule(static) if (N * k * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    float* __restrict o = out + n * C;
    for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const float w = topk_w[n * k + j];
      const float* __restrict yr = y + int64_t{token_slot[n * k + j]} * C;
      for (int64_t c = 0; c < C; ++c) o[c] += w * yr[c];
    }
  }
}

void moe_combine_backward(float* dy, float* dtopk_w, const float* dout, const float* y, const float* topk_w,
                          const int32_t* token_slot, int64_t N, int64_t k, int64_t C) {
#pragma omp parallel for schedule(static) if (N * k * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* __restrict d = dout + n * C;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = token_slot[n * k + j];
      const float w = topk_w[n * k + j];
      const float* __restrict yr = y + slot * C;
      float* __restrict dyr = dy + slot * C;
      float dot = 0.0f;
      for (int64_t c = 0; c < C; ++c) {
        dyr[c] = w * d[c];
        dot += d[c] * yr[c];
      }
      dtopk_w[n * k + j] = dot;
    }
  }
}

// ========================================== the block ===========================================

void moe_forward(float* out, const MoeActs& a, const float* x, const float* wr, const float* w1, const float* w3,
                 const float* w2, const MoeShape& s, const float* select_bias) {
  check_shape(s);
  matmul_forward(a.logits, x, wr, nullptr, s.N, s.C, s.E);
  moe_router_forward(a.probs, a.topk_idx, a.topk_w, a.logits, s.N, s.E, s.k, s.score, s.renormalize, select_bias);
  moe_permute(a.offsets, a.slot_token, a.slot_k, a.token_slot, a.topk_idx, s.N, s.E, s.k);
  moe_gather(a.xp, x, a.slot_token, s.N * s.k, s.C);
  moe_experts_forward(a.y, a.gate, a.up, a.act, a.xp, w1, w3, w2, a.offsets, s.E, s.C, s.F);
  moe_combine(out, a.y, a.topk_w, a.token_slot, s.N, s.k, s.C);
}

size_t moe_backward_scratch_floats(const MoeShape& s) {
  const size_t S = static_cast<size_t>(s.N * s.k);
  // dy, dxp [S, C]; dgate, dup [S, F]; dtopk_w [N, k]; dlogits [N, E]
  return 2 * S * s.C + 2 * S * s.F + S + static_cast<size_t>(s.N * s.E);
}

void moe_backward(float* dx, float* dwr, float* dw1, float* dw3, float* dw2, const float* dout,
                  const float* dlogits_add, const MoeActs& a, const float* x, const float* wr, const float* w1,
                  const float* w3, const float* w2, const MoeShape& s, float* scratch) {
  check_shape(s);
  const int64_t S = s.N * s.k;
  float* dy = scratch;
  float* dxp = dy + S * s.C;
  float* dgu = dxp + S * s.C;
  float* dtopk_w = dgu + 2 * S * s.F;
  float* dlogits = dtopk_w + S;
  moe_combine_backward(dy, dtopk_w, dout, a.y, a.topk_w, a.token_slot, s.N, s.k, s.C);
  moe_experts_backward(dxp, dw1, dw3, dw2, dy, a.xp, a.gate, a.up, a.act, w1, w3, w2, a.offsets, s.E, s.C, s.F, dgu);
  moe_gather_backward(dx, dxp, a.token_slot, s.N, s.k, s.C);
  moe_router_backward(dlogits, dtopk_w, dlogits_add, a.probs, a.topk_idx, s.N, s.E, s.k, s.score, s.renormalize);
  // Router GEMM: dx += dlogits @ wr, dwr += dlogits^T @ x.
  matmul_backward(dx, dwr, nullptr, dlogits, x, wr, s.N, s.C, s.E, /*accumulate_dinp=*/true);
}

// ====================================== balancing losses ========================================

void moe_load_stats(double* psum, int64_t* counts, const float* probs, const int32_t* topk_idx, int64_t N, int64_t E,
                    int64_t k) {
  // Column sums in row order (one expert per thread's share): independent of the thread count.
#pragma omp parallel for schedule(static) if (N * E >= kParallelMin)
  for (int64_t e = 0; e < E; ++e) {
    double sum = 0.0;
    for (int64_t n = 0; n < N; ++n) sum += probs[n * E + e];
    psum[e] += sum;
  }
  for (int64_t i = 0; i < N * k; ++i) {
    const int32_t e = topk_idx[i];
    LATHE_CHECK(e >= 0 && e < E, "moe load stats: expert index {} at assignment {} is outside [0, E={})", e, i, E);
    ++counts[e];
  }
}

double moe_aux_loss(const double* psum, const int64_t* counts, int64_t rows, int64_t E) {
  LATHE_CHECK(rows > 0, "moe aux loss: rows={} must be positive", rows);
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) sum += (static_cast<double>(counts[e]) / rows) * (psum[e] / rows);
  return static_cast<double>(E) * sum;
}

void moe_aux_loss_backward(float* dlogits, const float* probs, const int64_t* counts, int64_t rows, int64_t N,
                           int64_t E, float coef, MoeScore score) {
  LATHE_CHECK(rows > 0, "moe aux loss: rows={} must be positive", rows);
  // d aux / d probs[n, e] = E * f_e / rows, the same for every row.
  std::vector<float> dp(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    dp[e] = static_cast<float>(coef * static_cast<double>(E) * (static_cast<double>(counts[e]) / rows) / rows);
#pragma omp parallel for schedule(static) if (N * E >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* p = probs + n * E;
    float* dl = dlogits + n * E;
    if (score == MoeScore::sigmoid) {
      for (int64_t e = 0; e < E; ++e) dl[e] += dp[e] * p[e] * (1.0f - p[e]);
    } else {
      float dot = 0.0f;
      for (int64_t e = 0; e < E; ++e) dot += dp[e] * p[e];
      for (int64_t e = 0; e < E; ++e) dl[e] += p[e] * (dp[e] - dot);
    }
  }
}

double moe_z_loss(float* dlogits, const float* logits, int64_t N, int64_t E, float grad_scale) {
  std::vector<double> sq(static_cast<size_t>(N));
#pragma omp parallel for schedule(static) if (N * E >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits + n * E;
    float m = l[0];
    for (int64_t e = 1; e < E; ++e) m = l[e] > m ? l[e] : m;
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - m);
    const float lse = m + std::log(sum);
    sq[n] = static_cast<double>(lse) * lse;
    if (dlogits != nullptr) {
      const float g = grad_scale * 2.0f * lse / sum;
      float* dl = dlogits + n * E;
      for (int64_t e = 0; e < E; ++e) dl[e] += g * std::exp(l[e] - m);
    }
  }
  double total = 0.0;
  for (int64_t n = 0; n < N; ++n) total += sq[n];  // row order: independent of the thread count
  return total;
}

void moe_update_select_bias(float* bias, const int64_t* counts, int64_t E, float rate) {
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += counts[e];
  // Compare counts[e] * E with the total: the exact integer form of counts[e] vs the mean.
  for (int64_t e = 0; e < E; ++e) {
    const int64_t load = counts[e] * E;
    bias[e] += load < total ? rate : load > total ? -rate : 0.0f;
  }
}

}  // namespace lathe::cpu
