// Pipeline-parallel schedules as plain per-rank action lists (issue 10), and a simulator that runs
// every rank's list against the others without MPI.
//
// The model's layers are cut into stages x virtual_stages "virtual stages" k = 0 .. S-1 (S = p*v):
// virtual stage k lives on rank k % p as its model chunk k / p (Megatron's interleaving: rank r
// holds chunks r, r+p, r+2p, ...). A micro-batch's forward walks k = 0 .. S-1, its backward
// S-1 .. 0; between two virtual stages on different ranks the activation goes down as a message and
// its gradient comes back up.
//
// A rank's list holds, in the order it runs them:
//   Forward(mb, chunk) / Backward(mb, chunk)        compute of one micro-batch on one local chunk
//   RecvAct / SendAct (mb, chunk, peer)            input of the chunk from / output to the peer rank
//   RecvGrad / SendGrad (mb, chunk, peer)          output gradient from / input gradient to the peer
// Sends are posted and do not wait (MPI_Isend, Megatron's batched isend/irecv); a Recv blocks until
// the matching message was posted. The simulator proves, for a given list set: no deadlock, every
// forward before its backward and after its input arrived, every message sent once and received
// once by the right rank, every (micro-batch, virtual stage) computed once each way; and measures
// the micro-batches in flight per rank (activations held) and the bubble (idle share of the step).
//
// Generators:
//   GPipe        all forwards, then all backwards (the reference: m micro-batches in flight).
//   1F1B         PipeDream-flush: stage s runs min(p - s - 1, m) warm-up forwards, then one forward
//                and one backward alternately, then the remaining backwards; at most p - s in flight.
//   Interleaved  Megatron's interleaved 1F1B with v model chunks per rank: micro-batches go through
//                the chunks in groups of p (so m % p == 0, as Megatron requires); warm-up
//                (p - r - 1) * 2 + (v - 1) * p chunk-forwards. Bubble (p-1)/(v*m + p-1) of the step
//                with chunk costs 1/v of a stage (Narayanan et al. 2021, sec. 2.2).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lathe::pipeline {

enum class Op : uint8_t { Forward, Backward, SendAct, RecvAct, SendGrad, RecvGrad };

struct Action {
  Op op;
  int32_t mb;         // micro-batch 0 .. m-1
  int32_t chunk;      // model chunk on this rank 0 .. v-1 (virtual stage chunk * p + rank)
  int32_t peer = -1;  // the other rank of a send / recv; -1 for compute
  bool operator==(const Action&) const = default;
};

// "F3.1" (forward of micro-batch 3 on chunk 1), "B3.1", "SendAct3.1>2", "RecvGrad3.1<2".
std::string to_string(const Action& a);

enum class Kind : uint8_t { GPipe, OneFOneB, Interleaved };
// "gpipe" | "1f1b" | "interleaved"; throws naming `what` and the value otherwise.
Kind parse_kind(std::string_view name, std::string_view what);
std::string kind_name(Kind k);

struct Spec {
  Kind kind = Kind::OneFOneB;
  int64_t stages = 1;          // p, pipeline ranks
  int64_t micro_batches = 1;   // m, micro-batches per step (training.grad_accum_steps)
  int64_t virtual_stages = 1;  // v, model chunks per rank (> 1 only for Interleaved)
};

// Throws lathe::Error naming the values (and `source`, e.g. the recipe) when the schedule cannot
// run: p, m, v < 1; m < p (fewer micro-batches than stages leave a stage without work in every
// step: raise training.grad_accum_steps); Interleaved with v < 2 or m % p != 0; v > 1 with another
// kind.
void validate(const Spec& s, std::string_view source = "pipeline schedule");

// One action list per rank (p lists). Validates first.
std::vector<std::vector<Action>> make_schedule(const Spec& s);

// Layers per virtual stage (p * v entries, virtual stage k on rank k % p as chunk k / p).
// `stage_layers` empty: as even as possible, the remainder going to the middle stages first (the
// first holds the embedding, the last the head). Otherwise it must have p * v entries, each >= 1,
// summing to `layers`. Errors name parallel.stage_layers (prefixed by `source`) and the values.
std::vector<int64_t> assign_layers(int64_t layers, int64_t stages, int64_t virtual_stages,
                                   const std::vector<int64_t>& stage_layers, std::string_view source = "recipe");

struct Costs {
  double forward = 1, backward = 2;  // per (micro-batch, chunk); Megatron's usual ratio 1:2
  double p2p = 0;                    // latency of one message (send posted -> recv may complete)
  // Optional per-virtual-stage costs (p * v entries each), e.g. uneven stage_layers; empty = above.
  std::vector<double> forward_per_stage, backward_per_stage;
};

struct SimResult {
  bool ok = false;
  std::string error;                   // the first violation or the deadlock (every blocked rank and its action)
  double makespan = 0;                 // time of the last action on any rank
  double bubble = 0;                   // 1 - (sum of compute time) / (ranks x makespan)
  std::vector<double> busy;            // per rank: compute time
  std::vector<int64_t> max_in_flight;  // per rank: most (mb, chunk) forwards done whose backward is not
  std::vector<int64_t> messages;       // per rank: messages sent
};

// Runs the lists (one per rank) of a schedule for `s` (its p, m, v) with the given costs.
SimResult simulate(const Spec& s, const std::vector<std::vector<Action>>& ranks, const Costs& c = {});

// Megatron's bubble share of a step: (p - 1) / (v * m + p - 1) (v = 1: 1F1B and GPipe).
double bubble_formula(int64_t stages, int64_t micro_batches, int64_t virtual_stages = 1);

}  // namespace lathe::pipeline
