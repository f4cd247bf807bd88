// Protobuf wire format, the part ONNX needs: a field is a key varint (field_number << 3 | wire type)
// followed by a varint (type 0: int32/int64/enums, negative values as 10-byte two's complement),
// 4 little-endian bytes (type 5: float) or a varint length and that many bytes (type 2: strings,
// bytes, sub-messages). Repeated scalars are written unpacked (one key per element), which every
// proto2 parser accepts.
#include "io/onnx_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>

#include "core/error.h"
#include "core/stop_signal.h"
#include "io/fs.h"
#include "io/xxh64.h"

namespace lathe::io::onnx {

size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::Float:
    case ElemType::Int32:
      return 4;
    case ElemType::Int64:
      return 8;
    case ElemType::Bool:
      return 1;
    case ElemType::Float16:
      return 2;
  }
  return 0;
}

const char* elem_name(ElemType t) {
  switch (t) {
    case ElemType::Float:
      return "float32";
    case ElemType::Int32:
      return "int32";
    case ElemType::Int64:
      return "int64";
    case ElemType::Bool:
      return "bool";
    case ElemType::Float16:
      return "float16";
  }
  return "?";
}

namespace {

size_t varint_len(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// A message under construction: its own bytes, interleaved with referenced byte ranges (tensor data,
// not copied) and sub-messages whose length prefix is only known when the message is written.
class Message {
 public:
  Message& varint(uint32_t field, uint64_t v) {
    key(field, 0);
    put_varint(own(), v);
    return *this;
  }
  Message& int64(uint32_t field, int64_t v) { return varint(field, static_cast<uint64_t>(v)); }
  Message& float32(uint32_t field, float v) {
    key(field, 5);
    char b[4];
    std::memcpy(b, &v, 4);  // little-endian hosts only (x86-64, aarch64)
    own().append(b, 4);
    return *this;
  }
  Message& string(uint32_t field, std::string_view s) {
    key(field, 2);
    put_varint(own(), s.size());
    own().append(s);
    return *this;
  }
  // The bytes stay where they are until write(); the caller keeps them alive.
  Message& bytes_ref(uint32_t field, const void* p, size_t n) {
    key(field, 2);
    put_varint(own(), n);
    Part part;
    part.ref = static_cast<const char*>(p);
    part.ref_len = n;
    parts_.push_back(std::move(part));
    return *this;
  }
  Message& child(uint32_t field) {
    key(field, 2);
    Part part;
    part.child = std::make_unique<Message>();
    parts_.push_back(std::move(part));
    return *parts_.back().child;
  }
  Message& entry(uint32_t field, std::string_view k, std::string_view v) {  // StringStringEntryProto
    child(field).string(1, k).string(2, v);
    return *this;
  }

  uint64_t size() const {
    uint64_t n = 0;
    for (const Part& p : parts_) {
      n += p.own.size() + p.ref_len;
      if (p.child) {
        const uint64_t c = p.child->size();
        n += varint_len(c) + c;
      }
    }
    return n;
  }
  template <class Sink>
  void write(Sink& sink) const {
    std::string len;
    for (const Part& p : parts_) {
      if (!p.own.empty()) sink(p.own.data(), p.own.size());
      if (p.ref_len) sink(p.ref, p.ref_len);
      if (p.child) {
        len.clear();
        put_varint(len, p.child->size());
        sink(len.data(), len.size());
        p.child->write(sink);
      }
    }
  }

 private:
  struct Part {
    std::string own;
    const char* ref = nullptr;
    size_t ref_len = 0;
    std::unique_ptr<Message> child;
  };
  std::string& own() {
    if (parts_.empty() || parts_.back().ref_len || parts_.back().child) parts_.emplace_back();
    return parts_.back().own;
  }
  void key(uint32_t field, uint32_t wire) { put_varint(own(), (uint64_t{field} << 3) | wire); }
  std::vector<Part> parts_;
};

// TensorProto: dims = 1, data_type = 2, name = 8, raw_data = 9, external_data = 13,
// data_location = 14 (EXTERNAL = 1).
void tensor_proto(Message& m, const Tensor& t, const std::string* location, uint64_t offset) {
  for (int64_t d : t.dims) m.int64(1, d);
  m.varint(2, static_cast<uint64_t>(t.type));
  m.string(8, t.name);
  if (location) {
    m.entry(13, "location", *location);
    m.entry(13, "offset", std::to_string(offset));
    m.entry(13, "length", std::to_string(t.data.size()));
    m.varint(14, 1);
  } else {
    m.bytes_ref(9, t.data.data(), t.data.size());
  }
}

// ValueInfoProto: name = 1, type = 2 -> TypeProto.tensor_type = 1 -> elem_type = 1, shape = 2 ->
// TensorShapeProto.dim = 1 -> dim_value = 1 | dim_param = 2.
void value_info(Message& m, const ValueInfo& v) {
  m.string(1, v.name);
  Message& tensor = m.child(2).child(1);
  tensor.varint(1, static_cast<uint64_t>(v.type));
  Message& shape = tensor.child(2);
  for (const Dim& d : v.dims) {
    Message& dim = shape.child(1);
    if (d.value >= 0)
      dim.int64(1, d.value);
    else
      dim.string(2, d.param);
  }
}

// AttributeProto: name = 1, f = 2, i = 3, s = 4, t = 5, ints = 8, type = 20
// (FLOAT 1, INT 2, STRING 3, TENSOR 4, INTS 7).
void attribute(Message& m, const Attribute& a) {
  m.string(1, a.name);
  switch (a.kind) {
    case Attribute::Int:
      m.int64(3, a.i).varint(20, 2);
      break;
    case Attribute::Float:
      m.float32(2, a.f).varint(20, 1);
      break;
    case Attribute::Ints:
      for (int64_t v : a.ints) m.int64(8, v);
      m.varint(20, 7);
      break;
    case Attribute::String:
      m.string(4, a.s).varint(20, 3);
      break;
    case Attribute::TensorValue:
      tensor_proto(m.child(5), a.t, nullptr, 0);
      m.varint(20, 4);
      break;
  }
}

// NodeProto: input = 1, output = 2, name = 3, op_type = 4, attribute = 5, domain = 7.
void node_proto(Message& m, const Node& n) {
  for (const auto& s : n.inputs) m.string(1, s);
  for (const auto& s : n.outputs) m.string(2, s);
  if (!n.name.empty()) m.string(3, n.name);
  m.string(4, n.op_type);
  for (const auto& a : n.attributes) attribute(m.child(5), a);
}

// ModelProto: ir_version = 1, producer_name = 2, producer_version = 3, doc_string = 6, graph = 7,
// opset_import = 8 (OperatorSetIdProto: domain = 1, version = 2), metadata_props = 14.
// GraphProto: node = 1, name = 2, initializer = 5, input = 11, output = 12.
void model_proto(Message& m, const Graph& g, const ModelProtoInfo& info, const std::string* location,
                 const std::vector<uint64_t>& offsets, size_t min_external) {
  m.int64(1, info.ir_version);
  m.string(2, info.producer_name);
  if (!info.producer_version.empty()) m.string(3, info.producer_version);
  if (!info.doc_string.empty()) m.string(6, info.doc_string);
  Message& graph = m.child(7);
  for (const Node& n : g.nodes) node_proto(graph.child(1), n);
  graph.string(2, g.name);
  for (size_t i = 0; i < g.initializers.size(); ++i) {
    const Tensor& t = g.initializers[i];
    const bool ext = location && t.data.size() >= min_external;
    tensor_proto(graph.child(5), t, ext ? location : nullptr, ext ? offsets[i] : 0);
  }
  for (const ValueInfo& v : g.inputs) value_info(graph.child(11), v);
  for (const ValueInfo& v : g.outputs) value_info(graph.child(12), v);
  m.child(8).string(1, "").int64(2, info.opset);
  for (const auto& [k, v] : info.metadata) m.entry(14, k, v);
}

void check_tensor(const Tensor& t) {
  uint64_t n = 1;
  for (int64_t d : t.dims) {
    LATHE_CHECK(d >= 0, "internal: ONNX tensor '{}' has a negative dimension {}", t.name, d);
    n *= static_cast<uint64_t>(d);
  }
  LATHE_CHECK(n * elem_size(t.type) == t.data.size(), "internal: ONNX tensor '{}' has {} bytes for {} {} elements",
              t.name, t.data.size(), n, elem_name(t.type));
}

}  // namespace

std::string external_data_name(const std::string& model_file, uint64_t hash) {
  return model_file + "." + hex64(hash) + ".data";
}

bool is_external_data_name(const std::string& model_file, const std::string& name) {
  const std::string pre = model_file + ".", suf = ".data";
  if (name.size() != pre.size() + 16 + suf.size() || name.compare(0, pre.size(), pre) != 0 ||
      name.compare(name.size() - suf.size(), suf.size(), suf) != 0)
    return false;
  const std::string mid = name.substr(pre.size(), 16);
  return mid.find_first_not_of("0123456789abcdef") == std::string::npos;
}

namespace {
// "<path>.tmp" and the "<data file>.tmp" of an earlier export to `path` that was killed.
void remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  const std::string file = p.filename().string();
  std::error_code ec;
  fs::remove(path + ".tmp", ec);
  fs::remove(path + ".data.tmp", ec);  // the fixed name of earlier versions
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0 &&
        is_external_data_name(file, n.substr(0, n.size() - 4)))
      fs::remove(it->path(), ec);
  }
}

// Data files of `path`'s naming other than `keep` (the one the graph just written names; "" for an
// inline graph): left by earlier exports, or by one killed between its two renames.
void remove_stale_external_data(const std::string& path, const std::string& keep) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  const std::string file = p.filename().string();
  std::error_code ec;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n != keep && is_external_data_name(file, n)) stale.push_back(it->path());
  }
  for (const auto& s : stale) fs::remove(s, ec);
}

void check_interrupt(const std::string& path) {
  if (const int sig = stop_signal())
    throw_error("{}: interrupted by {} before the file was complete; nothing was written (temporary files removed)",
                path, signal_name(sig));
}
}  // namespace

WriteResult write_model(const std::string& path, const Graph& graph, const ModelProtoInfo& info,
                        const WriteOptions& opts) {
  for (const Tensor& t : graph.initializers) check_tensor(t);
  for (const Node& n : graph.nodes)
    for (const Attribute& a : n.attributes)
      if (a.kind == Attribute::TensorValue) check_tensor(a.t);

  // Inline first; external when asked or when the message would exceed what protobuf can parse.
  bool external = opts.external_data;
  const std::vector<uint64_t> none(graph.initializers.size(), 0);
  if (!external) {
    Message probe;
    model_proto(probe, graph, info, nullptr, none, 0);
    external = probe.size() > std::min(opts.inline_limit, kProtoLimit);
  }
  WriteResult r;
  remove_stale_temporaries(path);
  std::vector<uint64_t> offsets(graph.initializers.size(), 0);
  std::string location;
  std::unique_ptr<AtomicFileWriter> data;
  if (external) {
    // The data file's bytes: 64-byte aligned tensors (mmap-friendly), emitted twice (hash, write).
    auto layout = [&](const std::function<void(const void*, size_t)>& emit) {
      static const char zeros[64] = {};
      uint64_t off = 0;
      for (size_t i = 0; i < graph.initializers.size(); ++i) {
        const Tensor& t = graph.initializers[i];
        if (t.data.size() < opts.external_min_bytes) continue;
        const uint64_t pad = (64 - off % 64) % 64;
        emit(zeros, pad);
        off += pad;
        offsets[i] = off;
        check_interrupt(path);
        emit(t.data.data(), t.data.size());
        off += t.data.size();
      }
      return off;
    };
    Xxh64 h;
    layout([&](const void* p, size_t n) { h.update(p, n); });
    location = external_data_name(std::filesystem::path(path).filename().string(), h.digest());
    r.data_path = (std::filesystem::path(path).parent_path() / location).string();
    data = std::make_unique<AtomicFileWriter>(r.data_path);
    r.data_bytes = layout([&](const void* p, size_t n) { data->write(p, n); });
  }
  Message m;
  model_proto(m, graph, info, external ? &location : nullptr, offsets, opts.external_min_bytes);
  r.model_bytes = m.size();
  LATHE_CHECK(r.model_bytes <= kProtoLimit,
              "{}: the ONNX graph without its weights is {} bytes, above the 2 GiB protobuf limit", path,
              r.model_bytes);
  AtomicFileWriter out(path);
  auto sink = [&](const void* p, size_t n) { out.write(p, n); };
  m.write(sink);
  // Publication order: the data file first, under a name no earlier graph uses (its content hash),
  // then the graph by rename over `path`. A kill between the two leaves the old graph with its old
  // data file (plus an unreferenced new one, removed by the next export); never a mismatched pair.
  check_interrupt(path);
  if (data) data->commit();
  out.commit();
  remove_stale_external_data(path, location);
  return r;
}

}  // namespace lathe::io::onnx
