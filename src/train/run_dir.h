// The run directory (output.dir) at the start of `lathe train`: never silently reused, and what a
// resume does to the checkpoints of a timeline it abandons. Internal to src/train (train/session.cpp).
//
// A run directory "holds a run" when it contains what a training run leaves behind: metrics.jsonl,
// anomalies.jsonl, a non-empty checkpoints/, model/, trace/ or a step_XXXXXXXX HF directory
// (output.save_every). recipe.yaml and run_info.json alone (a run that failed before its first
// step) and data_cache/ (content-addressed, shared by runs) do not count, nor do unrelated files.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config/recipe.h"
#include "dist/comm.h"
#include "optim/loss_scaler.h"
#include "train/checkpoint.h"

namespace lathe {

// The entries of `dir` that make it a run ("metrics.jsonl", "checkpoints/ (3 entries)", ...);
// empty when it holds none (or does not exist).
std::vector<std::string> run_entries(const std::string& dir);

// Whether `resume` (--resume or training.resume: "auto" or a checkpoint directory) continues the
// run of output.dir `out_dir` (auto, or a checkpoint inside OUT_DIR/checkpoints).
bool resume_continues_dir(const std::string& resume, const std::string& out_dir);

// Why a run with this resume setting may not start in output.dir without --overwrite ("" when it
// may): the directory holds a run that this one does not continue. No side effects (for `lathe
// check` too).
std::string run_dir_refusal(const Recipe& r, const std::string& resume);

// The check before any work of a training run (collective over `world`: rank 0 looks and acts,
// every rank ends with the same message). A run that does not continue output.dir's run (no
// resume, or a resume from a checkpoint elsewhere) into a directory that holds a run is refused,
// naming the directory, what it holds and the ways forward; with `overwrite` the old run directory
// is moved aside to OUTPUT.DIR.replaced-N (the first free N) and the new run starts in an empty one
// but for the old data_cache/ (`say` tells where the old run went). Nothing is deleted. `overwrite` with a resume of
// output.dir's own run is a contradiction and refused.
void claim_run_dir(const Recipe& r, const std::string& resume, bool overwrite, dist::Communicator& world,
                   const std::function<void(const std::string&)>& say);

// After resuming from `ckpt` at `step`: the checkpoints of RUN_DIR newer than it (an abandoned
// timeline: corrupt ones that auto skipped, or a deliberate resume from an older step) are moved
// aside to step_X.abandoned-<unix time>, so that a later --resume auto cannot pick them and keep_last
// does not count them. Rank 0 only.
void move_newer_checkpoints_aside(const std::string& run_dir, const std::string& ckpt, int64_t step,
                                  const std::function<void(const std::string&)>& say);

// The loss-scaler state a resume continues from checkpoint `ckpt` (state `cs`): the checkpoint's
// scale when both runs scale dynamically. A scale below precision.loss_scale.min (`min`) is an
// edited or damaged field when the checkpoint's own recipe had that minimum (refused, naming the
// field, as the state.json checks do); when the recipe raised the minimum since, the scale starts
// at the new minimum (said).
optim::LossScalerState resume_loss_scale(const CheckpointState& cs, const std::string& ckpt, double current_scale,
                                         bool dynamic, double min, const std::function<void(const std::string&)>& say);

}  // namespace lathe
