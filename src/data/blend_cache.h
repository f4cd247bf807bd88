// A run's blend (recipe data.blend) opened and planned, with the plan cached on disk next to the
// output (issue 11): OUTPUT/data_cache/blend-<inputs hash>.bin is built once, reused on resume and
// by `lathe data blend-plan`, and rebuilt when any input changes. The inputs hash (XXH64) covers the
// plan algorithm's version, every prefix (absolute path, .idx and .bin sizes and mtimes in ns), the
// weights, epoch caps, samples per dataset, seq_len, the seed and the run's total samples; a prefix
// rewritten in place changes its mtime, so the cache is rebuilt. The file also stores the hash, and
// ends with an XXH64 of its bytes: a cache that is truncated, corrupt, for other inputs or whose
// entries are out of range is never used; it is rebuilt with a notice. Writes are atomic (tmp +
// fsync + rename), so readers on other ranks see the old file, no file or the whole new one.
//
// File layout (little-endian): "LATHEBLD" | u64 format version (1) | u64 inputs hash | u64 datasets D
// | u64 samples N | i64 taken[D] | u32 dataset[N] | i64 sample[N] | u64 XXH64 of all bytes before.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/blend.h"
#include "data/indexed_dataset.h"

namespace lathe::data {

struct BlendEntryInput {
  std::string prefix;
  double weight = 0;
  double epochs = 0;  // cap on passes; 0 = none
};

struct OpenedBlend {
  std::vector<std::shared_ptr<const IndexedDataset>> datasets;
  std::vector<BlendSource> sources;  // name = prefix, samples = num_samples(tokens, seq_len)
};

// Opens every prefix. Errors name the entry ("data.blend[2] (data/code): ..."): a missing or
// malformed prefix, a dataset with fewer than seq_len + 2 tokens (no sample), a token dtype that
// differs from entry 0's (a blend mixes datasets of one tokenizer: one dtype), two entries naming
// one dataset (data/a, ./data/a, data//a or a link to it: its samples would repeat; both named).
OpenedBlend open_blend(const std::vector<BlendEntryInput>& entries, int64_t seq_len);

// XXH64 of the plan's inputs (see the header comment).
uint64_t blend_inputs_hash(const std::vector<BlendSource>& sources, int64_t seq_len, uint64_t seed, int64_t total);

struct CachedPlan {
  std::shared_ptr<const BlendPlan> plan;
  std::string path;    // the cache file ("" when cache_dir is "")
  std::string status;  // "reused", "built", "rebuilt (WHY)", "built in memory (WHY not written)"
  double seconds = 0;  // planning or loading time
};

// The plan of `total` samples, from cache_dir/blend-HASH.bin when that file is valid for these
// inputs; otherwise planned (plan_blend, polling `stop`) and, when `write`, saved there (the
// directory created; written as blend-HASH.bin.PID.tmp and renamed). With `write`, the directory is
// also cleaned: other blend-*.bin files (plans of earlier inputs) and the temporary files of
// writers that died (their PID in the name is no live process; a SIGKILL mid-write leaves one).
// cache_dir "" = no cache. Refused, whether or not `write`, naming the path: a cache path that is a
// directory (the rename would fail after planning), a cache_dir that is a file.
CachedPlan cached_blend_plan(const std::vector<BlendSource>& sources, int64_t seq_len, uint64_t seed, int64_t total,
                             const std::string& cache_dir, bool write, const StopFn& stop = nullptr);

// Removes the stale files of cache_dir named in cached_blend_plan (`keep`: the file name in use).
// Returns how many were removed. Exposed for tests.
int remove_stale_blend_files(const std::string& cache_dir, const std::string& keep);

// The cache file of these inputs in cache_dir.
std::string blend_cache_path(const std::string& cache_dir, uint64_t inputs_hash);

// Reads a cache file; nullptr with *why set when it is missing, truncated, corrupt, for other inputs
// or out of range for `sources`. Exposed for tests.
std::shared_ptr<BlendPlan> read_blend_cache(const std::string& path, uint64_t inputs_hash,
                                            const std::vector<BlendSource>& sources, int64_t total, std::string* why);
void write_blend_cache(const std::string& path, uint64_t inputs_hash, const BlendPlan& plan);

// Samples taken from each dataset by the first `position` samples of the plan (the data position a
// checkpoint records for a blend).
std::vector<int64_t> blend_taken_before(const BlendPlan& plan, int64_t position);
// XXH64 of the plan's first `position` entries (dataset and sample of each): equal for two plans
// exactly when they hand out the same samples up to there (checkpoints record it).
uint64_t blend_prefix_hash(const BlendPlan& plan, int64_t position);

}  // namespace lathe::data
