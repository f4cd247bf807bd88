// `lathe plan`: every data x context x tensor x pipeline layout of a job (with sequence parallel on/off, ZeRO
// 0/1/2, recompute none/selective/full), its validity for the model (with the reason when not), the
// memory each rank needs and a predicted step time, sorted by predicted tokens/s (issue 10).
//
// Memory per rank (the heaviest pipeline stage), from the same pieces `lathe check` uses:
//   parameters, gradients (fp32): the stage's layers (matrices / tensor, norms and row-parallel
//     biases replicated) + the embedding on the first stage + final norm and head on the last
//     (a tied head is a copy of the embedding there when pipeline > 1; vocab-parallel / tensor);
//   moments: 2 fp32 copies of the rank's parameters, / data with ZeRO 1 or 2 (lathe's ZeRO 2 frees
//     the rest of the gradient buffer only after the step's reduction, so with several
//     micro-batches its peak is ZeRO 1's; `lathe check` counts it the same way);
//   compute-dtype weight copies (bf16 / fp16);
//   activations: Model::plan_activations's entries, each placed on its stage: a decoder layer's
//     buffers times the micro-batches in flight on that stage (1F1B: min(p - s, m), from the
//     schedule simulator; interleaved: the (micro-batch, chunk) pairs in flight x 1/v of the rank's
//     layers), the other kept buffers (the stage input `emb`, the residual-stream gradient `dres`,
//     RoPE tables) too; the transient ones (ActivationEntry::transient: gradients of the running
//     layer, the head's buffers, scratch, recompute sets) once per stage, as a stage's arena of
//     several slots shares them (Model::allocate). Tensor parallel divides the
//     head-/MLP-width buffers (qkv, att, lse, fc, act and their gradients); the hidden-width ones
//     (norms, residuals) are divided too only with sequence parallel;
//   communication buffers: with pipeline > 1 the copies of the messages in flight (an activation
//     and a gradient); the host reductions' staging (dist/comm.h kReduceStagingBytes: X bytes for
//     a reduction of X up to half of it, then that bound) of a gradient bucket with data > 1 (25 MB
//     or the rank's gradients), plus a tensor all-reduce of one activation with tensor > 1, or the
//     tied embedding's gradient sum between first and last stage if larger.
// With data x 1 x 1 this is estimate_memory() of models/memory.h, the figure `lathe check --world
// N` prints, plus the bucket staging (tested).
//
// Step time: each stage's forward and backward per micro-batch from its FLOPs (Model's convention
// 6 N + 12 L C T per token, split per stage; x 4/3 on the layers with full recompute) / peak, plus
// tensor-parallel collectives inside it (2 all-reduces of B x T x C per layer forward and 2
// backward, 2 more forward with full recompute; with sequence parallel all-gather + reduce-scatter,
// the same bytes); the 1F1B (or interleaved) schedule with these costs and the point-to-point message time runs in
// the simulator (parallel/pipeline_schedule.h), which gives the pipeline's time with its bubble;
// then the data-parallel gradient reduction (ring all-reduce, or reduce-scatter + all-gather with
// ZeRO: the same 2 (d-1)/d of the fp32 gradient bytes), not overlapped. Ring collectives cost
// 2 (n-1)/n x bytes / bandwidth (all-reduce) or (n-1)/n (all-gather, reduce-scatter), no latency
// term. Ranks are ordered tensor fastest, then context, then data, then pipeline: a group whose
// ranks all lie on one node (gpus_per_node) uses the intra-node bandwidth, others the inter-node one.
//
// Context parallelism c (issue 27, parallel/context_parallel.h): a rank's passes hold T / c rows of
// each sample (activations of T / c rows, RoPE tables of T; compute / c, the causal work being
// load-balanced), ZeRO shards and the gradient reduction span data x context, and the comm buffers
// add ContextAttention's (ring: 5 K|V blocks of the rank's rows; all-gather: 2 c). Each layer's
// K/V exchange per micro-batch: the ring passes c - 1 blocks, each hidden behind one block's
// attention up to its time, and sends dK/dV c hops after the blocks (not hidden); the all-gather's
// all-gather (forward) and all-gather + reduce-scatter (backward) are not hidden. These seconds are
// part of the stage costs the schedule simulates (cp_s: their sum per step).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/dtype.h"
#include "models/recompute.h"

namespace lathe::plan {

struct Machine {
  double peak_gflops = 0;     // per rank, dense GEMM in the compute dtype
  double inter_gbps = 0;      // per rank, between nodes, Gbit/s (one direction)
  double intra_gbps = 0;      // per rank, inside a node, Gbit/s
  int64_t gpus_per_node = 1;  // ranks per node (tensor groups should fit inside one)
  int64_t memory_bytes = 0;   // per rank; 0 = unknown (everything "fits")
};

struct Job {
  ModelConfig model;
  int64_t world = 1;
  int64_t micro_batch = 1, seq_len = 1;
  int64_t global_batch = 1;  // samples per step; micro-batches per step = global / (micro_batch x data)
  DType compute = DType::F32;
  int moments = 2;  // AdamW / LAMB
  // Model chunks per pipeline rank to try: 1 = 1F1B; v > 1 = Megatron's interleaved 1F1B (layouts
  // with pipeline > 1 whose layers and micro-batches allow it).
  std::vector<int64_t> virtual_stages = {1};
  // Largest p x m x v simulated step by step; longer steps are extended linearly from two shorter
  // simulations (the steady phase adds the same time per group of p micro-batches); pipelines too
  // deep even for those are rejected with the reason.
  int64_t sim_limit = int64_t{1} << 18;
  // Context parallelism's K/V exchange (parallel.context_impl): ring (false) or all-gather (true).
  bool context_allgather = false;
};

struct Layout {
  int64_t data = 1, tensor = 1, pipeline = 1;
  bool sequence = false;
  int zero = 0;
  Recompute recompute = Recompute::None;
  int64_t virtual_stages = 1;  // > 1: interleaved 1F1B with this many chunks per rank
  int64_t context = 1;         // context parallelism (issue 27): each rank holds T / context rows
  std::string name() const;    // "data 8 x tensor 2 x pipeline 4 +sp, ZeRO 1, recompute full"
};

struct Memory {
  int64_t params = 0, grads = 0, moments = 0, compute_weights = 0, activations = 0, comm = 0;
  int64_t stage = 0;      // the pipeline rank these figures are for (the heaviest)
  int64_t in_flight = 1;  // (micro-batch, chunk) pairs whose activations that rank holds at once
  int64_t total() const { return params + grads + moments + compute_weights + activations + comm; }
};

struct Estimate {
  Layout layout;
  std::string reject;  // why the layout is invalid for this model / batch; "" = valid
  int64_t micro_batches = 0;
  std::vector<int64_t> stage_layers;  // per virtual stage (pipeline x virtual_stages)
  Memory memory;
  bool fits = true;
  // Seconds per optimizer step: compute (no comm), tensor collectives, pipeline messages, the
  // pipeline's idle share (bubble) and data-parallel reduction; step = pipeline + dp.
  double compute_s = 0, tp_s = 0, pp_s = 0, dp_s = 0, pipeline_s = 0, step_s = 0;
  // Context parallelism: the K/V (and dK/dV) bytes one rank sends per layer per micro-batch, forward
  // and backward, and the seconds of that exchange per step the attention compute does not hide
  // (part of the stages' costs, so of pipeline_s; cp_s alone for the comm% column).
  int64_t cp_bytes_fwd = 0, cp_bytes_bwd = 0;
  double cp_s = 0;
  double bubble = 0;  // idle share of the pipeline part (simulated)
  double tokens_per_s = 0, mfu = 0;
};

// One layout. Throws only on an invalid job (world < 1, ...); an invalid layout gets `reject`.
Estimate estimate(const Job& job, const Machine& m, const Layout& l);
// The same with the schedule simulations remembered across calls (enumerate's).
struct ScheduleCache;
Estimate estimate(const Job& job, const Machine& m, const Layout& l, ScheduleCache* cache);
// Every layout of job.world (divisor quadruples data x context x tensor x pipeline, sequence parallel
// only with tensor > 1, ZeRO 1/2 only with data x context > 1, three recompute modes), valid ones
// sorted: fitting first, then by tokens/s.
std::vector<Estimate> enumerate(const Job& job, const Machine& m);

// Model FLOPs per token (Model::flops_per_token's convention: 6 N + 12 (H D) x the keys per position
// summed over the layers, T or a sliding layer's window; N without position embeddings).
double flops_per_token(const ModelConfig& cfg, int64_t T);

nlohmann::json to_json(const Estimate& e);

// One-direction copy bandwidth of this machine (Gbit/s): the best of 3 copies of 64 MB (ranks on
// one machine exchange through shared memory). `lathe plan` and `lathe train` use it when no
// bandwidth is given.
double measure_copy_gbps();

}  // namespace lathe::plan
