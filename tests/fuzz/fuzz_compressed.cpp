// Fuzz target: the gzip and zstd readers of lathe tokenize. Byte 0 picks the format (even: .gz,
// odd: .zst), byte 1 the read size (1 .. 256 KB, so that the decoders see full output buffers at
// every position); the rest is the file, read to the end through open_byte_source and then through
// RecordReader as JSONL. A truncated or corrupt stream must be a lathe::Error; decompressed output
// is capped at 16 MB per input (a decompression bomb is not a parser bug), and RecordReader runs
// only on streams that decompressed completely to at most 4 MB.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "tokenizer/corpus.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const bool gzip = (data[0] & 1) == 0;
  const size_t step = data[1] < 128 ? 1 + data[1] : size_t{1} << (10 + (data[1] & 7));
  lathe::fuzz::TempFile file(data + 2, size - 2, gzip ? ".jsonl.gz" : ".jsonl.zst");
  constexpr size_t kCap = 16u << 20;
  size_t total = 0;
  bool complete = false;
  lathe::fuzz::expect_clean([&] {
    auto src = lathe::tok::open_byte_source(file.path());
    std::vector<char> buf(step);
    while (total < kCap) {
      const size_t got = src->read(buf.data(), buf.size());
      if (got > buf.size()) std::abort();
      if (got == 0) {
        complete = true;
        break;
      }
      total += got;
    }
  });
  // RecordReader keeps a whole line in memory (by design): only streams known to be small.
  if (!complete || total > (4u << 20)) return 0;
  lathe::fuzz::expect_clean([&] {
    lathe::tok::RecordReader rr({file.path()}, {});
    lathe::tok::InputChunk c;
    size_t seen = 0;
    while (rr.next_chunk(c, 4096)) {
      seen += c.data.size();
      if (seen > total) std::abort();  // the same bytes as the first pass
      std::string out, detail;
      lathe::tok::SkipReason why;
      int n = 0;
      lathe::tok::for_each_line(c, [&](std::string_view line, uint64_t) {
        if (++n <= 8) lathe::tok::extract_json_text(line, "text", out, why, detail);
      });
    }
  });
  return 0;
}
