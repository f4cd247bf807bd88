// TensorBoard event files (output.tensorboard: true): OUTPUT/tensorboard/events.out.tfevents.*,
// TFRecord framing (io/tfrecord.h) of hand-encoded tensorflow.Event protobuf messages. Each training
// session (a fresh start or a resume) writes a new file:
//   * the file_version event "brain.Event:2";
//   * on a resume, a SessionLog START event at the first new step: TensorBoard's reader drops the
//     earlier files' events at or after it (steps a crashed or abandoned session wrote past the
//     checkpoint), so each tag's steps stay increasing and equal metrics.jsonl's;
//   * the resolved recipe as a text summary (tag "recipe", the text plugin's string tensor) at the
//     session's first step;
//   * every numeric field of each metrics.jsonl record as a scalar (simple_value), tag
//     "GROUP/FIELD": train/loss, train/lr, ..., val/val_loss, tasks/tasks_acc, checkpoint/checkpoint_s,
//     run/peak_rss_mb_max_rank (the end record). Booleans and strings are not scalars; a non-finite
//     value (null in metrics.jsonl) is written as the NaN or Inf it was.
// Written by rank 0 only (train/run_log.h).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "io/tfrecord.h"

namespace lathe {

namespace tensorboard {
// The encoded messages (tests decode them with TensorBoard's reader).
std::string file_version_event(double wall_time);
std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
std::string text_event(double wall_time, int64_t step, const std::string& tag, const std::string& text);
std::string session_start_event(double wall_time, int64_t step);
}  // namespace tensorboard

class TensorBoardWriter {
 public:
  // A new event file under `dir` (created); `start_step` > 0 on a resume.
  TensorBoardWriter(const std::string& dir, int64_t start_step, const std::string& recipe_yaml);
  // The numeric fields of a metrics.jsonl record (its "step" is the event's step) as GROUP/FIELD scalars.
  void record(const char* group, const nlohmann::json& j);
  // After an anomaly rollback to `step`: the curves continue from there (a SessionLog START).
  void restart_at(int64_t step);
  const std::string& path() const { return w_->path(); }

 private:
  std::unique_ptr<io::TfRecordWriter> w_;
};

}  // namespace lathe
