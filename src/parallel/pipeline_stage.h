// Pipeline parallelism (issue 10, item 3): which part of the model each pipeline rank holds, the
// stage's Model built from the whole model's table, and moving weights (or any buffer laid out like
// them: moments) between the whole model's flat buffer and a stage's.
//
// The decoder layers are cut into p x v virtual stages (parallel.stage_layers, or even);
// virtual stage k runs on pipeline rank k % p as its model chunk k / p (pipeline_schedule.h).
// Rank r's stage model holds the layers of its chunks in global order (local layer 0 is the first
// layer of chunk 0), plus the embedding on rank 0 (virtual stage 0) and the final norm and lm head
// on rank p - 1 (virtual stage p v - 1). A tied lm head (GPT-2) is the wte itself: both rank 0 and
// rank p - 1 hold it, and their gradients are summed between the two before the optimizer step
// (Megatron's embedding group), so the two copies stay identical. Tensors keep the whole model's
// names, so a stage's table is the matching slice of the global table.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/recipe.h"
#include "dist/comm.h"
#include "models/model.h"
#include "parallel/pipeline_schedule.h"

namespace lathe::parallel {

struct PipelineLayout {
  pipeline::Spec spec;                 // kind (1f1b, or interleaved with v > 1), p, m, v
  std::vector<int64_t> vstage_layers;  // p * v: decoder layers of each virtual stage
  int rank = 0;                        // this pipeline rank
  struct Chunk {
    int64_t global_first = 0, local_first = 0, count = 0;  // its layers, in the whole / stage model
  };
  std::vector<Chunk> chunks;  // v: this rank's chunks (chunk c = virtual stage c * p + rank)
  int64_t local_layers = 0;
  bool tied = false;  // the lm head is the wte (held by rank 0 and rank p - 1)

  int64_t stages() const { return spec.stages; }
  bool first() const { return rank == 0; }               // holds the embedding
  bool last() const { return rank == spec.stages - 1; }  // holds the final norm and the head
  // The pipeline rank whose chunk holds global decoder layer `layer`.
  int rank_of_layer(int64_t layer) const;
  // The pipeline rank that counts tensor `s` of the whole table (gradient norm, gathers): its
  // layer's rank, rank 0 for the embedding (a tied wte too), rank p - 1 for the head.
  int owner(const ParamSpec& s) const;
  // Whether rank `r` holds `s` (its owner, or rank p - 1 for a tied wte).
  bool holds(const ParamSpec& s, int r) const;
};

// The layout of pipeline rank `rank` for `r` (parallel.pipeline, virtual_stages, stage_layers;
// training.grad_accum_steps micro-batches) and a model of `layers` decoder layers. Errors name the
// recipe and the values: fewer micro-batches than stages, stage_layers that do not sum to the
// layers, a layer count the stages do not divide without stage_layers, an interleaved schedule
// whose micro-batches are not a multiple of the stages.
PipelineLayout pipeline_layout(const Recipe& r, int64_t layers, bool tied, int rank);
// The same from the recipe's parallel section, its micro-batches per step and its name (`source`).
PipelineLayout pipeline_layout(const Recipe::Parallel& par, int64_t micro_batches, const std::string& source,
                               int64_t layers, bool tied, int rank);

// One line for the log: "pipeline 2 stages (1f1b, 8 micro-batches): layers [2, 2]; bubble 11.1%
// (formula (p-1)/(v m + p-1)), at most 2 micro-batches in flight per rank".
std::string describe_pipeline(const PipelineLayout& l);

// The slice of the whole table `whole` that pipeline rank `layout.rank` holds: same names, shapes
// and shard rules, layers renumbered locally (chunks in order), laid out in the whole table's order.
ParamTable stage_table(const ParamTable& whole, const PipelineLayout& layout);

// The stage model of `layout.rank`: `whole`'s config with the stage's layer count, its Arch
// without embedding / head where the stage has none, and the slice of its table (same names,
// layers renumbered locally), computing like `whole`. Weights are not set (scatter_stage).
std::unique_ptr<Model> build_stage_model(const Model& whole, const PipelineLayout& layout);

// Copies each tensor of the stage table `local` from the whole flat buffer `g` (laid out by
// `global`) into `l` (laid out by `local`), by name.
void scatter_stage(const ParamTable& global, const float* g, const ParamTable& local, float* l);

// Assembles the whole flat buffer on every rank of `pp` (all-gather of each rank's owned tensors,
// in the global table's order): `l` is this rank's stage buffer (weights, or moments laid out like
// them), `g` receives every tensor of `global`.
void gather_stages(dist::Communicator& pp, const PipelineLayout& layout, const ParamTable& global,
                   const ParamTable& local, const float* l, float* g);

}  // namespace lathe::parallel
