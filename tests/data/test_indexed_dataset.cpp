// Megatron indexed dataset: round trips, the spec's worked example byte for byte, every
// validation error, and cross-checks against an independent numpy implementation of the format
// (tests/data/megatron_numpy.py) in both directions.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/indexed_dataset.h"

namespace fs = std::filesystem;
using lathe::DType;
using namespace lathe::data;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "lathe_idx_XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

std::vector<unsigned char> read_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& p, const std::vector<unsigned char>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}
template <typename T>
std::vector<T> read_raw(const std::string& p) {
  auto b = read_bytes(p);
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
  return v;
}

// Random documents (some empty) with ids below `hi`.
std::vector<std::vector<int32_t>> random_docs(uint32_t seed, int n, int32_t hi) {
  std::mt19937 g(seed);
  std::vector<std::vector<int32_t>> docs(n);
  for (auto& d : docs) {
    d.resize(g() % 40);
    for (auto& t : d) t = static_cast<int32_t>(g() % static_cast<uint32_t>(hi));
  }
  return docs;
}

void write_dataset(const std::string& prefix, DType dt, const std::vector<std::vector<int32_t>>& docs) {
  IndexedDatasetWriter w(prefix, dt);
  for (auto& d : docs) w.add_document(d);
  w.finalize();
}

// EXPECT that f() throws a lathe::Error whose message contains every needle.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "no error thrown";
  } catch (const lathe::Error& e) {
    std::string msg = e.what();
    for (auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

std::string python() { return "/usr/bin/python3"; }
std::string script() { return std::string(LATHE_SOURCE_DIR) + "/tests/data/megatron_numpy.py"; }

}  // namespace

TEST(IndexedDataset, OptimalDtype) {
  EXPECT_EQ(optimal_token_dtype(50257), DType::U16);
  EXPECT_EQ(optimal_token_dtype(65499), DType::U16);
  EXPECT_EQ(optimal_token_dtype(65500), DType::I32);
  EXPECT_EQ(optimal_token_dtype(128256), DType::I32);
}

class RoundTrip : public ::testing::TestWithParam<DType> {};

TEST_P(RoundTrip, WriteRead) {
  TempDir tmp;
  const DType dt = GetParam();
  const int32_t hi = dt == DType::U8 ? 256 : dt == DType::U16 ? 65536 : 2000000000;
  auto docs = random_docs(7, 50, hi);
  docs[3].push_back(hi - 1);  // largest id the dtype holds
  const std::string prefix = tmp / "rt";
  IndexedDatasetWriter w(prefix, dt);
  uint64_t ntok = 0;
  for (auto& d : docs) {
    w.add_document(d);
    ntok += d.size();
  }
  EXPECT_EQ(w.num_documents(), docs.size());
  EXPECT_EQ(w.num_tokens(), ntok);
  EXPECT_EQ(w.bin_bytes(), ntok * lathe::dtype_size(dt));
  EXPECT_FALSE(fs::exists(prefix + ".idx"));  // nothing final before finalize()
  w.finalize();
  EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
  EXPECT_FALSE(fs::exists(prefix + ".idx.tmp"));
  EXPECT_EQ(fs::file_size(prefix + ".bin"), ntok * lathe::dtype_size(dt));

  IndexedDataset ds(prefix);
  EXPECT_EQ(ds.dtype(), dt);
  EXPECT_EQ(ds.prefix(), prefix);
  ASSERT_EQ(ds.num_sequences(), docs.size());
  EXPECT_EQ(ds.num_documents(), docs.size());
  EXPECT_EQ(ds.total_tokens(), static_cast<int64_t>(ntok));
  std::vector<int32_t> stream;
  int32_t mx = -1;
  for (size_t i = 0; i < docs.size(); ++i) {
    EXPECT_EQ(ds.sequence_length(i), static_cast<int64_t>(docs[i].size()));
    EXPECT_EQ(ds.sequence_offset(i), static_cast<int64_t>(stream.size()));
    std::vector<int32_t> got(docs[i].size());
    ds.read_sequence(i, got.data());
    EXPECT_EQ(got, docs[i]) << "sequence " << i;
    // sequence_data(i): the same tokens in place, in the shard's dtype (the Python package's views).
    const unsigned char* raw = static_cast<const unsigned char*>(ds.sequence_data(i));
    for (size_t k = 0; k < docs[i].size(); ++k) {
      int64_t v = 0;
      const unsigned char* e = raw + k * lathe::dtype_size(dt);
      if (dt == DType::U8) v = *e;
      if (dt == DType::U16) v = *reinterpret_cast<const uint16_t*>(e);
      if (dt == DType::I32) v = *reinterpret_cast<const int32_t*>(e);
      if (dt == DType::I64) v = *reinterpret_cast<const int64_t*>(e);
      ASSERT_EQ(v, docs[i][k]) << "sequence_data " << i << " token " << k;
    }
    stream.insert(stream.end(), docs[i].begin(), docs[i].end());
    for (int32_t t : docs[i]) mx = std::max(mx, t);
  }
  // Arbitrary global windows, crossing sequence boundaries.
  for (int64_t start : {0L, 1L, 17L, static_cast<int64_t>(ntok) - 33}) {
    std::vector<int32_t> got(33);
    ds.read_global(start, 33, got.data());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), stream.begin() + start)) << "start " << start;
  }
  EXPECT_EQ(ds.max_token_id(), mx);
  EXPECT_EQ(ds.max_token_id(), hi - 1);
  std::vector<int32_t> one(1);
  EXPECT_THROW(ds.read_global(static_cast<int64_t>(ntok), 1, one.data()), lathe::Error);
  EXPECT_THROW(ds.sequence_length(docs.size()), lathe::Error);
  EXPECT_THROW(ds.sequence_data(docs.size()), lathe::Error);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, RoundTrip, ::testing::Values(DType::U16, DType::I32, DType::U8, DType::I64));

TEST(IndexedDataset, EmptyDataset) {
  TempDir tmp;
  write_dataset(tmp / "e", DType::U16, {});
  IndexedDataset ds(tmp / "e");
  EXPECT_EQ(ds.num_sequences(), 0u);
  EXPECT_EQ(ds.total_tokens(), 0);
  EXPECT_EQ(ds.max_token_id(), -1);
  EXPECT_THROW(ds.sequence_data(0), lathe::Error);
}

// Section 3's worked example, bytes transcribed from the spec.
TEST(IndexedDataset, SpecWorkedExampleBytes) {
  TempDir tmp;
  write_dataset(tmp / "ex", DType::U16, {{10, 11, 12}, {20, 21}});
  const std::vector<unsigned char> bin = {0x0A, 0, 0x0B, 0, 0x0C, 0, 0x14, 0, 0x15, 0};
  std::vector<unsigned char> idx = {0x4D, 0x4D, 0x49, 0x44, 0x49, 0x44, 0x58, 0x00, 0x00,  // magic
                                    1,    0,    0,    0,    0,    0,    0,    0,           // version
                                    8,                                                     // uint16
                                    2,    0,    0,    0,    0,    0,    0,    0,           // S
                                    3,    0,    0,    0,    0,    0,    0,    0,           // D
                                    3,    0,    0,    0,    2,    0,    0,    0};          // lengths
  for (int64_t v : {0, 6, 0, 1, 2})  // pointers [0, 6], document_indices [0, 1, 2]
    for (int b = 0; b < 8; ++b) idx.push_back(static_cast<unsigned char>((v >> (8 * b)) & 0xff));
  ASSERT_EQ(idx.size(), 82u);
  EXPECT_EQ(read_bytes(tmp / "ex.bin"), bin);
  EXPECT_EQ(read_bytes(tmp / "ex.idx"), idx);
}

TEST(IndexedDataset, WriterWithoutFinalizeLeavesNothing) {
  TempDir tmp;
  {
    IndexedDatasetWriter w(tmp / "x", DType::U16);
    w.add_document(std::vector<int32_t>{1, 2, 3});
  }
  EXPECT_TRUE(fs::is_empty(tmp.path));
}

TEST(IndexedDataset, WriterRejectsOutOfRangeIds) {
  TempDir tmp;
  IndexedDatasetWriter w(tmp / "x", DType::U16);
  expect_error([&] { w.add_document(std::vector<int32_t>{1, 65536}); }, {"65536", "U16"});
  expect_error([&] { w.add_document(std::vector<int32_t>{-3}); }, {"-3"});
  IndexedDatasetWriter w8(tmp / "y", DType::U8);
  expect_error([&] { w8.add_document(std::vector<int32_t>{256}); }, {"256"});
  expect_error([&] { IndexedDatasetWriter bad(tmp / "z", DType::F32); }, {"F32"});
  expect_error([&] { IndexedDatasetWriter bad(tmp / "nodir/z", DType::U16); }, {"nodir"});
}

class Corrupt : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix = tmp / "c";
    write_dataset(prefix, DType::U16, {{1, 2, 3}, {4, 5}, {6}});
    idx = read_bytes(prefix + ".idx");
    bin = read_bytes(prefix + ".bin");
  }
  TempDir tmp;
  std::string prefix;
  std::vector<unsigned char> idx, bin;
};

TEST_F(Corrupt, MissingIdx) {
  fs::remove(prefix + ".idx");
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".idx", "missing"});
}
TEST_F(Corrupt, MissingBin) {
  fs::remove(prefix + ".bin");
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".bin", "missing"});
}
TEST_F(Corrupt, TruncatedIdx) {
  write_bytes(prefix + ".idx", {idx.begin(), idx.end() - 5});
  expect_error([&] { IndexedDataset ds(prefix); },
               {prefix + ".idx", "truncated", std::to_string(idx.size()), std::to_string(idx.size() - 5)});
  write_bytes(prefix + ".idx", {idx.begin(), idx.begin() + 20});
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".idx", "truncated"});
}
TEST_F(Corrupt, TruncatedBin) {
  write_bytes(prefix + ".bin", {bin.begin(), bin.end() - 2});
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".bin", "truncated", "expected 12 bytes got 10"});
}
TEST_F(Corrupt, BadMagic) {
  idx[3] = 'X';
  write_bytes(prefix + ".idx", idx);
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".idx", "magic"});
}
TEST_F(Corrupt, BadVersion) {
  idx[9] = 2;
  write_bytes(prefix + ".idx", idx);
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".idx", "version 2"});
}
TEST_F(Corrupt, BadDtypeCode) {
  idx[17] = 7;
  write_bytes(prefix + ".idx", idx);
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".idx", "float32"});
  idx[17] = 42;
  write_bytes(prefix + ".idx", idx);
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".idx", "42"});
}
TEST_F(Corrupt, InconsistentPointers) {
  idx[34 + 12 + 8] = 4;  // sequence_pointers[1] = 4 instead of 6
  write_bytes(prefix + ".idx", idx);
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".idx", "sequence_pointers[1]"});
}
TEST_F(Corrupt, DocumentIndicesEnd) {
  idx[idx.size() - 8] = 2;  // document_indices[-1] = 2 != S = 3
  write_bytes(prefix + ".idx", idx);
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".idx", "document_indices[-1]"});
}
TEST_F(Corrupt, BinTooLong) {
  bin.push_back(0);
  bin.push_back(0);
  write_bytes(prefix + ".bin", bin);
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".bin", "expected 12 bytes got 14"});
}

// Issue 14. Negative ids in an int32/int64 .bin passed max_token_id() (lathe check, eval) and
// failed only in the model's forward pass, without naming the file.
TEST(IndexedDatasetHostile, NegativeTokenIds) {
  TempDir tmp;
  for (DType dt : {DType::I32, DType::I64}) {
    const std::string prefix = tmp / ("neg" + std::string(dtype_name(dt)));
    write_dataset(prefix, dt, {{1, 2, 3}, {4, 5}});
    auto bin = read_bytes(prefix + ".bin");
    const size_t item = dtype_size(dt);
    for (size_t b = 0; b < item; ++b) bin[3 * item + b] = 0xff;  // token 3 (first of document 1) = -1
    write_bytes(prefix + ".bin", bin);
    IndexedDataset ds(prefix);
    expect_error([&] { ds.max_token_id(); }, {prefix + ".bin", "negative", "-1", "at token 3"});
  }
}

// A FIFO in place of the .bin/.idx blocked open() forever; a directory failed in mmap with "No
// such device"; a symlink loop is named as one.
TEST(IndexedDatasetHostile, NotRegularFiles) {
  TempDir tmp;
  const std::string prefix = tmp / "d";
  write_dataset(prefix, DType::U16, {{1, 2, 3}});
  fs::remove(prefix + ".bin");
  ASSERT_EQ(::mkfifo((prefix + ".bin").c_str(), 0600), 0);
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".bin", "FIFO"});
  fs::remove(prefix + ".bin");
  fs::create_directories(prefix + ".bin");
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".bin", "is a directory"});
  fs::remove(prefix + ".idx");
  fs::create_symlink("d.idx", prefix + ".idx");
  expect_error([&] { IndexedDataset ds(prefix); }, {prefix + ".idx", "symbolic links"});
}

// lathe writes, numpy (independent implementation of the spec) reads.
TEST(IndexedDataset, NumpyReadsLatheOutput) {
  TempDir tmp;
  for (auto [dt, code, hi] : {std::tuple{DType::U16, 8, 65536}, std::tuple{DType::I32, 4, 2000000000}}) {
    auto docs = random_docs(11, 30, hi);
    const std::string prefix = tmp / ("lathe" + std::to_string(code));
    write_dataset(prefix, dt, docs);
    std::vector<int32_t> tokens, lengths;
    for (auto& d : docs) {
      tokens.insert(tokens.end(), d.begin(), d.end());
      lengths.push_back(static_cast<int32_t>(d.size()));
    }
    const std::string exp = tmp / ("expected" + std::to_string(code));
    std::ofstream(exp + ".tokens", std::ios::binary)
        .write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 4);
    std::ofstream(exp + ".lengths", std::ios::binary)
        .write(reinterpret_cast<const char*>(lengths.data()), lengths.size() * 4);
    std::ofstream(exp + ".code") << code;
    const std::string cmd = python() + " " + script() + " check " + prefix + " " + exp;
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
}

// numpy writes (several sequences per document, as --split-sentences output), lathe reads.
TEST(IndexedDataset, LatheReadsNumpyOutput) {
  TempDir tmp;
  for (auto [dt, code] :
       {std::pair{DType::U16, 8}, std::pair{DType::I32, 4}, std::pair{DType::U8, 1}, std::pair{DType::I64, 5}}) {
    const std::string prefix = tmp / ("np" + std::to_string(code));
    const std::string cmd =
        python() + " " + script() + " write " + prefix + " " + std::to_string(100 + code) + " " + std::to_string(code);
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    auto tokens = read_raw<int32_t>(prefix + ".expected.tokens");
    auto lengths = read_raw<int32_t>(prefix + ".expected.lengths");
    auto docs = read_raw<int64_t>(prefix + ".expected.docs");
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.dtype(), dt);
    ASSERT_EQ(ds.num_sequences(), lengths.size());
    EXPECT_EQ(ds.num_documents(), docs.size() - 1);
    EXPECT_LT(ds.num_documents(), ds.num_sequences());
    ASSERT_EQ(ds.total_tokens(), static_cast<int64_t>(tokens.size()));
    std::vector<int32_t> got(tokens.size());
    ds.read_global(0, ds.total_tokens(), got.data());
    EXPECT_EQ(got, tokens);
    int64_t off = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      EXPECT_EQ(ds.sequence_length(i), lengths[i]);
      std::vector<int32_t> seq(lengths[i]);
      ds.read_sequence(i, seq.data());
      EXPECT_TRUE(std::equal(seq.begin(), seq.end(), tokens.begin() + off));
      off += lengths[i];
    }
    EXPECT_EQ(ds.max_token_id(), *std::max_element(tokens.begin(), tokens.end()));
  }
}
