// Checkpoints read and rewritten at any parallel layout (issue 10, item 6).
//
// Every tensor a checkpoint holds (weights "<param>", moments "<moment>/<param>") is described in
// state.json's "tensors" table as pieces of its global shape: a box ("slice": [start, end) per
// dimension) or a flat range of the flattened tensor ("flat": [a, b), written by ZeRO shards).
// CheckpointPieces indexes those pieces as runs of the flattened global tensor (a box is one run
// per row of its last dimension, merged where contiguous) and copies any requested run of global
// elements from the overlapping pieces only: the files are mmap'ed and just those byte ranges are
// touched, so a rank resuming with another layout reads its share, never whole files.
//
// What a run of a layout (tensor T, pipeline P, data D, ZeRO Z) writes (train/checkpointer.cpp), which
// reshard_checkpoint reproduces offline:
//   model.safetensors            every weight whole (rank 0 of the run, gathered across T)
//   T = P = D = 1                optimizer.safetensors: every moment whole
//   T = P = 1, D > 1             optimizer-rankRRRRR-of-DDDDD.safetensors: rank r's FlatShards(P, D,
//                                optim::kChunk) range of the flat moments (the same cut for every Z)
//   T > 1 or P > 1               optimizer-rankRRRRR-of-DDDDD.safetensors: data rank r's
//                                dist::even_counts(P, D) range of the whole model's flat moments
//                                (written by the first rank of each data-parallel replica)
// The ZeRO stage does not change the files; it is recorded in the recipe (parallel.zero). Context
// parallelism C (issue 27) writes as D x C data ranks would (D above stands for D x C), and is
// recorded in the recipe (parallel.context).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/param_table.h"
#include "train/checkpoint.h"

namespace lathe {

namespace io {
class SafetensorsFile;
}

// A run's parallel layout (recipe section `parallel`, data resolved to a number).
// context: the context-parallel degree (issue 27). Its ranks share their samples but each holds the
// whole model, so they write as data ranks do: the files of data x context "writers" (writers()).
struct CheckpointLayout {
  int64_t tensor = 1, pipeline = 1, data = 1, zero = 0, context = 1;
  int64_t writers() const { return data * context; }
  int64_t world() const { return tensor * pipeline * data * context; }
};
// The layout of the run that wrote a checkpoint, from its recipe's parallel section (data 0, as in
// recipes written before it was resolved, is read from the shard files: world.world_size).
CheckpointLayout checkpoint_layout(const CheckpointState& st);

class CheckpointPieces {
 public:
  // Reads state.json (its own checksum checked, the data files' checksums are verify_checkpoint's
  // job) and indexes every listed piece; opens (maps) the tensor files and checks that each listed
  // piece is in its file with the recorded shape and dtype F32 and that each file holds nothing
  // else (alignment pads aside). Reads no tensor data.
  explicit CheckpointPieces(const std::string& ckpt_dir);
  ~CheckpointPieces();
  CheckpointPieces(const CheckpointPieces&) = delete;
  CheckpointPieces& operator=(const CheckpointPieces&) = delete;

  const std::string& dir() const { return dir_; }
  const CheckpointState& state() const { return st_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  // Tensor names in the order of their first piece (file order of state.json's table).
  const std::vector<std::string>& names() const { return names_; }
  const Shape& global_shape(const std::string& name) const;
  // Number of pieces (table entries) holding `name`.
  size_t pieces(const std::string& name) const;
  // Throws unless the pieces of `name` cover every element of its global shape exactly once and
  // the shape is `expect` (the model's; an error says the checkpoint is for another model). The
  // errors name the element range, the files that overlap, or say a piece is missing.
  void check(const std::string& name, const Shape& expect) const;
  // Copies elements [g, g + n) of the flattened global tensor `name` into dst[0, n), from the
  // pieces that hold them (check() first: a gap is an error here too).
  void read(const std::string& name, int64_t g, int64_t n, float* dst) const;
  // Bytes copied out of the files so far (what read() touched).
  int64_t bytes_read() const { return bytes_read_; }

 private:
  struct Run {
    int64_t g0, g1;   // [g0, g1) of the flattened global tensor
    size_t file;      // index into file_names_
    const char* src;  // element g0's bytes in the file's mapping (fp32, maybe unaligned)
  };
  struct Entry {
    Shape shape;
    size_t pieces = 0;
    std::vector<Run> runs;  // sorted by g0
  };
  std::string dir_;
  CheckpointState st_;
  std::vector<std::unique_ptr<io::SafetensorsFile>> files_;
  std::vector<std::string> file_names_;
  std::map<std::string, Entry> index_;
  std::vector<std::string> names_;
  mutable int64_t bytes_read_ = 0;
};

// This rank's moments for a model that holds tensor-parallel rank `rank` of `tp` of the global
// table `global` (local table `local`, parallel/tensor_parallel.h shard rules), restricted to the
// flat range [slice.begin, slice.end) of the local buffer (its ZeRO shard): only the runs of the
// global tensors that land there are read. tp = 1 with local == global is the plain resharded load.
// Every moment of every local tensor must be covered exactly once; values finite (exp_avg_sq >= 0).
void load_moments_sharded(const CheckpointPieces& ck, const ParamTable& global, const ParamTable& local, int rank,
                          int tp, const MomentSlice& slice);

// This rank's weights: every tensor of `local` (its tensor shard of its pipeline stage: tensors of
// `global` by name) read from the checkpoint's pieces into the local flat buffer `out` (laid out
// by `local`), only the runs it holds. Values must be finite.
void load_weights_sharded(const CheckpointPieces& ck, const ParamTable& global, const ParamTable& local, int rank,
                          int tp, float* out);
// ZeRO 3 (a rank's weight shard): only the elements [begin, end) of the flat buffer laid out by
// `table` (the whole model's) read into out[begin, end); the rest of `out` is not touched. Values
// must be finite.
void load_weights_range(const CheckpointPieces& ck, const ParamTable& table, size_t begin, size_t end, float* out);

// Validates `to` against the checkpoint's model (tensor degree dividing heads, KV heads and the MLP
// width; pipeline degree at most the layer count; ZeRO 0-2; world size); errors name the option
// and the value.
void validate_layout(const ModelConfig& cfg, const CheckpointLayout& to);

struct ReshardResult {
  std::string dir;  // the written checkpoint directory
  CheckpointLayout from, to;
  int64_t bytes = 0;
  std::vector<std::string> files;
};
// Offline: reads checkpoint `src` (checksums verified) and writes the checkpoint a run of layout
// `to` would have saved at the same step, as DST_RUN_DIR/checkpoints/step_XXXXXXXX (atomic, with
// `latest`), so `lathe train --resume auto` with output.dir DST_RUN_DIR (or --resume DIR) continues
// it at that layout. The recipe (recipe.yaml and state.json) gets parallel.{tensor, pipeline,
// data, zero} = `to`; everything else in state.json is kept. Files are written canonically
// (save_checkpoint_offline), so resharding A -> B -> A gives byte-identical files to A -> A.
// Refuses to overwrite an existing checkpoint of that step in DST_RUN_DIR.
ReshardResult reshard_checkpoint(const std::string& src, const std::string& dst_run_dir, const CheckpointLayout& to);

}  // namespace lathe
