// io::DirectWriter: what lands on disk is exactly what was written, and commit() reports its length
// and XXH64, whichever path each piece takes (staged through the aligned buffers, written straight
// from the caller's memory when address and file offset share their page offset, the padded tail),
// on a disk filesystem (O_DIRECT) and on /dev/shm (tmpfs refuses O_DIRECT: the buffered fallback).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/direct_writer.h"
#include "io/fs.h"
#include "io/xxh64.h"

using namespace lathe;
using namespace lathe::io;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> roots() {
  std::vector<std::string> r = {(fs::temp_directory_path() / ("lathe_dw_test_" + std::to_string(::getpid()))).string()};
  if (fs::is_directory("/dev/shm")) r.push_back("/dev/shm/lathe_dw_test_" + std::to_string(::getpid()));
  for (const auto& d : r) fs::create_directories(d);
  return r;
}

// A page-aligned source buffer with a byte pattern that differs at every position mod 251.
struct Source {
  explicit Source(size_t n) : n(n) {
    p = static_cast<unsigned char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>((i * 7 + i / 251) % 251);
  }
  ~Source() { std::free(p); }
  unsigned char* p;
  size_t n;
};

}  // namespace

// Pieces of odd sizes: < 1 page, unaligned, stretches > 1 MB whose address agrees with the file
// position mod 4096 (zero-copy) or not (staged), more than one 16 MB staging buffer, ending mid-page.
TEST(DirectWriter, HashAndBytesMatchAtOddSizes) {
  Source src(48u << 20);
  // {source offset, length}. The file position after the pieces before is their length sum.
  const std::pair<size_t, size_t> pieces[] = {{0, 1},
                                              {1, 4095},
                                              {4096, 4097},
                                              {8193, 3},
                                              {8196, (2u << 20) + 17},  // zero-copy
                                              {100, 7},
                                              {(2u << 20) + 133, (17u << 20) + 4096 * 3 + 5},  // staged
                                              {0, 0},
                                              {5, (3u << 20) + 1},  // staged
                                              {(25u << 20) + 4096 - 1, (20u << 20) + 12345}};
  for (const std::string& dir : roots()) {
    const std::string path = dir + "/odd.bin";
    std::string expect;
    DirectWriter w(path);
    for (const auto& [off, n] : pieces) {
      ASSERT_LE(off + n, src.n);
      w.write(src.p + off, n);
      expect.append(reinterpret_cast<const char*>(src.p + off), n);
      EXPECT_EQ(w.position(), expect.size());
    }
    const WrittenFile f = w.commit();
    EXPECT_EQ(f.bytes, expect.size()) << path;
    EXPECT_EQ(f.xxh64, Xxh64::hash(expect.data(), expect.size())) << path;
    EXPECT_TRUE(read_file(path) == expect) << path;
  }
  for (const std::string& dir : roots()) fs::remove_all(dir);
}

TEST(DirectWriter, SmallAndEmptyFiles) {
  for (const std::string& dir : roots()) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, size_t{4097}}) {
      const std::string path = dir + "/small.bin";
      Source src(n ? n : 1);
      DirectWriter w(path);
      w.write(src.p, n);
      const WrittenFile f = w.commit();
      EXPECT_EQ(f.bytes, n);
      EXPECT_EQ(f.xxh64, Xxh64::hash(src.p, n));
      EXPECT_EQ(fs::file_size(path), n) << path;  // the padded tail is truncated away
    }
    fs::remove_all(dir);
  }
}

// Unwound before commit(): the partial file is removed (a checkpoint's tmp dir holds no torn file).
TEST(DirectWriter, NoCommitRemovesTheFile) {
  for (const std::string& dir : roots()) {
    const std::string path = dir + "/partial.bin";
    {
      Source src(20u << 20);
      DirectWriter w(path);
      w.write(src.p, src.n);
      EXPECT_TRUE(fs::exists(path));
    }
    EXPECT_FALSE(fs::exists(path)) << path;
    fs::remove_all(dir);
  }
}

TEST(DirectWriter, UncreatableFileIsNamed) {
  const std::string path = "/nonexistent_lathe_dir/x.bin";
  try {
    DirectWriter w(path);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": cannot create"), std::string::npos) << e.what();
  }
}
