// Fuzz target: Megatron .idx parser (data::IndexedDataset) on arbitrary .idx bytes beside a fixed
// 256-byte .bin (bytes 0..255: 256 uint8, 128 uint16, 64 int32 or 32 int64 tokens). Whatever the
// constructor accepts is read back: every sequence, a global window and max_token_id().
#include <cstdint>
#include <vector>

#include "data/indexed_dataset.h"
#include "fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<uint8_t> bin = [] {
    std::vector<uint8_t> b(256);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i * 7 + 3);
    return b;
  }();
  lathe::fuzz::TempFile idx(data, size, ".idx");
  lathe::fuzz::TempFile binf(bin.data(), bin.size(), ".bin");
  const std::string prefix = idx.path().substr(0, idx.path().size() - 4);
  lathe::fuzz::expect_clean([&] {
    lathe::data::IndexedDataset ds(prefix);
    const int64_t total = ds.total_tokens();
    if (total < 0 || total > 256) std::abort();  // validated against the .bin size
    std::vector<int32_t> out(static_cast<size_t>(total) + 1);
    int64_t sum = 0;
    for (size_t i = 0; i < ds.num_sequences() && i < 4096; ++i) {
      const int64_t len = ds.sequence_length(i), off = ds.sequence_offset(i);
      if (len < 0 || off < 0 || off + len > total) std::abort();
      ds.read_sequence(i, out.data());
      sum += len;
    }
    if (ds.num_sequences() <= 4096 && sum != total) std::abort();
    if (total > 0) ds.read_global(total / 3, total - total / 3, out.data());
    ds.max_token_id();
  });
  return 0;
}
