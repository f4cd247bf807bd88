#include "models/traced_ops.h"

#include <mutex>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "core/trace.h"

namespace lathe {
namespace {

constexpr int kMaxTables = 8;
const Ops* g_inner[kMaxTables] = {};
Ops g_traced[kMaxTables];
int g_count = 0;
std::mutex g_mu;

// W<I, &Ops::slot, "name">::call has the slot's signature: a span around table I's original.
template <int I, auto M, const char* const* Name,
          typename P = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<const Ops&>().*M)>>>
struct W;
template <int I, auto M, const char* const* Name, typename R, typename... A>
struct W<I, M, Name, R (*)(A...)> {
  static R call(A... a) {
    trace::Scope span(*Name, trace::Cat::Kernel);
    return (g_inner[I]->*M)(a...);
  }
};

#define LATHE_TRACED_NAME(name) constexpr const char* k_##name = #name;
LATHE_TRACED_NAME(matmul_forward)
LATHE_TRACED_NAME(matmul_backward)
LATHE_TRACED_NAME(matmul_bias_gelu_forward)
LATHE_TRACED_NAME(embedding_forward)
LATHE_TRACED_NAME(embedding_backward)
LATHE_TRACED_NAME(layernorm_forward)
LATHE_TRACED_NAME(layernorm_backward)
LATHE_TRACED_NAME(rmsnorm_forward)
LATHE_TRACED_NAME(rmsnorm_backward)
LATHE_TRACED_NAME(gelu_forward)
LATHE_TRACED_NAME(gelu_backward)
LATHE_TRACED_NAME(gelu_erf_forward)
LATHE_TRACED_NAME(gelu_erf_backward)
LATHE_TRACED_NAME(swiglu_forward)
LATHE_TRACED_NAME(swiglu_backward)
LATHE_TRACED_NAME(geglu_forward)
LATHE_TRACED_NAME(geglu_backward)
LATHE_TRACED_NAME(residual_forward)
LATHE_TRACED_NAME(bias_add)
LATHE_TRACED_NAME(rope_tables)
LATHE_TRACED_NAME(rope_forward)
LATHE_TRACED_NAME(rope_backward)
LATHE_TRACED_NAME(attention_forward)
LATHE_TRACED_NAME(attention_backward)
LATHE_TRACED_NAME(lm_head_loss)
LATHE_TRACED_NAME(logits_forward)
#undef LATHE_TRACED_NAME

template <int I>
void fill(Ops& t, const Ops& in) {
  t = in;  // backend, dtype and the *_scratch_bytes slots as they are
#define LATHE_WRAP(name) t.name = in.name ? &W<I, &Ops::name, &k_##name>::call : nullptr;
  LATHE_WRAP(matmul_forward)
  LATHE_WRAP(matmul_backward)
  LATHE_WRAP(matmul_bias_gelu_forward)
  LATHE_WRAP(embedding_forward)
  LATHE_WRAP(embedding_backward)
  LATHE_WRAP(layernorm_forward)
  LATHE_WRAP(layernorm_backward)
  LATHE_WRAP(rmsnorm_forward)
  LATHE_WRAP(rmsnorm_backward)
  LATHE_WRAP(gelu_forward)
  LATHE_WRAP(gelu_backward)
  LATHE_WRAP(gelu_erf_forward)
  LATHE_WRAP(gelu_erf_backward)
  LATHE_WRAP(swiglu_forward)
  LATHE_WRAP(swiglu_backward)
  LATHE_WRAP(geglu_forward)
  LATHE_WRAP(geglu_backward)
  LATHE_WRAP(residual_forward)
  LATHE_WRAP(bias_add)
  LATHE_WRAP(rope_tables)
  LATHE_WRAP(rope_forward)
  LATHE_WRAP(rope_backward)
  LATHE_WRAP(attention_forward)
  LATHE_WRAP(attention_backward)
  LATHE_WRAP(lm_head_loss)
  LATHE_WRAP(logits_forward)
#undef LATHE_WRAP
}

template <int... Is>
void fill_at(int i, Ops& t, const Ops& in, std::integer_sequence<int, Is...>) {
  ((i == Is ? fill<Is>(t, in) : void()), ...);
}

}  // namespace

const Ops& traced_ops(const Ops& inner) {
  std::lock_guard<std::mutex> lk(g_mu);
  for (int i = 0; i < g_count; ++i)
    if (g_inner[i] == &inner) return g_traced[i];
  LATHE_CHECK(g_count < kMaxTables, "traced_ops: more than {} op tables", kMaxTables);
  const int i = g_count++;
  g_inner[i] = &inner;
  fill_at(i, g_traced[i], inner, std::make_integer_sequence<int, kMaxTables>{});
  return g_traced[i];
}

const Ops& untraced_ops(const Ops& t) {
  // g_inner[i] is written before the traced table is handed out (under the mutex), and a caller
  // holds a traced table only after traced_ops returned it.
  for (int i = 0; i < kMaxTables; ++i)
    if (&t == &g_traced[i]) return *g_inner[i];
  return t;
}

}  // namespace lathe
