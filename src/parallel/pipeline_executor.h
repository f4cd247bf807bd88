// Runs a pipeline schedule's action list (pipeline_schedule.h) on this rank's stage model
// (pipeline_stage.h): one optimizer step's micro-batches, forward and backward, with the
// activations [B*T, C] going down and their gradients coming back up as point-to-point messages.
//
// Activations: the stage model is allocated with one arena per (micro-batch, chunk) the schedule
// can hold at once on this rank (the simulator's maximum in flight); a slot is taken when the
// chunk's input arrives (or its embedding runs) and given back after its backward.
// The last virtual stage runs the head's forward and backward together (the fused lm-head loss
// produces the gradient with the loss), so its Backward action starts from the stored dres.
//
// Messages: Communicator::send runs on the communicator's progress thread and may block until the
// peer receives (MPI_Send); a send queued behind a blocked receive would break the schedule's "sends
// never wait" assumption (the simulator's proof). So every directed (sender -> receiver, activation
// or gradient) pair of neighbours gets its own two-rank communicator: on it the sender only sends
// and the receiver only receives, in the same order (the schedules walk micro-batches in the same
// order on every rank), so a send waits at most for the receive it matches.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dist/comm.h"
#include "models/model.h"
#include "parallel/param_gather.h"
#include "parallel/pipeline_stage.h"

namespace lathe::parallel {

class PipelineExecutor {
 public:
  // Collective over `pp` (splits the message channels); allocates `stage` for B x T with one
  // activation arena per micro-batch in flight. `pp` and `stage` must outlive the executor.
  PipelineExecutor(Model& stage, const PipelineLayout& layout, dist::Communicator& pp, int64_t B, int64_t T,
                   int optimizer_moments, Recompute recompute);
  ~PipelineExecutor();

  // Sets the documents of micro-batch mb on the stage model (documents.h), or does nothing.
  using DocsFn = std::function<void(int64_t mb)>;

  // One step: micro-batch i is inputs / targets + i*B*T ([B, T] each; m = spec.micro_batches).
  // Gradients accumulate into the stage's grad buffer scaled by grad_scale; a tied wte's gradient
  // is summed between the first and the last stage at the end. Returns the sum of the token losses
  // of all micro-batches, the same on every rank of the pipeline.
  double step(const int32_t* inputs, const int32_t* targets, float grad_scale, const DocsFn& docs);

  // Forward only (validation): `b` <= B rows (docs is called with -1: the documents of `tokens`).
  // Returns the loss sum, the same on every rank.
  double forward_loss(const int32_t* tokens, const int32_t* targets, int64_t b, const DocsFn& docs);

  // Logits [b, T, V] (V = the whole vocabulary) of one forward pass over b <= B rows of T <= the
  // allocated seq_len tokens, written on the last stage only (the others leave `logits` as it is):
  // multiple-choice scoring under a pipeline. Collective over the pipeline group.
  void forward_logits(const int32_t* tokens, int64_t b, int64_t T, float* logits);

  int64_t slots() const { return slots_; }
  // A device-resident stage (Model::on_device(); on by default for one) stages every message
  // through host memory: device -> host before a send, host -> device after a receive, and the tied
  // wte gradient's all-reduce piece by piece likewise, since the channels are host communicators.
  // (A device path without the copies would give the channels NCCL groups: ncclSend/ncclRecv on
  // device buffers, the compute stream synchronised before a send, and a device copy per message in
  // flight instead of `sends_`' host copies.) Tests turn it on for a CPU stage (memcpy) to run the
  // same code.
  void set_stage_through_host(bool on) { staged_ = on; }
  // ZeRO 3 (param_gather.h): each Forward / Backward action gathers its chunk's blocks (a span of
  // its own, prefetch inside it) and releases them when done. The gather object outlives the
  // executor's steps; nullptr: the stage's weights are whole. forward_loss / forward_logits need
  // the whole weights (DistOptimizer::gather_whole) and gather nothing.
  void set_param_gather(ParamGather* gather) { gather_ = gather; }
  // Seconds the last step() waited for weight gathers (the communication compute did not hide).
  double gather_wait_s() const { return gather_wait_s_; }

 private:
  int take_slot(int64_t mb, int64_t chunk);
  int slot_of(int64_t mb, int64_t chunk) const;
  void release(int64_t mb, int64_t chunk);
  void wait_sends();
  // One forward pass of b x T tokens through the stages in order (virtual stages in turn, blocking
  // messages); the last virtual stage runs `last` instead of sending its output.
  void forward_stages(const int32_t* tokens, int64_t b, int64_t T, const std::function<void()>& last);

  Model& m_;
  PipelineLayout layout_;
  dist::Communicator& pp_;
  std::unique_ptr<dist::Communicator> embed_;  // ranks 0 and p-1 with a tied wte
  int64_t B_, T_;
  std::vector<std::vector<pipeline::Action>> schedule_;
  int64_t slots_ = 1;
  std::vector<std::pair<int64_t, int64_t>> slot_owner_;  // (mb, chunk) or (-1, -1)
  // Sends in flight, each reading its own copy of the message: the slot it came from may be taken
  // again at once (waiting there for the peer's receive could deadlock the schedule).
  struct Send {
    std::vector<std::byte> data;
    dist::WorkPtr work;
  };
  std::vector<Send> sends_;
  void send(dist::Communicator& channel, const void* buf, size_t bytes);
  void receive(dist::Communicator& channel, void* buf, size_t bytes);  // blocking, staged when staged_
  bool staged_ = false;
  ParamGather* gather_ = nullptr;
  double gather_wait_s_ = 0;
  // ZeRO 3: the span of one action begun, and a block's weights made whole before it runs.
  void span(int64_t first_block, int64_t last_block, bool backward);
  void gather(int64_t block, bool backward);
  void end_span();
  std::vector<std::byte> staging_;  // a received message, or a blocking send's copy (staged_)
  // Channels: activations to the next rank / from the previous, gradients to the previous / from the next.
  std::unique_ptr<dist::Communicator> act_out_, act_in_, grad_out_, grad_in_;
};

}  // namespace lathe::parallel
