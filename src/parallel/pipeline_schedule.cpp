#include "parallel/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace lathe::pipeline {

std::string to_string(const Action& a) {
  switch (a.op) {
    case Op::Forward:
      return fmt::format("F{}.{}", a.mb, a.chunk);
    case Op::Backward:
      return fmt::format("B{}.{}", a.mb, a.chunk);
    case Op::SendAct:
      return fmt::format("SendAct{}.{}>{}", a.mb, a.chunk, a.peer);
    case Op::RecvAct:
      return fmt::format("RecvAct{}.{}<{}", a.mb, a.chunk, a.peer);
    case Op::SendGrad:
      return fmt::format("SendGrad{}.{}>{}", a.mb, a.chunk, a.peer);
    case Op::RecvGrad:
      return fmt::format("RecvGrad{}.{}<{}", a.mb, a.chunk, a.peer);
  }
  return "?";
}

Kind parse_kind(std::string_view name, std::string_view what) {
  if (name == "gpipe") return Kind::GPipe;
  if (name == "1f1b") return Kind::OneFOneB;
  if (name == "interleaved") return Kind::Interleaved;
  throw_error("{}: unknown pipeline schedule '{}': use gpipe, 1f1b or interleaved", what, name);
}

std::string kind_name(Kind k) {
  switch (k) {
    case Kind::GPipe:
      return "gpipe";
    case Kind::OneFOneB:
      return "1f1b";
    case Kind::Interleaved:
      return "interleaved";
  }
  return "?";
}

void validate(const Spec& s, std::string_view source) {
  LATHE_CHECK(s.stages >= 1 && s.stages <= (1 << 20), "{}: parallel.pipeline {} must be in [1, {}]", source, s.stages,
              1 << 20);
  LATHE_CHECK(s.micro_batches >= 1 && s.micro_batches <= (1 << 24), "{}: {} micro-batches must be in [1, {}]", source,
              s.micro_batches, 1 << 24);
  LATHE_CHECK(s.virtual_stages >= 1 && s.virtual_stages <= 1024, "{}: parallel.virtual_stages {} must be in [1, 1024]",
              source, s.virtual_stages);
  LATHE_CHECK(s.micro_batches >= s.stages,
              "{}: {} micro-batches (training.grad_accum_steps) is fewer than the {} pipeline stages "
              "(parallel.pipeline): a stage would idle for the whole step; raise training.grad_accum_steps to at least "
              "{}",
              source, s.micro_batches, s.stages, s.stages);
  if (s.kind == Kind::Interleaved) {
    LATHE_CHECK(s.virtual_stages >= 2,
                "{}: the interleaved schedule needs parallel.virtual_stages >= 2 (got {}); with 1 it is 1f1b", source,
                s.virtual_stages);
    LATHE_CHECK(s.stages >= 2, "{}: the interleaved schedule needs parallel.pipeline >= 2 (got {})", source, s.stages);
    LATHE_CHECK(s.micro_batches % s.stages == 0,
                "{}: the interleaved schedule runs micro-batches in groups of parallel.pipeline {}, but there are {} "
                "(training.grad_accum_steps): make it a multiple of {} (as Megatron requires), e.g. {}",
                source, s.stages, s.micro_batches, s.stages, (s.micro_batches / s.stages + 1) * s.stages);
  } else {
    LATHE_CHECK(
        s.virtual_stages == 1,
        "{}: parallel.virtual_stages {} needs the interleaved schedule (the {} schedule has one chunk per rank)",
        source, s.virtual_stages, kind_name(s.kind));
  }
}

namespace {

struct Step {
  bool fwd;
  int32_t mb, chunk;
};

// The compute order of rank r (forwards and backwards of (mb, chunk)), per kind.
std::vector<Step> compute_order(const Spec& s, int64_t r) {
  const int64_t p = s.stages, m = s.micro_batches, v = s.virtual_stages;
  std::vector<Step> out;
  auto F = [&](int64_t mb, int64_t c) { out.push_back({true, static_cast<int32_t>(mb), static_cast<int32_t>(c)}); };
  auto B = [&](int64_t mb, int64_t c) { out.push_back({false, static_cast<int32_t>(mb), static_cast<int32_t>(c)}); };
  if (s.kind == Kind::GPipe) {
    for (int64_t i = 0; i < m; ++i) F(i, 0);
    for (int64_t i = 0; i < m; ++i) B(i, 0);
  } else if (s.kind == Kind::OneFOneB) {
    const int64_t warm = std::min(p - r - 1, m);
    for (int64_t i = 0; i < warm; ++i) F(i, 0);
    for (int64_t i = 0; i < m - warm; ++i) {
      F(warm + i, 0);
      B(i, 0);
    }
    for (int64_t i = m - warm; i < m; ++i) B(i, 0);
  } else {
    // Megatron-LM forward_backward_pipelining_with_interleaving: the k-th chunk-forward of a rank
    // is micro-batch (k / (p v)) p + k % p on chunk (k % (p v)) / p; backwards walk the chunks in
    // reverse.
    const int64_t total = m * v;
    const int64_t warm = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    auto mb_of = [&](int64_t k) { return (k / (p * v)) * p + k % p; };
    auto chunk_of = [&](int64_t k, bool fwd) {
      const int64_t c = (k % (p * v)) / p;
      return fwd ? c : v - 1 - c;
    };
    for (int64_t k = 0; k < warm; ++k) F(mb_of(k), chunk_of(k, true));
    for (int64_t i = 0; i < total - warm; ++i) {
      F(mb_of(i + warm), chunk_of(i + warm, true));
      B(mb_of(i), chunk_of(i, false));
    }
    for (int64_t i = total - warm; i < total; ++i) B(mb_of(i), chunk_of(i, false));
  }
  return out;
}

}  // namespace

std::vector<std::vector<Action>> make_schedule(const Spec& s) {
  validate(s);
  const int64_t p = s.stages, S = p * s.virtual_stages;
  std::vector<std::vector<Action>> ranks(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) {
    auto& out = ranks[static_cast<size_t>(r)];
    const auto next = static_cast<int32_t>((r + 1) % p), prev = static_cast<int32_t>((r + p - 1) % p);
    for (const Step& st : compute_order(s, r)) {
      const int64_t k = st.chunk * p + r;  // virtual stage
      if (st.fwd) {
        // The input arrives just before it is needed; the output leaves as soon as it exists.
        if (k > 0) out.push_back({Op::RecvAct, st.mb, st.chunk, prev});
        out.push_back({Op::Forward, st.mb, st.chunk});
        if (k < S - 1) out.push_back({Op::SendAct, st.mb, st.chunk, next});
      } else {
        if (k < S - 1) out.push_back({Op::RecvGrad, st.mb, st.chunk, next});
        out.push_back({Op::Backward, st.mb, st.chunk});
        if (k > 0) out.push_back({Op::SendGrad, st.mb, st.chunk, prev});
      }
    }
  }
  return ranks;
}

std::vector<int64_t> assign_layers(int64_t layers, int64_t stages, int64_t virtual_stages,
                                   const std::vector<int64_t>& stage_layers, std::string_view source) {
  LATHE_CHECK(stages >= 1 && virtual_stages >= 1,
              "{}: parallel.pipeline {} and parallel.virtual_stages {} must be >= 1", source, stages, virtual_stages);
  const int64_t S = stages * virtual_stages;
  if (stage_layers.empty()) {
    LATHE_CHECK(layers >= S,
                "{}: {} layers cannot be split over parallel.pipeline {} x parallel.virtual_stages {} = {} stages: "
                "each needs at least one layer; lower the pipeline or virtual_stages degree",
                source, layers, stages, virtual_stages, S);
    std::vector<int64_t> out(static_cast<size_t>(S), layers / S);
    // The remainder goes to the middle stages first: the first stage also runs the embedding and
    // the last the head, so they are the ones to keep light.
    int64_t extra = layers % S;
    std::vector<int64_t> order;
    for (int64_t k = 1; k + 1 < S; ++k) order.push_back(k);
    order.push_back(S - 1);
    order.push_back(0);
    for (size_t i = 0; extra > 0; ++i, --extra) ++out[static_cast<size_t>(order[i % order.size()])];
    return out;
  }
  std::string list;
  int64_t sum = 0;
  for (int64_t n : stage_layers) {
    list += (list.empty() ? "" : ", ") + std::to_string(n);
    sum += std::clamp<int64_t>(n, -(int64_t{1} << 40), int64_t{1} << 40);
  }
  LATHE_CHECK(static_cast<int64_t>(stage_layers.size()) == S,
              "{}: parallel.stage_layers [{}] has {} entries but there are {} stages (parallel.pipeline {} x "
              "virtual_stages {}): give one layer count per stage, virtual stage k running on rank k % {}",
              source, list, stage_layers.size(), S, stages, virtual_stages, stages);
  for (size_t k = 0; k < stage_layers.size(); ++k)
    LATHE_CHECK(stage_layers[k] >= 1,
                "{}: parallel.stage_layers [{}]: stage {} has {} layers; every stage needs at least one", source, list,
                k, stage_layers[k]);
  LATHE_CHECK(sum == layers,
              "{}: parallel.stage_layers [{}] sums to {} but the model has {} layers (num_hidden_layers): make the "
              "counts add up to {}",
              source, list, sum, layers, layers);
  return stage_layers;
}

double bubble_formula(int64_t stages, int64_t micro_batches, int64_t virtual_stages) {
  const double p = static_cast<double>(stages), m = static_cast<double>(micro_batches),
               v = static_cast<double>(virtual_stages);
  return (p - 1) / (v * m + p - 1);
}

SimResult simulate(const Spec& s, const std::vector<std::vector<Action>>& ranks, const Costs& c) {
  validate(s);
  const int64_t p = s.stages, m = s.micro_batches, v = s.virtual_stages, S = p * v;
  SimResult res;
  auto fail = [&](std::string msg) {
    res.ok = false;
    res.error = std::move(msg);
    return res;
  };
  if (static_cast<int64_t>(ranks.size()) != p)
    return fail(fmt::format("{} action lists for {} pipeline ranks", ranks.size(), p));
  for (auto* per : {&c.forward_per_stage, &c.backward_per_stage})
    if (!per->empty() && static_cast<int64_t>(per->size()) != S)
      return fail(fmt::format("{} per-stage costs for {} virtual stages", per->size(), S));
  auto fcost = [&](int64_t k) { return c.forward_per_stage.empty() ? c.forward : c.forward_per_stage[k]; };
  auto bcost = [&](int64_t k) { return c.backward_per_stage.empty() ? c.backward : c.backward_per_stage[k]; };

  // Indexed [mb * S + k]: per (micro-batch, virtual stage). Messages by the boundary k -> k+1.
  const auto n = static_cast<size_t>(m * S);
  std::vector<char> fwd(n, 0), bwd(n, 0), got_act(n, 0), got_grad(n, 0);
  std::vector<double> act_at(n, -1), grad_at(n, -1);  // arrival time of a posted message; -1 = not posted
  std::vector<char> act_recv(n, 0), grad_recv(n, 0);
  std::vector<size_t> pc(static_cast<size_t>(p), 0);
  std::vector<double> t(static_cast<size_t>(p), 0);
  std::vector<int64_t> inflight(static_cast<size_t>(p), 0);
  res.busy.assign(static_cast<size_t>(p), 0);
  res.max_in_flight.assign(static_cast<size_t>(p), 0);
  res.messages.assign(static_cast<size_t>(p), 0);

  // One step of rank r: 1 = done, 0 = blocked on a recv, -1 = violation (res.error set).
  auto step = [&](int64_t r) -> int {
    const auto ru = static_cast<size_t>(r);
    const Action& a = ranks[ru][pc[ru]];
    const std::string where = fmt::format("rank {} action {} ({})", r, pc[ru], to_string(a));
    if (a.mb < 0 || a.mb >= m || a.chunk < 0 || a.chunk >= v) {
      res.error = fmt::format("{}: micro-batch or chunk out of range (m {}, v {})", where, m, v);
      return -1;
    }
    const int64_t k = a.chunk * p + r;
    const size_t i = static_cast<size_t>(a.mb * S + k);
    const int32_t next = static_cast<int32_t>((k + 1) % p), prev = static_cast<int32_t>((k + p - 1) % p);
    auto bad = [&](std::string_view why) {
      res.error = fmt::format("{}: {}", where, why);
      return -1;
    };
    switch (a.op) {
      case Op::Forward:
        if (fwd[i]) return bad("forward run twice");
        if (k > 0 && !got_act[i]) return bad("forward before its input activation was received");
        fwd[i] = 1;
        t[ru] += fcost(k);
        res.busy[ru] += fcost(k);
        res.max_in_flight[ru] = std::max(res.max_in_flight[ru], ++inflight[ru]);
        break;
      case Op::Backward:
        if (!fwd[i]) return bad("backward before its forward");
        if (bwd[i]) return bad("backward run twice");
        if (k < S - 1 && !got_grad[i]) return bad("backward before its output gradient was received");
        bwd[i] = 1;
        t[ru] += bcost(k);
        res.busy[ru] += bcost(k);
        --inflight[ru];
        break;
      case Op::SendAct:
        if (k == S - 1) return bad("the last stage sends no activation");
        if (a.peer != next) return bad(fmt::format("the next stage is on rank {}", next));
        if (!fwd[i]) return bad("activation sent before its forward");
        if (act_at[i] >= 0) return bad("activation sent twice");
        act_at[i] = t[ru] + c.p2p;
        ++res.messages[ru];
        break;
      case Op::SendGrad:
        if (k == 0) return bad("the first stage sends no gradient");
        if (a.peer != prev) return bad(fmt::format("the previous stage is on rank {}", prev));
        if (!bwd[i]) return bad("gradient sent before its backward");
        if (grad_at[i - 1] >= 0) return bad("gradient sent twice");
        grad_at[i - 1] = t[ru] + c.p2p;
        ++res.messages[ru];
        break;
      case Op::RecvAct:
        if (k == 0) return bad("the first stage receives no activation");
        if (a.peer != prev) return bad(fmt::format("the previous stage is on rank {}", prev));
        if (act_recv[i - 1]) return bad("activation received twice");
        if (act_at[i - 1] < 0) return 0;
        act_recv[i - 1] = got_act[i] = 1;
        t[ru] = std::max(t[ru], act_at[i - 1]);
        break;
      case Op::RecvGrad:
        if (k == S - 1) return bad("the last stage receives no gradient");
        if (a.peer != next) return bad(fmt::format("the next stage is on rank {}", next));
        if (grad_recv[i]) return bad("gradient received twice");
        if (grad_at[i] < 0) return 0;
        grad_recv[i] = got_grad[i] = 1;
        t[ru] = std::max(t[ru], grad_at[i]);
        break;
    }
    ++pc[ru];
    return 1;
  };

  // Each rank runs until it blocks; sends never block, so the order ranks are visited in changes
  // nothing but the order of discovery. No progress in a whole round = deadlock.
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < p; ++r)
      while (pc[static_cast<size_t>(r)] < ranks[static_cast<size_t>(r)].size()) {
        const int st = step(r);
        if (st < 0) return res;
        if (st == 0) break;
        progress = true;
      }
  }
  std::string blocked;
  for (int64_t r = 0; r < p; ++r) {
    const auto ru = static_cast<size_t>(r);
    if (pc[ru] < ranks[ru].size())
      blocked += fmt::format("{}rank {} at action {} ({})", blocked.empty() ? "" : ", ", r, pc[ru],
                             to_string(ranks[ru][pc[ru]]));
  }
  if (!blocked.empty()) return fail("deadlock: " + blocked + " wait for messages never sent");
  for (int64_t mb = 0; mb < m; ++mb)
    for (int64_t k = 0; k < S; ++k) {
      const auto i = static_cast<size_t>(mb * S + k);
      if (!fwd[i] || !bwd[i])
        return fail(fmt::format("micro-batch {} virtual stage {} (rank {} chunk {}): {} never run", mb, k, k % p, k / p,
                                fwd[i] ? "backward" : "forward"));
      if (k < S - 1 && !act_recv[i])
        return fail(fmt::format("activation of micro-batch {} from virtual stage {} never received", mb, k));
      if (k < S - 1 && !grad_recv[i])
        return fail(fmt::format("gradient of micro-batch {} into virtual stage {} never received", mb, k));
    }
  res.makespan = *std::max_element(t.begin(), t.end());
  double busy = 0;
  for (double b : res.busy) busy += b;
  res.bubble = res.makespan > 0 ? 1 - busy / (static_cast<double>(p) * res.makespan) : 0;
  res.ok = true;
  return res;
}

}  // namespace lathe::pipeline
