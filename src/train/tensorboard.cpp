#include "train/tensorboard.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>

namespace lathe {

namespace {

double now_wall() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

// The protobuf wire format, as much as the Event message needs.
struct Pb {
  std::string s;
  void varint(uint64_t v) {
    while (v >= 0x80) {
      s.push_back(static_cast<char>((v & 0x7F) | 0x80));
      v >>= 7;
    }
    s.push_back(static_cast<char>(v));
  }
  void key(int field, int wire) { varint(static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire)); }
  Pb& u64(int field, uint64_t v) {  // int64 / enum / bool
    key(field, 0);
    varint(v);
    return *this;
  }
  Pb& f64(int field, double v) {
    key(field, 1);
    char b[8];
    std::memcpy(b, &v, 8);  // little-endian hosts (x86-64, aarch64)
    s.append(b, 8);
    return *this;
  }
  Pb& f32(int field, float v) {
    key(field, 5);
    char b[4];
    std::memcpy(b, &v, 4);
    s.append(b, 4);
    return *this;
  }
  Pb& bytes(int field, const std::string& v) {  // string, bytes, embedded message
    key(field, 2);
    varint(v.size());
    s += v;
    return *this;
  }
};

// tensorflow.Event: wall_time 1, step 2, file_version 3, summary 5, session_log 7.
Pb event(double wall_time, int64_t step) {
  Pb e;
  e.f64(1, wall_time);
  if (step != 0) e.u64(2, static_cast<uint64_t>(step));
  return e;
}

}  // namespace

namespace tensorboard {

std::string file_version_event(double wall_time) { return event(wall_time, 0).bytes(3, "brain.Event:2").s; }

std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  // Summary.value 1 -> Summary.Value: tag 1, simple_value 2.
  const std::string v = Pb{}.bytes(1, tag).f32(2, value).s;
  return event(wall_time, step).bytes(5, Pb{}.bytes(1, v).s).s;
}

std::string text_event(double wall_time, int64_t step, const std::string& tag, const std::string& text) {
  // Summary.Value: tag 1, metadata 9 (SummaryMetadata.plugin_data 1 -> PluginData.plugin_name 1 "text"),
  // tensor 8 (TensorProto: dtype 1 = DT_STRING 7, tensor_shape 2 = a scalar (no dims), string_val 8).
  const std::string metadata = Pb{}.bytes(1, Pb{}.bytes(1, "text").s).s;
  const std::string tensor = Pb{}.u64(1, 7).bytes(2, "").bytes(8, text).s;
  const std::string value = Pb{}.bytes(1, tag).bytes(8, tensor).bytes(9, metadata).s;
  return event(wall_time, step).bytes(5, Pb{}.bytes(1, value).s).s;
}

std::string session_start_event(double wall_time, int64_t step) {
  // SessionLog: status 1 = START (1).
  return event(wall_time, step).bytes(7, Pb{}.u64(1, 1).s).s;
}

}  // namespace tensorboard

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t start_step, const std::string& recipe_yaml) {
  std::filesystem::create_directories(dir);
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const double t = now_wall();
  // TensorBoard reads a directory's files in name order: the time, then the session's first step
  // (two sessions in one second still sort in order).
  w_ = std::make_unique<io::TfRecordWriter>(
      (std::filesystem::path(dir) /
       fmt::format("events.out.tfevents.{:010d}.{}.step{:010d}", static_cast<int64_t>(t), host, start_step))
          .string());
  w_->write(tensorboard::file_version_event(t));
  if (start_step > 0) restart_at(start_step);
  // Fenced: the text plugin renders Markdown, which would fold the YAML's indentation.
  w_->write(tensorboard::text_event(t, start_step, "recipe", "```yaml\n" + recipe_yaml + "```"));
}

void TensorBoardWriter::restart_at(int64_t step) { w_->write(tensorboard::session_start_event(now_wall(), step + 1)); }

void TensorBoardWriter::record(const char* group, const nlohmann::json& j) {
  const int64_t step = j.value("step", int64_t{0});
  const double t = now_wall();
  for (const auto& [field, v] : j.items()) {
    if (field == "step" || !v.is_number()) continue;
    w_->write(tensorboard::scalar_event(t, step, fmt::format("{}/{}", group, field), v.get<float>()));
  }
}

}  // namespace lathe
