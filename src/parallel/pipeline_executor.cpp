#include "parallel/pipeline_executor.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "core/trace.h"

namespace lathe::parallel {

namespace {
using pipeline::Op;
}  // namespace

PipelineExecutor::PipelineExecutor(Model& stage, const PipelineLayout& layout, dist::Communicator& pp, int64_t B,
                                   int64_t T, int optimizer_moments, Recompute recompute)
    : m_(stage), layout_(layout), pp_(pp), B_(B), T_(T), staged_(stage.on_device()) {
  const int p = static_cast<int>(layout.stages()), r = pp.rank();
  LATHE_CHECK(pp.size() == p && r == layout.rank, "internal: pipeline group rank {} of {} for layout rank {} of {}", r,
              pp.size(), layout.rank, p);
  schedule_ = pipeline::make_schedule(layout.spec);
  const pipeline::SimResult sim = pipeline::simulate(layout.spec, schedule_);
  LATHE_CHECK(sim.ok, "internal: the {} schedule failed its simulation: {}", pipeline::kind_name(layout.spec.kind),
              sim.error);
  slots_ = std::max<int64_t>(1, sim.max_in_flight[static_cast<size_t>(r)]);
  stage.allocate(B, T, optimizer_moments, recompute, slots_);
  slot_owner_.assign(static_cast<size_t>(slots_), {-1, -1});
  // The directed channels, split in the same order on every rank (collective over pp): sender
  // first (rank 0 of the channel), receiver second. The wrap-around edges (p-1 -> 0 for
  // activations, 0 -> p-1 for gradients) exist only with virtual stages.
  const bool wrap = layout.spec.virtual_stages > 1;
  for (int kind = 0; kind < 2; ++kind) {  // 0: activations go to s + 1; 1: gradients go to s - 1
    for (int s = 0; s < p; ++s) {
      const int to = kind == 0 ? (s + 1) % p : (s + p - 1) % p;
      const bool edge = kind == 0 ? (s + 1 < p || wrap) : (s > 0 || wrap);
      if (!edge) continue;
      const bool member = r == s || r == to;
      auto c =
          pp.split(member ? 0 : -1, r == s ? 0 : 1, fmt::format("pp-{}-{}to{}", kind == 0 ? "act" : "grad", s, to));
      if (!member) continue;
      auto& slot = r == s ? (kind == 0 ? act_out_ : grad_out_) : (kind == 0 ? act_in_ : grad_in_);
      slot = std::move(c);
    }
  }
  // Megatron's embedding group: the first and last stage each hold the tied wte.
  if (layout.tied) embed_ = pp.split(layout.first() || layout.last() ? 0 : -1, r, "pp-embed");
}

PipelineExecutor::~PipelineExecutor() {
  try {
    wait_sends();
  } catch (...) {  // a failed send was reported by the step that issued it
  }
}

void PipelineExecutor::wait_sends() {
  for (auto& s : sends_) s.work->wait();
  sends_.clear();
}

void PipelineExecutor::send(dist::Communicator& channel, const void* buf, size_t bytes) {
  // Drop the sends that are done (keeps the copies to the messages still in flight).
  std::erase_if(sends_, [](const Send& s) { return s.work->done(); });
  Send s;
  s.data.resize(bytes);
  m_.backend().copy(s.data.data(), buf, bytes, CopyKind::DeviceToHost);
  s.work = channel.send_async(s.data.data(), bytes, 1, 0);  // the vector's storage moves with it
  sends_.push_back(std::move(s));
}

void PipelineExecutor::receive(dist::Communicator& channel, void* buf, size_t bytes) {
  if (!staged_) return channel.recv(buf, bytes, 0, 0);
  staging_.resize(bytes);
  channel.recv(staging_.data(), bytes, 0, 0);
  m_.backend().copy(buf, staging_.data(), bytes, CopyKind::HostToDevice);
}

void PipelineExecutor::span(int64_t first_block, int64_t last_block, bool backward) {
  if (gather_) gather_->begin_span(first_block, last_block, backward);
}

void PipelineExecutor::gather(int64_t block, bool backward) {
  if (gather_) gather_->before_block(block, backward);
}

void PipelineExecutor::end_span() {
  if (gather_) gather_wait_s_ += gather_->end_pass();
}

int PipelineExecutor::take_slot(int64_t mb, int64_t chunk) {
  for (size_t i = 0; i < slot_owner_.size(); ++i)
    if (slot_owner_[i].first < 0) {
      slot_owner_[i] = {mb, chunk};
      return static_cast<int>(i);
    }
  throw_error("internal: pipeline rank {}: no free activation slot of {} for micro-batch {} chunk {}", layout_.rank,
              slots_, mb, chunk);
}

int PipelineExecutor::slot_of(int64_t mb, int64_t chunk) const {
  for (size_t i = 0; i < slot_owner_.size(); ++i)
    if (slot_owner_[i] == std::pair<int64_t, int64_t>{mb, chunk}) return static_cast<int>(i);
  throw_error("internal: pipeline rank {}: micro-batch {} chunk {} holds no activation slot", layout_.rank, mb, chunk);
}

void PipelineExecutor::release(int64_t mb, int64_t chunk) {
  slot_owner_[static_cast<size_t>(slot_of(mb, chunk))] = {-1, -1};
}

double PipelineExecutor::step(const int32_t* inputs, const int32_t* targets, float grad_scale, const DocsFn& docs) {
  const int64_t p = layout_.stages(), S = p * layout_.spec.virtual_stages, N = B_ * T_;
  // This rank's rows of the residual stream [N, C] (sequence parallelism: its N / tp rows).
  const size_t bytes =
      static_cast<size_t>(m_.tensor_shard().rows_held(N) * m_.config().hidden_size) * dtype_size(m_.compute_dtype());
  const int r = layout_.rank;
  double loss = 0;
  gather_wait_s_ = 0;
  // ZeRO 3: the stage model's blocks are 0 = embedding, 1..L = its layers, L + 1 = head.
  const int64_t head = gather_ ? gather_->blocks() - 1 : 0;
  for (const pipeline::Action& a : schedule_[static_cast<size_t>(r)]) {
    const int64_t k = a.chunk * p + r;  // virtual stage
    const PipelineLayout::Chunk& ch = layout_.chunks[static_cast<size_t>(a.chunk)];
    const int32_t* tok = inputs + a.mb * N;
    switch (a.op) {
      case Op::RecvAct: {
        trace::Scope span("pipeline recv activation", trace::Cat::Comm, a.mb);
        m_.use_slot(take_slot(a.mb, a.chunk));
        receive(*act_in_, m_.residual(ch.local_first), bytes);
        break;
      }
      case Op::Forward: {
        m_.use_slot(k == 0 ? take_slot(a.mb, a.chunk) : slot_of(a.mb, a.chunk));
        if (docs) docs(a.mb);
        span(k == 0 ? 0 : ch.local_first + 1, k == S - 1 ? head : ch.local_first + ch.count, false);
        if (k == 0) {
          gather(0, false);
          m_.embedding_forward(tok, B_, T_);
        }
        for (int64_t l = ch.local_first; l < ch.local_first + ch.count; ++l) {
          gather(l + 1, false);
          m_.layer_forward(l, B_, T_);
        }
        // The last virtual stage: the head's forward and backward at once (dres of this slot).
        if (k == S - 1) {
          gather(head, false);
          loss += m_.head_loss(targets + a.mb * N, B_, T_, grad_scale, true);
        }
        end_span();
        break;
      }
      case Op::SendAct: {
        m_.use_slot(slot_of(a.mb, a.chunk));
        send(*act_out_, m_.residual(ch.local_first + ch.count), bytes);
        break;
      }
      case Op::RecvGrad: {
        trace::Scope span("pipeline recv gradient", trace::Cat::Comm, a.mb);
        m_.use_slot(slot_of(a.mb, a.chunk));
        receive(*grad_in_, m_.residual_grad(), bytes);
        break;
      }
      case Op::Backward: {
        m_.use_slot(slot_of(a.mb, a.chunk));
        if (docs) docs(a.mb);
        span(k == 0 ? 0 : ch.local_first + 1, ch.local_first + ch.count, true);
        for (int64_t l = ch.local_first + ch.count - 1; l >= ch.local_first; --l) {
          gather(l + 1, true);
          m_.layer_backward(l, B_, T_);
        }
        if (k == 0) {
          gather(0, true);
          m_.embedding_backward(tok, B_, T_);
          release(a.mb, a.chunk);  // no gradient to send
        }
        end_span();
        break;
      }
      case Op::SendGrad: {
        m_.use_slot(slot_of(a.mb, a.chunk));
        send(*grad_out_, m_.residual_grad(), bytes);
        release(a.mb, a.chunk);
        break;
      }
    }
  }
  wait_sends();
  m_.use_slot(0);
  if (embed_) {
    // Sum of the two stages' wte gradients, the same bits on both (rank-ordered reduction).
    const ParamSpec* wte = nullptr;
    for (const ParamSpec& s : m_.params().specs())
      if (s.role == Role::Wte) wte = &s;
    LATHE_CHECK(wte != nullptr, "internal: a tied pipeline stage without wte");
    trace::Scope span("pipeline tied embedding all-reduce", trace::Cat::Comm);
    // In pieces of 4M floats: the communicator's reduction stages a copy of what it reduces, so one
    // call over the whole wte gradient (V x C) would add its size to the peak memory. Each element
    // is still summed in rank order: the same bits.
    constexpr size_t kPiece = size_t{1} << 22;
    float* g = m_.backend_grad_data() + wte->offset;
    const size_t n = static_cast<size_t>(wte->numel());
    for (size_t at = 0; at < n; at += kPiece) {
      const size_t c = std::min(kPiece, n - at);
      if (!staged_) {
        embed_->all_reduce(g + at, c, DType::F32);
        continue;
      }
      staging_.resize(c * sizeof(float));
      float* h = reinterpret_cast<float*>(staging_.data());
      m_.backend().copy(h, g + at, c * sizeof(float), CopyKind::DeviceToHost);
      embed_->all_reduce(h, c, DType::F32);
      m_.backend().copy(g + at, h, c * sizeof(float), CopyKind::HostToDevice);
    }
  }
  pp_.all_reduce(&loss, 1, DType::F64);  // only the last stage's is non-zero: the sum is exact
  return loss;
}

void PipelineExecutor::forward_stages(const int32_t* tokens, int64_t b, int64_t T, const std::function<void()>& last) {
  const int64_t p = layout_.stages(), S = p * layout_.spec.virtual_stages;
  const size_t bytes = static_cast<size_t>(m_.tensor_shard().rows_held(b * T) * m_.config().hidden_size) *
                       dtype_size(m_.compute_dtype());
  const int r = layout_.rank;
  m_.use_slot(0);
  // Virtual stages in order, one micro-batch: each rank runs its chunks when their input arrives.
  // Blocking sends: the next receive may land in the buffer just sent (chunk c's output is chunk
  // c + 1's input position).
  for (int64_t k = r; k < S; k += p) {
    const PipelineLayout::Chunk& ch = layout_.chunks[static_cast<size_t>(k / p)];
    if (k == 0)
      m_.embedding_forward(tokens, b, T);
    else
      receive(*act_in_, m_.residual(ch.local_first), bytes);
    for (int64_t l = ch.local_first; l < ch.local_first + ch.count; ++l) m_.layer_forward(l, b, T);
    if (k == S - 1) {
      last();
    } else if (staged_) {
      staging_.resize(bytes);
      m_.backend().copy(staging_.data(), m_.residual(ch.local_first + ch.count), bytes, CopyKind::DeviceToHost);
      act_out_->send(staging_.data(), bytes, 1, 0);
    } else {
      act_out_->send(m_.residual(ch.local_first + ch.count), bytes, 1, 0);
    }
  }
}

double PipelineExecutor::forward_loss(const int32_t* tokens, const int32_t* targets, int64_t b, const DocsFn& docs) {
  double loss = 0;
  m_.use_slot(0);
  if (docs) docs(-1);
  forward_stages(tokens, b, T_, [&] { loss = m_.head_loss(targets, b, T_, 0.0f, false); });
  pp_.all_reduce(&loss, 1, DType::F64);
  return loss;
}

void PipelineExecutor::forward_logits(const int32_t* tokens, int64_t b, int64_t T, float* logits) {
  forward_stages(tokens, b, T, [&] { m_.head_logits(b, T, logits); });
}

}  // namespace lathe::parallel
