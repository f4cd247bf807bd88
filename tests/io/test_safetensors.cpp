// safetensors reader/writer: round trips, byte layout against the spec's worked example, and every
// malformed-file class the reference reader rejects. The StPyBridge tests exchange files with the
// independent numpy implementation in test_safetensors_py.py (they skip unless it drives them).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/fs.h"
#include "io/safetensors.h"
#include "io/xxh64.h"

using namespace lathe;
using namespace lathe::io;
namespace fs = std::filesystem;

namespace {

std::string tmpdir() {
  static std::string d = [] {
    auto p = fs::temp_directory_path() / ("lathe_st_test_" + std::to_string(::getpid()));
    fs::create_directories(p);
    return p.string();
  }();
  return d;
}

std::string bytes_of(const std::string& path) { return read_file(path); }

void put_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Raw file from a header text and a data section (no padding added: the reader must not need it).
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// Expect construction to fail with a message containing every given substring.
void expect_open_error(const std::string& path, std::vector<std::string> subs) {
  try {
    SafetensorsFile f(path);
    FAIL() << "no error for " << path;
  } catch (const Error& e) {
    std::string m = e.what();
    for (auto& s : subs) EXPECT_NE(m.find(s), std::string::npos) << "message: " << m << "\nmissing: " << s;
  }
}

std::vector<float> pattern(size_t n, float scale) {
  std::vector<float> v(n);
  // Exactly representable in fp32 (so python can recompute them bit-exactly) but with more
  // mantissa bits than bf16/f16 keep, so the rounding paths are exercised.
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>((static_cast<int>(i * 37 % 101) - 50)) * scale / 64.0f + scale / 4096.0f;
  return v;
}

}  // namespace

TEST(Safetensors, RoundTripF32Bf16F16) {
  auto a = pattern(2 * 3 * 5, 3.0f);
  auto b = pattern(7, 100.0f);
  std::vector<float> empty;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    std::string path = tmpdir() + "/rt_" + std::string(dtype_name(dt)) + ".safetensors";
    write_safetensors_f32(path, {{"layer.a", {2, 3, 5}, a.data()}, {"b", {7}, b.data()}, {"e", {0, 4}, empty.data()}},
                          dt, {{"note", "hello \"q\""}});
    SafetensorsFile f(path);
    ASSERT_EQ(f.tensors().size(), 3u);
    EXPECT_EQ(f.tensors()[0].name, "layer.a");  // given order is kept
    EXPECT_EQ(f.tensors()[1].name, "b");
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ(f.metadata().at("note"), "hello \"q\"");
    const StTensorInfo* ta = f.find("layer.a");
    ASSERT_NE(ta, nullptr);
    EXPECT_EQ(ta->dtype, dt);
    EXPECT_EQ(ta->shape, (Shape{2, 3, 5}));
    EXPECT_EQ(ta->nbytes, 30 * dtype_size(dt));
    EXPECT_EQ(f.find("nope"), nullptr);
    const StTensorInfo* te = f.find("e");
    EXPECT_EQ(te->nbytes, 0u);
    EXPECT_EQ(te->shape, (Shape{0, 4}));
    for (auto [info, src] : {std::pair{ta, &a}, std::pair{f.find("b"), &b}}) {
      std::vector<float> got(src->size());
      f.read_f32(*info, got.data());
      for (size_t i = 0; i < got.size(); ++i) {
        // Reference conversion: the scalar helpers of core/dtype.h (independently checked in core).
        float want = dt == DType::F32    ? (*src)[i]
                     : dt == DType::BF16 ? bf16_to_fp32(fp32_to_bf16((*src)[i]))
                                         : fp16_to_fp32(fp32_to_fp16((*src)[i]));
        EXPECT_EQ(got[i], want) << info->name << "[" << i << "]";
      }
    }
    // Data section starts 8-aligned thanks to the space padding.
    EXPECT_EQ(f.header_size() % 8, 0u);
  }
}

TEST(Safetensors, RoundTripRawDtypes) {
  std::vector<int64_t> ids = {1, -2, 1LL << 40};
  std::vector<int32_t> i32 = {7, -7};
  std::vector<uint8_t> u8 = {0, 255, 3};
  std::string path = tmpdir() + "/raw.safetensors";
  write_safetensors(path, {{"ids", DType::I64, {3}, ids.data()},
                           {"i32", DType::I32, {1, 2}, i32.data()},
                           {"u8", DType::U8, {3}, u8.data()},
                           {"scalar", DType::I32, {}, i32.data()}});
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(std::memcmp(f.data(*f.find("ids")), ids.data(), 24), 0);
  EXPECT_EQ(std::memcmp(f.data(*f.find("u8")), u8.data(), 3), 0);
  EXPECT_EQ(f.find("scalar")->shape, Shape{});
  EXPECT_EQ(f.find("scalar")->nbytes, 4u);
  std::vector<float> out(3);
  try {
    f.read_f32(*f.find("ids"), out.data());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'ids'"), std::string::npos) << e.what();
  }
}

// Byte layout from the spec's worked example (tensor "attn0", F32 [1,1,2,3], values 0..5): the
// header text is the reference one plus our mandatory "format":"pt" metadata.
TEST(Safetensors, HeaderBytesMatchSpec) {
  std::vector<float> v = {0, 1, 2, 3, 4, 5};
  std::string path = tmpdir() + "/spec.safetensors";
  write_safetensors(path, {{"attn0", DType::F32, {1, 1, 2, 3}, v.data()}});
  std::string got = bytes_of(path);
  std::string hdr =
      R"({"__metadata__":{"format":"pt"},"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
  while (hdr.size() % 8) hdr += ' ';
  std::string data = std::string(
      "\x00\x00\x00\x00\x00\x00\x80\x3F\x00\x00\x00\x40\x00\x00\x40\x40\x00\x00\x80\x40\x00\x00\xA0\x40", 24);
  EXPECT_EQ(got, raw_file(hdr, data));
  EXPECT_EQ(got.size(), 8 + hdr.size() + 24);
  EXPECT_EQ(static_cast<unsigned char>(got[0]), hdr.size());
  // Reading the reference example without metadata and without padding also works.
  std::string ref = R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
  put_file(path, raw_file(ref, data));
  SafetensorsFile f(path);
  std::vector<float> out(6);
  f.read_f32(f.tensors()[0], out.data());
  EXPECT_EQ(out, v);
  EXPECT_TRUE(f.metadata().empty());
  // Whitespace around the object is accepted (reference reader tests).
  put_file(path, raw_file("  " + ref + "\n  ", data));
  EXPECT_NO_THROW(SafetensorsFile{path});
}

TEST(Safetensors, EmptyFile) {
  std::string path = tmpdir() + "/empty.safetensors";
  write_safetensors(path, {});
  SafetensorsFile f(path);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.file_size(), 8 + f.header_size());
}

TEST(Safetensors, MalformedFiles) {
  std::string p = tmpdir() + "/bad.safetensors";
  std::string d12(12, '\x01');
  auto hdr2 = [](const std::string& a_off, const std::string& b_off, const std::string& dt = "F32") {
    return R"({"a":{"dtype":")" + dt + R"(","shape":[2],"data_offsets":)" + a_off +
           R"(},"b":{"dtype":"F32","shape":[1],"data_offsets":)" + b_off + "}}";
  };
  put_file(p, "abc");
  expect_open_error(p, {p, "shorter than"});
  // Header length beyond the file.
  put_file(p, raw_file(hdr2("[0,8]", "[8,12]"), d12).substr(0, 20));
  expect_open_error(p, {p, "header length"});
  // Truncated data: the last tensor runs past the end.
  put_file(p, raw_file(hdr2("[0,8]", "[8,12]"), d12.substr(0, 10)));
  expect_open_error(p, {p, "'b'", "truncated"});
  // Trailing bytes.
  put_file(p, raw_file(hdr2("[0,8]", "[8,12]"), d12 + "xx"));
  expect_open_error(p, {p, "trailing"});
  // Overlap.
  put_file(p, raw_file(hdr2("[0,8]", "[4,8]"), d12));
  expect_open_error(p, {p, "'b'", "overlap"});
  // Gap.
  put_file(p, raw_file(hdr2("[0,8]", "[10,14]"), d12 + "xx"));
  expect_open_error(p, {p, "'b'", "gap"});
  // Out of range offsets.
  put_file(p, raw_file(hdr2("[0,8]", "[8,1000000000000]"), d12));
  expect_open_error(p, {p, "'b'"});
  // Size mismatch between offsets and dtype/shape.
  put_file(p, raw_file(hdr2("[0,4]", "[4,8]"), std::string(8, '\0')));
  expect_open_error(p, {p, "'a'", "needs 8"});
  // Bad dtype.
  put_file(p, raw_file(hdr2("[0,8]", "[8,12]", "F33"), d12));
  expect_open_error(p, {p, "'a'", "F33"});
  // Duplicate key.
  put_file(
      p,
      raw_file(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          std::string(8, '\0')));
  expect_open_error(p, {p, "'a'", "more than once"});
  // Non-string metadata.
  put_file(p, raw_file(R"({"__metadata__":{"n":1}})", ""));
  expect_open_error(p, {p, "__metadata__"});
  // Extra per-tensor key.
  put_file(p, raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", std::string(4, '\0')));
  expect_open_error(p, {p, "'a'"});
  // Negative dim.
  put_file(p, raw_file(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, '\0')));
  expect_open_error(p, {p, "'a'", "non-negative"});
  // Not JSON.
  put_file(p, raw_file("{nope", ""));
  expect_open_error(p, {p, "JSON"});
  // Huge header length.
  std::string big(16, '\0');
  big[4] = 0x7f;
  put_file(p, big);
  expect_open_error(p, {p, "100 MB"});
  // Missing file.
  expect_open_error(tmpdir() + "/missing.safetensors", {"missing.safetensors"});
}

// A spec-valid dtype lathe cannot represent is listed but refused on access.
TEST(Safetensors, UnsupportedDtypeListedButRefused) {
  std::string p = tmpdir() + "/bool.safetensors";
  put_file(p,
           raw_file(R"({"mask":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", std::string("\x01\x00\x01", 3)));
  SafetensorsFile f(p);
  ASSERT_EQ(f.tensors().size(), 1u);
  EXPECT_FALSE(f.tensors()[0].dtype_supported);
  EXPECT_EQ(f.tensors()[0].dtype_code, "BOOL");
  try {
    f.data(f.tensors()[0]);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'mask'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("BOOL"), std::string::npos);
  }
}

TEST(Safetensors, WriterRejectsBadInput) {
  float x = 1;
  std::string p = tmpdir() + "/w.safetensors";
  EXPECT_THROW(write_safetensors_f32(p, {{"a", {1}, &x}, {"a", {1}, &x}}), Error);
  EXPECT_THROW(write_safetensors_f32(p, {{"__metadata__", {1}, &x}}), Error);
  EXPECT_THROW(write_safetensors_f32(p, {{"a", {1}, &x}}, DType::I32), Error);
  EXPECT_FALSE(fs::exists(p));
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  EXPECT_THROW(write_safetensors_f32(tmpdir() + "/no/such/dir/x.safetensors", {{"a", {1}, &x}}), Error);
}

// Issue 14: headers a hostile writer can produce. Each case crashed, hung or loaded silently before.
TEST(Safetensors, HostileHeaders) {
  std::string p = tmpdir() + "/hostile.safetensors";
  const std::string one = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  const std::string four(4, '\0');
  // Bytes after a NUL were ignored (nlohmann stops at NUL): hidden data in a file that loads.
  put_file(p, raw_file(one + std::string("\0hidden payload", 15), four));
  expect_open_error(p, {p, "NUL byte", "header byte 54", "file offset 62"});
  put_file(p, raw_file(one + std::string("  \0", 3), four));
  expect_open_error(p, {p, "NUL byte"});
  // Other bytes after the object are named with their offset.
  put_file(p, raw_file(one + "  x ", four));
  expect_open_error(p, {p, "header byte 56", "0x78"});
  // JSON whitespace around the object stays valid (the reference reader accepts it).
  put_file(p, raw_file(" \n" + one + " \t\r\n  ", four));
  EXPECT_EQ(SafetensorsFile(p).tensors().size(), 1u);
  // 60,000 levels in __metadata__ / a tensor entry: the error message dumped the value recursively.
  const std::string deep = std::string(60000, '[') + std::string(60000, ']');
  put_file(p, raw_file(R"({"__metadata__":{"k":)" + deep + "}}", ""));
  expect_open_error(p, {p, "nests deeper than 64"});
  put_file(p, raw_file(R"({"a":)" + deep + "}", ""));
  expect_open_error(p, {p, "nests deeper than 64"});
  // Wide values and long tokens are cut to an excerpt in messages (a 1 MB header made a 1 MB message).
  std::string wide = "[1";
  for (int i = 0; i < 200000; ++i) wide += ",1";
  for (const std::string& h : {R"({"a":)" + wide + "]}", R"({"a":[)" + std::string(1 << 20, '1') + "]}",
                               R"({"a":")" + std::string(1 << 20, 'x') + "\\q\"}"}) {
    put_file(p, raw_file(h, ""));
    try {
      SafetensorsFile f(p);
      FAIL();
    } catch (const Error& e) {
      EXPECT_LT(std::string(e.what()).size(), 1000u) << std::string(e.what()).substr(0, 300);
    }
  }
  // Byte counts that wrap 64 bits: [2^31, 2^31] F64 needs 2^65 bytes, which narrowed to 0 matched
  // data_offsets [0, 0]; [2^33, 2^31] U8 has 2^64 elements (numel() wraps to 0); [2^48, 2^48, 0]
  // is empty but numel() overflows on the way.
  put_file(p, raw_file(R"({"a":{"dtype":"F64","shape":[2147483648,2147483648],"data_offsets":[0,0]}})", ""));
  expect_open_error(p, {p, "'a'", "more bytes than the whole file"});
  put_file(p, raw_file(R"({"a":{"dtype":"U8","shape":[8589934592,2147483648],"data_offsets":[0,0]}})", ""));
  expect_open_error(p, {p, "'a'", "more than 2^62 elements"});
  put_file(p, raw_file(R"({"a":{"dtype":"U8","shape":[281474976710656,281474976710656,0],"data_offsets":[0,0]}})", ""));
  expect_open_error(p, {p, "'a'", "more than 2^62 elements"});
}

// Inputs that are not regular files: a FIFO blocked forever in open(); a directory failed in mmap
// ("No such device"); a symlink loop is named as one.
TEST(Safetensors, NotARegularFile) {
  const std::string fifo = tmpdir() + "/fifo.safetensors";
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_open_error(fifo, {fifo, "FIFO"});
  const std::string dir = tmpdir() + "/dir.safetensors";
  fs::create_directories(dir);
  expect_open_error(dir, {dir, "is a directory"});
  const std::string loop = tmpdir() + "/loop.safetensors";
  fs::remove(loop);
  fs::create_symlink("loop.safetensors", loop);
  expect_open_error(loop, {loop, "symbolic links"});
}

TEST(Fs, AtomicWriteAndRead) {
  std::string p = tmpdir() + "/f.txt";
  atomic_write_file(p, "one");
  atomic_write_file(p, "two");
  EXPECT_EQ(read_file(p), "two");
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  try {
    read_file(tmpdir() + "/absent.txt");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("absent.txt"), std::string::npos);
  }
}

// ---- Cross-check with the independent numpy implementation (test_safetensors_py.py) ----
// Values: pattern() above; python recomputes them (exact in fp32).

// Aligned mode, Canonical: the same header as write_safetensors up to the padding, the data
// section at a 4096 multiple, no pads; the reader loads it and the reported size and XXH64 are
// those of the file.
TEST(SafetensorsAligned, CanonicalHeaderAndReader) {
  std::vector<float> a = pattern(1000, 1.0f), b = pattern(333, 2.0f);
  const std::vector<StWriteEntry> ts = {{"a", DType::F32, {10, 100}, a.data()}, {"b", DType::F32, {333}, b.data()}};
  const std::map<std::string, std::string> meta = {{"lathe_layout", "lathe"}};
  const std::string plain = tmpdir() + "/plain.safetensors", aligned = tmpdir() + "/canonical.safetensors";
  write_safetensors(plain, ts, meta);
  const WrittenFile w = write_safetensors_aligned(aligned, ts, StAlign::Canonical, meta);
  const std::string pb = bytes_of(plain), ab = bytes_of(aligned);
  EXPECT_EQ(w.bytes, ab.size());
  EXPECT_EQ(w.xxh64, Xxh64::hash(ab.data(), ab.size()));
  SafetensorsFile f(aligned), g(plain);
  EXPECT_EQ((8 + f.header_size()) % 4096, 0u);
  EXPECT_EQ(f.header_size() % 8, 0u);
  // Same JSON text (the plain one padded to 8 only), same data section.
  auto trim = [](std::string h) { return h.substr(0, h.find_last_not_of(' ') + 1); };
  EXPECT_EQ(trim(ab.substr(8, f.header_size())), trim(pb.substr(8, g.header_size())));
  EXPECT_EQ(ab.substr(8 + f.header_size()), pb.substr(8 + g.header_size()));
  ASSERT_EQ(f.tensors().size(), 2u);
  std::vector<float> out(1000);
  f.read_f32(*f.find("a"), out.data());
  EXPECT_EQ(out, a);
  EXPECT_EQ(f.metadata().at("lathe_layout"), "lathe");
  EXPECT_EQ(f.metadata().at("format"), "pt");
}

// Aligned mode, Addresses: the data section starts congruent to the first tensor's address mod
// 4096, a U8 pad tensor "__lathe_pad__/<next>" of < 4096 zero bytes restores the congruence where
// a tensor does not follow the previous one in memory, every real tensor then sits at a file
// offset congruent to its address, and the reader loads the values.
TEST(SafetensorsAligned, AddressesPadsAndOffsets) {
  // One page-aligned arena; tensors at chosen addresses: x and y back to back, z elsewhere.
  const size_t arena_floats = 1 << 16;
  float* arena = static_cast<float*>(std::aligned_alloc(4096, arena_floats * 4));
  for (size_t i = 0; i < arena_floats; ++i) arena[i] = static_cast<float>(i) * 0.5f - 7.0f;
  for (size_t shift : {size_t{0}, size_t{24}, size_t{1000}}) {
    float* x = arena + shift;              // 8-aligned addresses, as every float buffer lathe allocates
    float* y = x + 77;                     // follows x: no pad
    float* z = arena + 20000 + shift / 2;  // not after y: a pad unless it happens to line up
    const std::vector<StWriteEntry> ts = {
        {"x", DType::F32, {7, 11}, x}, {"y", DType::F32, {5}, y}, {"z", DType::F32, {3, 3}, z}};
    const std::string path = tmpdir() + "/addresses.safetensors";
    const WrittenFile w = write_safetensors_aligned(path, ts, StAlign::Addresses, {{"lathe_layout", "lathe"}});
    const std::string bytes = bytes_of(path);
    EXPECT_EQ(w.bytes, bytes.size());
    EXPECT_EQ(w.xxh64, Xxh64::hash(bytes.data(), bytes.size()));
    SafetensorsFile f(path);
    const size_t data_start = 8 + f.header_size();
    EXPECT_EQ(f.header_size() % 8, 0u);
    EXPECT_EQ(data_start % 4096, reinterpret_cast<uintptr_t>(x) % 4096);
    const size_t gap = (reinterpret_cast<uintptr_t>(z) - reinterpret_cast<uintptr_t>(y + 5)) % 4096;
    ASSERT_EQ(f.tensors().size(), gap ? 4u : 3u) << shift;
    for (const StWriteEntry& t : ts) {
      const StTensorInfo* info = f.find(t.name);
      ASSERT_NE(info, nullptr);
      EXPECT_EQ((data_start + info->data_offset) % 4096, reinterpret_cast<uintptr_t>(t.data) % 4096) << t.name;
      std::vector<float> out(static_cast<size_t>(numel(t.shape)));
      f.read_f32(*info, out.data());
      EXPECT_EQ(0, std::memcmp(out.data(), t.data, out.size() * 4)) << t.name;
      EXPECT_FALSE(is_st_pad(t.name));
    }
    if (gap) {
      const StTensorInfo* pad = f.find("__lathe_pad__/z");
      ASSERT_NE(pad, nullptr);
      EXPECT_TRUE(is_st_pad(pad->name));
      EXPECT_EQ(pad->dtype_code, "U8");
      EXPECT_LT(pad->nbytes, 4096u);
      EXPECT_EQ(pad->data_offset, f.find("y")->data_offset + 20);  // between y and z
      const char* p = static_cast<const char*>(f.data(*pad));
      EXPECT_TRUE(std::all_of(p, p + pad->nbytes, [](char c) { return c == 0; }));
    }
  }
  std::free(arena);
}

// The checks of write_safetensors hold in aligned mode too.
TEST(SafetensorsAligned, RejectsBadInput) {
  float v = 1;
  const std::string path = tmpdir() + "/bad_aligned.safetensors";
  EXPECT_THROW(
      write_safetensors_aligned(path, {{"a", DType::F32, {1}, &v}, {"a", DType::F32, {1}, &v}}, StAlign::Canonical),
      Error);
  EXPECT_THROW(write_safetensors_aligned(path, {{"a", DType::F32, {-1}, &v}}, StAlign::Addresses), Error);
  EXPECT_FALSE(fs::exists(path));
}

// The one read loop (read_file and the checkpoint checksum): pieces of at most `chunk` bytes, in
// order, all of them; the fd is closed afterwards.
TEST(Fs, ReadToEndInChunks) {
  std::string text;
  for (int i = 0; i < 5000; ++i) text += static_cast<char>('a' + i % 26);
  const std::string p = tmpdir() + "/chunks.txt";
  atomic_write_file(p, text);
  size_t size = 0;
  const int fd = open_input(p, &size);
  std::string back;
  size_t calls = 0;
  const size_t n = read_to_end(fd, p, 999, [&](const char* b, size_t m) {
    EXPECT_LE(m, 999u);
    back.append(b, m);
    ++calls;
  });
  EXPECT_EQ(n, text.size());
  EXPECT_EQ(size, text.size());
  EXPECT_EQ(back, text);
  EXPECT_GE(calls, 6u);
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);  // closed
  EXPECT_EQ(read_file(p), text);
}

// entry_present: anything at the path counts, a dangling symlink too; nothing there does not.
TEST(Fs, EntryPresent) {
  const std::string link = tmpdir() + "/dangling", none = tmpdir() + "/nothing_here";
  fs::remove(link);
  fs::create_symlink(tmpdir() + "/no_target", link);
  EXPECT_TRUE(entry_present(link));
  EXPECT_TRUE(entry_present(tmpdir()));
  EXPECT_FALSE(entry_present(none));
}

TEST(StPyBridge, WriteForPython) {
  const char* dir = std::getenv("LATHE_ST_BRIDGE_DIR");
  if (!dir) GTEST_SKIP() << "driven by test_safetensors_py.py";
  auto a = pattern(4 * 6, 2.0f), b = pattern(5, 300.0f);
  std::vector<int64_t> ids = {3, -1, 1LL << 50};
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    write_safetensors_f32(std::string(dir) + "/lathe_" + std::string(dtype_name(dt)) + ".safetensors",
                          {{"w.a", {4, 6}, a.data()}, {"b", {5}, b.data()}}, dt, {{"who", "lathe"}});
  write_safetensors(std::string(dir) + "/lathe_I64.safetensors", {{"ids", DType::I64, {3}, ids.data()}});
}

// Python wrote py.safetensors (sorted like the reference writer) and expected.json with every
// tensor's values as fp32 (its own decoding of bf16/f16).
TEST(StPyBridge, ReadFromPython) {
  const char* dir = std::getenv("LATHE_ST_BRIDGE_DIR");
  if (!dir) GTEST_SKIP() << "driven by test_safetensors_py.py";
  SafetensorsFile f(std::string(dir) + "/py.safetensors");
  auto expected = nlohmann::json::parse(read_file(std::string(dir) + "/expected.json"));
  ASSERT_EQ(f.tensors().size(), expected["tensors"].size());
  for (auto& [k, v] : f.metadata()) EXPECT_EQ(expected["metadata"][k], v);
  for (auto& e : expected["tensors"]) {
    const StTensorInfo* t = f.find(e["name"].get<std::string>());
    ASSERT_NE(t, nullptr) << e["name"];
    EXPECT_EQ(t->dtype_code, e["dtype"]);
    EXPECT_EQ(t->shape, e["shape"].get<Shape>());
    if (e["dtype"] == "I64") {
      auto want = e["values"].get<std::vector<int64_t>>();
      std::vector<int64_t> got(want.size());
      std::memcpy(got.data(), f.data(*t), t->nbytes);
      EXPECT_EQ(got, want);
      continue;
    }
    auto want = e["values"].get<std::vector<float>>();
    std::vector<float> got(want.size());
    f.read_f32(*t, got.data());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << t->name << "[" << i << "]";
  }
}
