// io/tfrecord.h: CRC32C (Castagnoli) against published check values (RFC 3720 B.4, the iSCSI
// test vectors), TensorFlow's mask, and the record framing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "io/tfrecord.h"

using namespace lathe::io;

namespace {
uint32_t le32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = v << 8 | static_cast<unsigned char>(s[at + i]);
  return v;
}
}  // namespace

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  std::vector<unsigned char> b(32, 0);
  EXPECT_EQ(crc32c(b.data(), b.size()), 0x8A9136AAu);
  std::fill(b.begin(), b.end(), 0xFF);
  EXPECT_EQ(crc32c(b.data(), b.size()), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) b[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(crc32c(b.data(), b.size()), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) b[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(crc32c(b.data(), b.size()), 0x113FDB5Cu);
  EXPECT_EQ(crc32c("", 0), 0u);
}

TEST(Crc32c, Streaming) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c(s + 4, 5, crc32c(s, 4)), 0xE3069283u);
}

TEST(Crc32c, Mask) {
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TfRecord, Framing) {
  const std::string data = "hello, events";
  const std::string r = tfrecord_frame(data);
  ASSERT_EQ(r.size(), 8 + 4 + data.size() + 4);
  EXPECT_EQ(static_cast<unsigned char>(r[0]), data.size());
  for (int i = 1; i < 8; ++i) EXPECT_EQ(r[i], 0);
  EXPECT_EQ(le32(r, 8), masked_crc32c(r.data(), 8));
  EXPECT_EQ(r.substr(12, data.size()), data);
  EXPECT_EQ(le32(r, 12 + data.size()), masked_crc32c(data.data(), data.size()));
  EXPECT_EQ(tfrecord_frame("").size(), 16u);
}

TEST(TfRecord, WriterAppendsFramedRecords) {
  const auto path =
      std::filesystem::temp_directory_path() / ("lathe_test_tfrecord_" + std::to_string(::getpid()) + ".bin");
  {
    TfRecordWriter w(path.string());
    w.write("a");
    w.write("bc");
  }
  std::ifstream f(path, std::ios::binary);
  const std::string got((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(got, tfrecord_frame("a") + tfrecord_frame("bc"));
  std::filesystem::remove(path);
}

TEST(TfRecord, UnwritableDirectoryNamesThePath) {
  try {
    TfRecordWriter w("/nonexistent-dir-lathe/events");
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir-lathe/events"), std::string::npos);
  }
}
