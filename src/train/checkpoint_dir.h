// RUN_DIR/checkpoints/ as a directory (layout in checkpoint.h): the step_XXXXXXXX names, and the
// housekeeping around the save protocol of checkpoint.cpp: leftovers of interrupted saves, a
// same-step checkpoint moved aside, keep_last with removal on a background thread. The public
// entry points (list_checkpoints, find_latest_checkpoint, wait_for_checkpoint_cleanup) are
// declared in checkpoint.h and defined in checkpoint_dir.cpp. Internal to src/train.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

namespace lathe::ckpt_dir {

// "step_00000120" for step 120 (8 digits).
std::string step_name(int64_t step);
// "step_00000120" -> 120; -1 for anything else (tmp dirs, `latest`, stray files).
int64_t parse_step_name(const std::string& name);
// True for names ending in ".tmp": a checkpoint being written, or one being deleted.
bool is_tmp_name(const std::string& name);

// Before a save (rank 0): creates `root`, joins the previous save's background removals (they
// touch the same directory) and removes every *.tmp leftover of interrupted saves (ours or a
// killed process's); they are never complete checkpoints.
void prepare_root(const std::filesystem::path& root);

// When root/name exists (another timeline's checkpoint of the same step), renames it to
// name.abandoned-<unix time>[-N] and returns that path; "" when nothing is there. Never deletes:
// no .tmp suffix, so no later save's cleanup removes it, and no step name, so no resume picks it.
std::string move_aside(const std::filesystem::path& root, const std::string& name);

// keep_last > 0: of the checkpoints of run_dir before `step`, all but the newest keep_last - 1 are
// renamed to *.deleting.tmp at once and removed by a background thread (wait_for_checkpoint_cleanup).
// protect_healthy: the newest of them whose state.json records it healthy is kept beyond keep_last
// (the anomaly rollback target while the new checkpoint is not healthy).
void prune(const std::string& run_dir, int64_t step, int keep_last, bool protect_healthy);

}  // namespace lathe::ckpt_dir
