// Plain-loop double references of every kernel op, shared by the per-op tests (test_ops_*.cpp) and
// the backend op test (test_backend_ops.cpp). Each is checked against central finite differences
// of its own forward in test_ops_*.cpp, so the references are verified, not trusted.
// Shapes as in kernels/cpu/ops.h; gradients are returned alone (callers add any += prefill).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <vector>

namespace lathe::test {

// Deterministic N(0, sd) values (std::mt19937 seeded with `seed`), shared by the attention tests.
inline std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// doc_start [B, T] from document lengths drawn in [1, max_len] (a length-1 document every so often),
// the last one cut by the sample's end.
inline std::vector<int32_t> random_docs(int64_t B, int64_t T, int64_t max_len, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> ds(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T;) {
      const int64_t len = gen() % 4 == 0 ? 1 : 1 + static_cast<int64_t>(gen() % max_len);
      for (int64_t i = t; i < std::min(T, t + len); ++i) ds[static_cast<size_t>(b * T + i)] = static_cast<int32_t>(t);
      t += len;
    }
  return ds;
}

using VecD = std::vector<double>;

// ---- matmul, embedding, layernorm, rmsnorm, gelu, swiglu, rope --------------------------------

inline void ref_matmul_fwd(VecD& out, const VecD& x, const VecD& w, const VecD* b, int64_t M, int64_t K, int64_t N) {
  out.assign(M * N, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = b ? (*b)[j] : 0.0;
      for (int64_t k = 0; k < K; ++k) s += x[i * K + k] * w[j * K + k];
      out[i * N + j] = s;
    }
}
inline void ref_matmul_bwd(VecD& dx, VecD& dw, VecD& db, const VecD& g, const VecD& x, const VecD& w, int64_t M,
                           int64_t K, int64_t N) {
  dx.assign(M * K, 0.0);
  dw.assign(N * K, 0.0);
  db.assign(N, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const double gij = g[i * N + j];
      db[j] += gij;
      for (int64_t k = 0; k < K; ++k) {
        dx[i * K + k] += gij * w[j * K + k];
        dw[j * K + k] += gij * x[i * K + k];
      }
    }
}

// pos [B, T] (nullptr: t): the wpe row of each token.
inline void ref_embedding_fwd(VecD& out, const std::vector<int32_t>& tok, const VecD& wte, const VecD* wpe, int64_t B,
                              int64_t T, int64_t C, const std::vector<int32_t>* pos = nullptr) {
  out.assign(B * T * C, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pos ? (*pos)[b * T + t] : t;
      for (int64_t c = 0; c < C; ++c)
        out[(b * T + t) * C + c] = wte[tok[b * T + t] * C + c] + (wpe ? (*wpe)[p * C + c] : 0.0);
    }
}
inline void ref_embedding_bwd(VecD& dwte, VecD& dwpe, const VecD& g, const std::vector<int32_t>& tok, int64_t V,
                              int64_t B, int64_t T, int64_t C, const std::vector<int32_t>* pos = nullptr) {
  dwte.assign(V * C, 0.0);
  dwpe.assign(T * C, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pos ? (*pos)[b * T + t] : t;
      for (int64_t c = 0; c < C; ++c) {
        dwte[tok[b * T + t] * C + c] += g[(b * T + t) * C + c];
        dwpe[p * C + c] += g[(b * T + t) * C + c];
      }
    }
}

inline void ref_layernorm_fwd(VecD& out, VecD& mean, VecD& rstd, const VecD& x, const VecD& w, const VecD* b, int64_t N,
                              int64_t C, double eps) {
  out.assign(N * C, 0.0);
  mean.assign(N, 0.0);
  rstd.assign(N, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double m = 0.0, v = 0.0;
    for (int64_t c = 0; c < C; ++c) m += x[n * C + c];
    m /= C;
    for (int64_t c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= C;
    const double r = 1.0 / std::sqrt(v + eps);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = (x[n * C + c] - m) * r * w[c] + (b ? (*b)[c] : 0.0);
    mean[n] = m;
    rstd[n] = r;
  }
}
inline void ref_layernorm_bwd(VecD& dx, VecD& dw, VecD& db, const VecD& g, const VecD& x, const VecD& w, int64_t N,
                              int64_t C, double eps) {
  VecD out, mean, rstd;
  ref_layernorm_fwd(out, mean, rstd, x, w, nullptr, N, C, eps);
  dx.assign(N * C, 0.0);
  dw.assign(C, 0.0);
  db.assign(C, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double a = 0.0, bb = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      const double xh = (x[n * C + c] - mean[n]) * rstd[n];
      const double dxh = g[n * C + c] * w[c];
      a += dxh;
      bb += dxh * xh;
      dw[c] += g[n * C + c] * xh;
      db[c] += g[n * C + c];
    }
    a /= C;
    bb /= C;
    for (int64_t c = 0; c < C; ++c) {
      const double xh = (x[n * C + c] - mean[n]) * rstd[n];
      dx[n * C + c] = (g[n * C + c] * w[c] - a - xh * bb) * rstd[n];
    }
  }
}

inline void ref_rmsnorm_fwd(VecD& out, VecD& rstd, const VecD& x, const VecD& w, int64_t N, int64_t C, double eps) {
  out.assign(N * C, 0.0);
  rstd.assign(N, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += x[n * C + c] * x[n * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = w[c] * x[n * C + c] * r;
    rstd[n] = r;
  }
}
inline void ref_rmsnorm_bwd(VecD& dx, VecD& dw, const VecD& g, const VecD& x, const VecD& w, int64_t N, int64_t C,
                            double eps) {
  VecD out, rstd;
  ref_rmsnorm_fwd(out, rstd, x, w, N, C, eps);
  dx.assign(N * C, 0.0);
  dw.assign(C, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double s = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      const double xh = x[n * C + c] * rstd[n];
      s += g[n * C + c] * w[c] * xh;
      dw[c] += g[n * C + c] * xh;
    }
    s /= C;
    for (int64_t c = 0; c < C; ++c) dx[n * C + c] = (g[n * C + c] * w[c] - x[n * C + c] * rstd[n] * s) * rstd[n];
  }
}

// GELU tanh approximation, written as torch does: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline double ref_gelu(double x) {
  const double s = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(s * (x + 0.044715 * x * x * x)));
}
inline double ref_gelu_grad(double x) {
  const double s = std::sqrt(2.0 / M_PI);
  const double u = s * (x + 0.044715 * x * x * x);
  const double t = std::tanh(u);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * s * (1.0 + 3.0 * 0.044715 * x * x);
}

// Exact GELU x * Phi(x) (erf) and its derivative Phi(x) + x * phi(x).
inline double ref_gelu_erf(double x) { return 0.5 * x * std::erfc(-x / std::sqrt(2.0)); }
inline double ref_gelu_erf_grad(double x) {
  return 0.5 * std::erfc(-x / std::sqrt(2.0)) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
}

inline double ref_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline void ref_swiglu_fwd(VecD& out, const VecD& inp, int64_t N, int64_t F) {
  out.assign(N * F, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      const double g = inp[n * 2 * F + f], u = inp[n * 2 * F + F + f];
      out[n * F + f] = g * ref_sigmoid(g) * u;
    }
}
inline void ref_swiglu_bwd(VecD& dinp, const VecD& inp, const VecD& dout, int64_t N, int64_t F) {
  dinp.assign(N * 2 * F, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      const double g = inp[n * 2 * F + f], u = inp[n * 2 * F + F + f], d = dout[n * F + f];
      const double sg = ref_sigmoid(g);
      dinp[n * 2 * F + f] = d * u * (sg + g * sg * (1.0 - sg));
      dinp[n * 2 * F + F + f] = d * g * sg;
    }
}

// GeGLU (Gemma 2): gelu_tanh(gate) * up on the same gate|up layout, and its gradient.
inline void ref_geglu_fwd(VecD& out, const VecD& inp, int64_t N, int64_t F) {
  out.assign(N * F, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) out[n * F + f] = ref_gelu(inp[n * 2 * F + f]) * inp[n * 2 * F + F + f];
}
inline void ref_geglu_bwd(VecD& dinp, const VecD& inp, const VecD& dout, int64_t N, int64_t F) {
  dinp.assign(N * 2 * F, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      const double g = inp[n * 2 * F + f], u = inp[n * 2 * F + F + f], d = dout[n * F + f];
      dinp[n * 2 * F + f] = d * u * ref_gelu_grad(g);
      dinp[n * 2 * F + F + f] = d * ref_gelu(g);
    }
}

// RoPE reference on x[B, T, stride], heads at column h*D; tables given as [T, rot/2] doubles
// (rot: the rotated dims of a head, 0 = D; the rest pass through).
// pos [B, T] (nullptr: t): the table row of each token.
inline void ref_rope_fwd(VecD& y, const VecD& x, const VecD& cs, const VecD& sn, int64_t B, int64_t T, int64_t H,
                         int64_t D, int64_t stride, int64_t offset, const std::vector<int32_t>* pos = nullptr,
                         int64_t rot = 0) {
  y = x;
  const int64_t half = (rot > 0 ? rot : D) / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const int64_t base = (b * T + t) * stride + offset + h * D;
          const double x1 = x[base + i], x2 = x[base + half + i];
          const int64_t p = pos ? (*pos)[b * T + t] : t;
          const double c = cs[p * half + i], s = sn[p * half + i];
          y[base + i] = x1 * c - x2 * s;
          y[base + half + i] = x2 * c + x1 * s;
        }
}
inline void ref_rope_bwd(VecD& dx, const VecD& dy, const VecD& cs, const VecD& sn, int64_t B, int64_t T, int64_t H,
                         int64_t D, int64_t stride, int64_t offset, const std::vector<int32_t>* pos = nullptr,
                         int64_t rot = 0) {
  dx = dy;
  const int64_t half = (rot > 0 ? rot : D) / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const int64_t base = (b * T + t) * stride + offset + h * D;
          const double g1 = dy[base + i], g2 = dy[base + half + i];
          const int64_t p = pos ? (*pos)[b * T + t] : t;
          const double c = cs[p * half + i], s = sn[p * half + i];
          dx[base + i] = g1 * c + g2 * s;
          dx[base + half + i] = g2 * c - g1 * s;
        }
}

// ---- attention ------------------------------------------------------------------------------

struct AttnShape {
  int64_t B, T, H, KVH, D;
  double scale = 0.0;    // score scale (0: 1/sqrt(D))
  double softcap = 0.0;  // scores s -> softcap * tanh(s / softcap) before the softmax (0: none)
  double score_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(D)); }
  double cap(double x) const { return softcap > 0 ? softcap * std::tanh(x / softcap) : x; }
  // d cap(x) / dx from the capped value c
  double cap_grad(double c) const { return softcap > 0 ? 1.0 - (c / softcap) * (c / softcap) : 1.0; }
};
inline void PrintTo(const AttnShape& s, std::ostream* os) {
  *os << "B=" << s.B << " T=" << s.T << " H=" << s.H << " KVH=" << s.KVH << " D=" << s.D;
  if (s.scale > 0) *os << " scale=" << s.scale;
  if (s.softcap > 0) *os << " softcap=" << s.softcap;
}

// The first key of every query [B*T] under documents (doc_start [B, T], empty = none) and a
// sliding window (0 = none): max(doc_start, t - window + 1), written naively as transformers
// 4.45.2's Mistral mask states it (key j is excluded when j <= t - window).
inline std::vector<int64_t> ref_first_keys(const std::vector<int32_t>& doc_start, int64_t window, const AttnShape& s) {
  std::vector<int64_t> first(s.B * s.T, 0);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 0; t < s.T; ++t) {
      int64_t j = doc_start.empty() ? 0 : doc_start[b * s.T + t];
      while (window > 0 && j <= t - window) ++j;
      first[b * s.T + t] = j;
    }
  return first;
}

// Naive causal GQA attention in double. out[B,T,H*D]. first [B*T] (nullptr: 0): query (b, t)
// attends keys [first[b*T+t], t] only (ref_first_keys).
inline void ref_attention_fwd(std::vector<double>& out, std::vector<double>& lse, const std::vector<double>& qkv,
                              const AttnShape& s, const int64_t* first = nullptr) {
  const int64_t ld = (s.H + 2 * s.KVH) * s.D, rep = s.H / s.KVH;
  const double scale = s.score_scale();
  out.assign(s.B * s.T * s.H * s.D, 0.0);
  lse.assign(s.B * s.H * s.T, 0.0);
  std::vector<double> p(s.T);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t g = h / rep;
      for (int64_t i = 0; i < s.T; ++i) {
        const int64_t j0 = first ? first[b * s.T + i] : 0;
        double m = -INFINITY;
        for (int64_t j = j0; j <= i; ++j) {
          double acc = 0;
          for (int64_t d = 0; d < s.D; ++d)
            acc += qkv[(b * s.T + i) * ld + h * s.D + d] * qkv[(b * s.T + j) * ld + (s.H + g) * s.D + d];
          p[j] = s.cap(acc * scale);
          m = std::max(m, p[j]);
        }
        double sum = 0;
        for (int64_t j = j0; j <= i; ++j) sum += std::exp(p[j] - m);
        lse[(b * s.H + h) * s.T + i] = m + std::log(sum);
        for (int64_t j = j0; j <= i; ++j) {
          const double pj = std::exp(p[j] - m) / sum;
          for (int64_t d = 0; d < s.D; ++d)
            out[(b * s.T + i) * s.H * s.D + h * s.D + d] += pj * qkv[(b * s.T + j) * ld + (s.H + s.KVH + g) * s.D + d];
        }
      }
    }
}

// Analytic gradient of L = sum(out * dout) w.r.t. qkv, double, with the full softmax matrix.
inline std::vector<double> ref_attention_bwd(const std::vector<double>& qkv, const std::vector<double>& dout,
                                             const AttnShape& s, const int64_t* first = nullptr) {
  const int64_t ld = (s.H + 2 * s.KVH) * s.D, rep = s.H / s.KVH, T = s.T, D = s.D;
  const double scale = s.score_scale();
  std::vector<double> dqkv(qkv.size(), 0.0), P(T * T), dP(T * T), CG(T * T);
  auto Q = [&](int64_t b, int64_t t, int64_t h, int64_t d) { return qkv[(b * T + t) * ld + h * D + d]; };
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t g = h / rep, kc = (s.H + g) * D, vc = (s.H + s.KVH + g) * D;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t j0 = first ? first[b * T + i] : 0;
        double m = -INFINITY;
        for (int64_t j = j0; j <= i; ++j) {
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += Q(b, i, h, d) * qkv[(b * T + j) * ld + kc + d];
          P[i * T + j] = s.cap(acc * scale);
          CG[i * T + j] = s.cap_grad(P[i * T + j]);
          m = std::max(m, P[i * T + j]);
        }
        double sum = 0;
        for (int64_t j = j0; j <= i; ++j) sum += std::exp(P[i * T + j] - m);
        for (int64_t j = j0; j <= i; ++j) P[i * T + j] = std::exp(P[i * T + j] - m) / sum;
      }
      for (int64_t i = 0; i < T; ++i) {
        const int64_t j0 = first ? first[b * T + i] : 0;
        const double* dO = &dout[(b * T + i) * s.H * D + h * D];
        double rowdot = 0;
        for (int64_t j = j0; j <= i; ++j) {
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += dO[d] * qkv[(b * T + j) * ld + vc + d];
          dP[i * T + j] = acc;
          rowdot += acc * P[i * T + j];
        }
        for (int64_t j = j0; j <= i; ++j) {
          const double ds = P[i * T + j] * (dP[i * T + j] - rowdot) * CG[i * T + j] * scale;
          for (int64_t d = 0; d < D; ++d) {
            dqkv[(b * T + i) * ld + h * D + d] += ds * qkv[(b * T + j) * ld + kc + d];
            dqkv[(b * T + j) * ld + kc + d] += ds * Q(b, i, h, d);
            dqkv[(b * T + j) * ld + vc + d] += P[i * T + j] * dO[d];
          }
        }
      }
    }
  return dqkv;
}

// ---- documents: every segment of a sample run separately ----------------------------------------
// doc_start[B, T] as cpu::attention_forward takes it. The segments of row b are the maximal runs of
// equal doc_start; each is run through `f(b, t0, len)` (the caller slices and scatters).
template <class F>
void for_each_segment(const std::vector<int32_t>& doc_start, int64_t B, int64_t T, F&& f) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t0 = 0; t0 < T;) {
      int64_t t1 = t0 + 1;
      while (t1 < T && doc_start[b * T + t1] == doc_start[b * T + t0]) ++t1;
      f(b, t0, t1 - t0);
      t0 = t1;
    }
}

// Document attention as a torch user would check it: each document a batch of its own through the
// causal references above (themselves checked against finite differences). out, lse and the
// gradient w.r.t. qkv (of L = sum(out * dout)) of the whole [B, T] batch.
inline void ref_attention_docs(std::vector<double>& out, std::vector<double>& lse, std::vector<double>& dqkv,
                               const std::vector<double>& qkv, const std::vector<double>& dout,
                               const std::vector<int32_t>& doc_start, const AttnShape& s) {
  const int64_t ld = (s.H + 2 * s.KVH) * s.D, lo = s.H * s.D;
  out.assign(s.B * s.T * lo, 0.0);
  lse.assign(s.B * s.H * s.T, 0.0);
  dqkv.assign(qkv.size(), 0.0);
  for_each_segment(doc_start, s.B, s.T, [&](int64_t b, int64_t t0, int64_t n) {
    const AttnShape one{1, n, s.H, s.KVH, s.D};
    const std::vector<double> q(qkv.begin() + (b * s.T + t0) * ld, qkv.begin() + (b * s.T + t0 + n) * ld);
    const std::vector<double> g(dout.begin() + (b * s.T + t0) * lo, dout.begin() + (b * s.T + t0 + n) * lo);
    std::vector<double> o, l;
    ref_attention_fwd(o, l, q, one);
    const std::vector<double> dq = ref_attention_bwd(q, g, one);
    std::copy(o.begin(), o.end(), out.begin() + (b * s.T + t0) * lo);
    std::copy(dq.begin(), dq.end(), dqkv.begin() + (b * s.T + t0) * ld);
    for (int64_t h = 0; h < s.H; ++h)
      std::copy(l.begin() + h * n, l.begin() + (h + 1) * n, lse.begin() + (b * s.H + h) * s.T + t0);
  });
}

// ---- lm head + cross-entropy ------------------------------------------------------------------

struct LossRef {
  std::vector<double> losses, dx, dw;  // dw is the gradient alone (no prefill)
  double total = 0;
};

// Naive reference: logits, log-softmax and gradients in double.
inline LossRef ref_lm_head_loss(const std::vector<double>& x, const std::vector<double>& w,
                                const std::vector<int32_t>& tg, int64_t N, int64_t C, int64_t V, double grad_scale,
                                double softcap = 0.0) {
  LossRef r;
  r.losses.assign(N, 0.0);
  r.dx.assign(N * C, 0.0);
  r.dw.assign(V * C, 0.0);
  std::vector<double> logits(V);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t c = 0; c < C; ++c) acc += x[n * C + c] * w[v * C + c];
      logits[v] = softcap > 0 ? softcap * std::tanh(acc / softcap) : acc;
    }
    if (tg[n] < 0) continue;
    const double m = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double l : logits) sum += std::exp(l - m);
    const double lse = m + std::log(sum);
    r.losses[n] = lse - logits[tg[n]];
    r.total += r.losses[n];
    for (int64_t v = 0; v < V; ++v) {
      const double th = softcap > 0 ? logits[v] / softcap : 0.0;
      const double g = (std::exp(logits[v] - lse) - (v == tg[n] ? 1.0 : 0.0)) * grad_scale * (1.0 - th * th);
      for (int64_t c = 0; c < C; ++c) {
        r.dx[n * C + c] += g * w[v * C + c];
        r.dw[v * C + c] += g * x[n * C + c];
      }
    }
  }
  return r;
}

}  // namespace lathe::test
