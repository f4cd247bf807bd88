// Fuzz target: the text of a checkpoint's state.json -> parse_checkpoint_state
// (depth check, envelope, checksum, every field by type and range;
// train/checkpoint_state.cpp). The checksum would stop almost every mutation at
// the door, so the target also reseals the input: when it parses as {"body":
// ..., "body_xxh64": ...} (depth-checked first), body_xxh64 is replaced with
// the body's real checksum and the resealed text is parsed again, which lets
// the fuzzer reach the field validation behind the checksum. Seeds: state.json
// of real tiny checkpoints.
#include "fuzz_target.h"
#include "io/json.h"
#include "train/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const std::string_view text = lathe::fuzz::as_text(data, size);
  lathe::fuzz::expect_clean(
      [&] { lathe::parse_checkpoint_state(text, "fuzz/state.json"); });
  lathe::fuzz::expect_clean([&] {
    nlohmann::json doc =
        lathe::io::parse_json(text, "fuzz/state.json"); // depth-checked
    if (!doc.is_object() || !doc.contains("body"))
      return;
    const std::string body = doc["body"].dump(
        -1, ' ', false, nlohmann::json::error_handler_t::replace);
    doc["body_xxh64"] =
        lathe::hex64(lathe::Xxh64::hash(body.data(), body.size()));
    lathe::parse_checkpoint_state(
        doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
        "fuzz/state.json");
  });
  return 0;
}
