// Fuzz target: safetensors reader (io::SafetensorsFile) on arbitrary file bytes. Every tensor the
// header validates is read back (read_f32 for float dtypes, data() for the others), so a header
// that passes validation but points outside the mapping is an ASan finding.
#include <cstdint>
#include <vector>

#include "fuzz_target.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lathe::fuzz::TempFile file(data, size, ".safetensors");
  lathe::fuzz::expect_clean([&] {
    lathe::io::SafetensorsFile st(file.path());
    std::vector<float> buf;
    for (const auto& t : st.tensors()) {
      if (st.find(t.name) != &t) std::abort();  // the index must agree with the table
      if (!t.dtype_supported) continue;
      const int64_t n = lathe::numel(t.shape);
      // The header was checked against the file size, so n is bounded by the input; cap anyway.
      if (n < 0 || n > (1 << 20)) std::abort();
      const auto* p = static_cast<const unsigned char*>(st.data(t));
      volatile unsigned char sink = 0;
      for (size_t i = 0; i < t.nbytes; ++i) sink = sink ^ p[i];
      if (t.dtype == lathe::DType::F32 || t.dtype == lathe::DType::BF16 || t.dtype == lathe::DType::F16) {
        buf.resize(static_cast<size_t>(n));
        st.read_f32(t, buf.data());
      }
    }
  });
  return 0;
}
