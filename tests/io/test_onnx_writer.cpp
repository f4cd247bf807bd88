// The ONNX protobuf writer against bytes from the reference implementation: the golden hex below is
// onnx 1.17's ModelProto.SerializeToString() of the same model (made with onnx.helper: two nodes
// with int (negative), float and ints attributes, fp32 / int64-scalar / fp16 initializers, a
// symbolic dim, opset 17, metadata), so every field number, wire type and length prefix is checked.
// Also: external data (offsets, 64-byte alignment, small tensors stay inline) and refusals.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/stop_signal.h"
#include "error_of.h"
#include "io/fs.h"
#include "io/onnx_writer.h"
#include "io/xxh64.h"

using namespace lathe;
using namespace lathe::io::onnx;
namespace fs = std::filesystem;

namespace {

using lathe::test::error_of;

std::string tmpdir() {
  static std::string d = [] {
    auto p = fs::temp_directory_path() / ("lathe_onnx_test_" + std::to_string(::getpid()));
    fs::create_directories(p);
    return p.string();
  }();
  return d;
}

template <class T>
std::string bytes(std::initializer_list<T> v) {
  std::string s(v.size() * sizeof(T), '\0');
  std::memcpy(s.data(), std::data(v), s.size());
  return s;
}

std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string h;
  for (unsigned char c : s) {
    h.push_back(d[c >> 4]);
    h.push_back(d[c & 15]);
  }
  return h;
}

// The golden bytes came from (python3, onnx 1.17):
//   W = numpy_helper.from_array(np.array([1.5, -2.0], np.float32), "W")
//   S = numpy_helper.from_array(np.array(-3, np.int64), "S")
//   H = numpy_helper.from_array(np.array([[1.0, -0.5]], np.float16), "H")
//   n1 = helper.make_node("Add", ["X", "W"], ["Y"], name="add")
//   n2 = helper.make_node("Fake", ["Y"], ["Z"], name="fake", axis=-1, epsilon=1e-5, perm=[1, 0])
//   g = helper.make_graph([n1, n2], "g", [helper.make_tensor_value_info("X", TP.FLOAT, ["n", 2])],
//                         [helper.make_tensor_value_info("Z", TP.FLOAT, ["n", 2])], initializer=[W, S, H])
//   m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="lathe", ir_version=8)
//   m.producer_version = "t"; helper.set_model_props(m, {"k": "v"}); m.SerializeToString().hex()
// that is:
//   W = [1.5, -2] f32, S = -3 (int64 scalar), H = [[1, -0.5]] f16
//   add: Add(X, W) -> Y;  fake: Fake(Y) -> Z  {axis = -1, epsilon = 1e-5, perm = [1, 0]}
//   X, Z: float ["n", 2]; producer lathe "t"; IR 8, opset 17; metadata k = v
void make(Graph& g, ModelProtoInfo& info) {
  g.name = "g";
  g.initializers.push_back(Tensor{"W", ElemType::Float, {2}, bytes<float>({1.5f, -2.0f})});
  g.initializers.push_back(Tensor{"S", ElemType::Int64, {}, bytes<int64_t>({-3})});
  g.initializers.push_back(Tensor{"H", ElemType::Float16, {1, 2}, bytes<uint16_t>({0x3c00, 0xb800})});
  g.nodes.push_back(Node{"Add", {"X", "W"}, {"Y"}, "add", {}});
  g.nodes.push_back(Node{
      "Fake", {"Y"}, {"Z"}, "fake", {attr_int("axis", -1), attr_float("epsilon", 1e-5f), attr_ints("perm", {1, 0})}});
  g.inputs.push_back(ValueInfo{"X", ElemType::Float, {Dim::named("n"), Dim::fixed(2)}});
  g.outputs.push_back(ValueInfo{"Z", ElemType::Float, {Dim::named("n"), Dim::fixed(2)}});
  info.producer_version = "t";
  info.metadata = {{"k", "v"}};
}

// The options that put every initializer of at least 8 bytes (W and S, not H) in the data file.
WriteOptions external_from_8_bytes() {
  WriteOptions o;
  o.external_data = true;
  o.external_min_bytes = 8;
  return o;
}

// The file names in DIR, sorted.
std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

const char* kGolden =
    "080812056c617468651a01743ac5010a130a01580a01571201591a0361646422034164640a4a0a015912015a1a0466616b652204"
    "46616b652a140a046178697318ffffffffffffffffff01a001022a110a07657073696c6f6e15acc52737a001012a0d0a047065726d"
    "40014000a001071201672a11080210014201574a080000c03f000000c02a0f10074201534a08fdffffffffffffff2a0f0801080210"
    "0a4201484a04003c00b85a140a0158120f0a0d080112090a0312016e0a02080262140a015a120f0a0d080112090a0312016e0a0208"
    "0242040a00101172060a016b120176";

TEST(OnnxWriter, BytesEqualTheReferenceSerialization) {
  Graph g;
  ModelProtoInfo info;
  make(g, info);
  const std::string path = tmpdir() + "/golden.onnx";
  const WriteResult r = write_model(path, g, info);
  const std::string got = io::read_file(path);
  EXPECT_EQ(r.model_bytes, got.size());
  EXPECT_EQ(got.size(), 226u);
  EXPECT_EQ(hex(got), kGolden);
  EXPECT_TRUE(r.data_path.empty());
  EXPECT_FALSE(fs::exists(path + ".data"));
}

TEST(OnnxWriter, ExternalDataOffsetsAndInlineSmallTensors) {
  Graph g;
  ModelProtoInfo info;
  make(g, info);
  const WriteOptions o = external_from_8_bytes();  // W (8 B) and S (8 B) external, H (4 B) inline
  const std::string path = tmpdir() + "/ext.onnx";
  const WriteResult r = write_model(path, g, info, o);
  const std::string data = io::read_file(r.data_path);
  // Named by its content (XXH64), beside the model: "ext.onnx.<16 hex>.data".
  const std::string location = external_data_name("ext.onnx", io::Xxh64::hash(data.data(), data.size()));
  ASSERT_EQ(r.data_path, tmpdir() + "/" + location);
  ASSERT_EQ(location.size(), 30u);
  ASSERT_EQ(data.size(), 72u);  // W at 0, S at 64 (64-byte aligned)
  EXPECT_EQ(r.data_bytes, 72u);
  EXPECT_EQ(data.substr(0, 8), g.initializers[0].data);
  EXPECT_EQ(data.substr(8, 56), std::string(56, '\0'));
  EXPECT_EQ(data.substr(64, 8), g.initializers[1].data);
  const std::string model = io::read_file(path);
  EXPECT_EQ(model.size(), r.model_bytes);
  // location = file name only; offsets as decimal strings; data_location (14) = EXTERNAL (1)
  EXPECT_NE(model.find("location\x12\x1e" + location), std::string::npos);
  EXPECT_NE(model.find(std::string("offset\x12\x02"
                                   "64",
                                   10)),
            std::string::npos);
  EXPECT_NE(model.find(std::string("\x70\x01", 2)), std::string::npos);
  EXPECT_EQ(model.find(g.initializers[0].data), std::string::npos);  // not inline any more
  EXPECT_NE(model.find(g.initializers[2].data), std::string::npos);  // H still inline
}

TEST(OnnxWriter, SwitchesToExternalAboveTheInlineLimit) {
  Graph g;
  ModelProtoInfo info;
  make(g, info);
  WriteOptions o;
  o.inline_limit = 200;  // the model is 226 bytes inline
  o.external_min_bytes = 8;
  const WriteResult r = write_model(tmpdir() + "/auto.onnx", g, info, o);
  EXPECT_FALSE(r.data_path.empty());
  EXPECT_EQ(r.data_bytes, 72u);  // W and S moved out (their location entries outweigh 16 bytes here)
}

TEST(OnnxWriter, RefusesATensorWhoseBytesDoNotMatchItsShape) {
  Graph g;
  ModelProtoInfo info;
  make(g, info);
  g.initializers[0].dims = {3};
  const std::string path = tmpdir() + "/bad.onnx";
  const std::string e = error_of([&] { write_model(path, g, info); });
  EXPECT_NE(e.find("'W' has 8 bytes for 3 float32 elements"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(path));
}

// D6 (hostile pass 2026-12-01): the data file used to be renamed to the fixed "<path>.data" and
// then the graph over <path>: a kill between the two paired the new weights with the old graph.
// Now new weights get a new name, the graph's rename is the only switch, and what the old graph
// named is removed afterwards: at every point the graph on disk names a complete data file of its
// own export.
TEST(OnnxWriter, ExternalDataPairStaysConsistentAcrossRewrites) {
  const std::string dir = tmpdir() + "/pair";
  fs::create_directories(dir);
  const std::string path = dir + "/m.onnx";
  Graph g;
  ModelProtoInfo info;
  make(g, info);
  WriteOptions o = external_from_8_bytes();
  const WriteResult a = write_model(path, g, info, o);
  const std::string graph_a = io::read_file(path), data_a = io::read_file(a.data_path);
  // New weights: a new data file name; the old one is gone once the new graph is in place.
  g.initializers[0].data[0] ^= 0x55;
  const WriteResult b = write_model(path, g, info, o);
  EXPECT_NE(a.data_path, b.data_path);
  EXPECT_FALSE(fs::exists(a.data_path));
  EXPECT_NE(io::read_file(path).find(fs::path(b.data_path).filename().string()), std::string::npos);
  // What a kill between the two renames leaves: graph A with data A, plus B's data unreferenced.
  // The old pair is intact (A's data file was never touched by B's write until B's graph landed).
  io::atomic_write_file(path, graph_a);
  io::atomic_write_file(a.data_path, data_a);
  EXPECT_NE(io::read_file(path).find(fs::path(a.data_path).filename().string()), std::string::npos);
  EXPECT_EQ(io::read_file(a.data_path), data_a);
  // The next export removes the orphan and the temporaries of its naming, nothing else.
  io::atomic_write_file(path + ".tmp", "stale");
  io::atomic_write_file(b.data_path + ".tmp", "stale");
  io::atomic_write_file(dir + "/m.onnx.other", "kept");
  const WriteResult c = write_model(path, g, info, o);
  EXPECT_EQ(c.data_path, b.data_path);  // same bytes, same name
  EXPECT_EQ(names_in(dir),
            (std::vector<std::string>{"m.onnx", fs::path(c.data_path).filename().string(), "m.onnx.other"}));
  // Inline again: no data file of its naming stays.
  o.external_data = false;
  write_model(path, g, info, o);
  EXPECT_FALSE(fs::exists(c.data_path));
  EXPECT_TRUE(fs::exists(dir + "/m.onnx.other"));
}

TEST(OnnxWriter, ExternalDataNames) {
  EXPECT_EQ(external_data_name("m.onnx", 0xabcdef), "m.onnx.0000000000abcdef.data");
  EXPECT_TRUE(is_external_data_name("m.onnx", "m.onnx.0000000000abcdef.data"));
  EXPECT_FALSE(is_external_data_name("m.onnx", "m.onnx.data"));
  EXPECT_FALSE(is_external_data_name("m.onnx", "m.onnx.0000000000ABCDEF.data"));
  EXPECT_FALSE(is_external_data_name("m.onnx", "n.onnx.0000000000abcdef.data"));
  EXPECT_FALSE(is_external_data_name("m.onnx", "m.onnx.0000000000abcdef.data.tmp"));
}

// D6: a SIGINT under the tools' StopSignalGuard stops the write; no file and no temporary remain,
// and an existing pair is untouched.
TEST(OnnxWriter, SignalStopsTheWriteAndLeavesNothing) {
  const std::string dir = tmpdir() + "/sig";
  fs::create_directories(dir);
  const std::string path = dir + "/s.onnx";
  Graph g;
  ModelProtoInfo info;
  make(g, info);
  const WriteOptions o = external_from_8_bytes();
  const WriteResult old = write_model(path, g, info, o);
  const std::string old_graph = io::read_file(path);
  g.initializers[0].data[0] ^= 0x55;
  {
    StopSignalGuard guard;
    std::raise(SIGINT);
    const std::string e = error_of([&] { write_model(path, g, info, o); });
    EXPECT_NE(e.find("interrupted by SIGINT"), std::string::npos) << e;
  }
  EXPECT_EQ(io::read_file(path), old_graph);
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"s.onnx", fs::path(old.data_path).filename().string()}));
}

// The streaming writer itself: a signal between two writes unwinds, the temporary is removed and
// the destination keeps its old contents.
TEST(AtomicFileWriter, SignalRemovesTheTemporary) {
  const std::string path = tmpdir() + "/w.bin";
  io::atomic_write_file(path, "old");
  StopSignalGuard guard;
  const std::string e = error_of([&] {
    io::AtomicFileWriter w(path);
    w.write("new", 3);
    std::raise(SIGTERM);
    w.write("more", 4);
  });
  EXPECT_NE(e.find("interrupted by SIGTERM"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_EQ(io::read_file(path), "old");
}

}  // namespace
