#include "io/safetensors.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "io/direct_writer.h"
#include "io/fs.h"
#include "io/json.h"

namespace lathe::io {

namespace {

constexpr uint64_t kMaxHeader = 100'000'000;  // MAX_HEADER_SIZE of the reference reader

// Every dtype code of the spec (§3) with its bit size; lathe maps the ones it can represent.
struct DtypeCode {
  const char* code;
  int bits;
};
constexpr DtypeCode kCodes[] = {{"BOOL", 8},        {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},
                                {"I8", 8},          {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},
                                {"F8_E5M2FNUZ", 8}, {"I16", 16},    {"U16", 16},    {"F16", 16},    {"BF16", 16},
                                {"I32", 32},        {"U32", 32},    {"F32", 32},    {"C64", 64},    {"F64", 64},
                                {"I64", 64},        {"U64", 64}};

int code_bits(std::string_view code) {
  for (auto& c : kCodes)
    if (code == c.code) return c.bits;
  return 0;
}

bool lathe_dtype(std::string_view code, DType* out) {
  static const std::pair<const char*, DType> m[] = {{"F32", DType::F32}, {"BF16", DType::BF16}, {"F16", DType::F16},
                                                    {"I32", DType::I32}, {"U16", DType::U16},   {"I64", DType::I64},
                                                    {"U8", DType::U8},   {"F64", DType::F64}};
  for (auto& [c, d] : m)
    if (code == c) {
      *out = d;
      return true;
    }
  return false;
}

// Non-negative integer that fits in 64 bits (JSON numbers like 3.0 or -1 are rejected).
bool as_u64(const nlohmann::json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

// A name or code from the header for an error message (a hostile header can hold a 100 MB key).
std::string excerpt(std::string_view s, size_t max_chars = 120) {
  if (s.size() <= max_chars) return std::string(s);
  return std::string(s.substr(0, max_chars)) + "...";
}

// The bytes around the JSON object. The format pads the header with spaces (0x20); the reference
// reader (serde_json) also accepts the other JSON whitespace around the object (\t \n \r), so
// lathe does too. Anything else is refused with its offset: nlohmann stops at a NUL byte, so
// before this check "{...}\0<anything>" loaded, with the bytes after the NUL silently ignored
// (hidden data in a file that looks valid).
void check_header_bytes(const std::string& path, std::string_view h) {
  const size_t nul = h.find('\0');
  if (nul != std::string_view::npos)
    throw_error(
        "{}: header byte {} (file offset {}) is a NUL byte; a safetensors header is JSON padded with spaces "
        "(0x20) only: the file is corrupt or hides data in its header",
        path, nul, 8 + nul);
  const size_t close = h.find_last_of('}');
  if (close == std::string_view::npos) return;  // not an object: the parser says so
  const size_t junk = h.find_first_not_of(" \t\n\r", close + 1);
  if (junk != std::string_view::npos)
    throw_error(
        "{}: header byte {} (file offset {}) is 0x{:02x} after the end of the JSON object; only spaces (0x20) "
        "may pad the header: the file is corrupt or hides data in its header",
        path, junk, 8 + junk, static_cast<unsigned char>(h[junk]));
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  // open_input: only a regular file (a FIFO in place of model.safetensors would block forever,
  // a directory fails later in mmap with "No such device"); symlink loops are named.
  int fd = open_input(path, &file_size_);
  if (file_size_ < 8) {
    ::close(fd);
    throw_error("{}: not a safetensors file: {} bytes, shorter than the 8-byte header length", path, file_size_);
  }
  void* p = ::mmap(nullptr, file_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw_error("{}: mmap failed: {}", path, std::strerror(err));
  base_ = static_cast<const unsigned char*>(p);

  try {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | base_[i];  // little-endian u64
    if (n > kMaxHeader)
      throw_error("{}: header length {} exceeds the 100 MB limit of the format (corrupt file?)", path, n);
    if (n > file_size_ - 8)
      throw_error(
          "{}: header length {} runs past the end of the file ({} bytes): truncated or not a "
          "safetensors file",
          path, n, file_size_);
    header_len_ = static_cast<size_t>(n);
    const char* hdr = reinterpret_cast<const char*>(base_ + 8);
    const std::string_view text(hdr, header_len_);
    check_header_bytes(path, text);
    // Before parsing: nlohmann parses iteratively, but the excerpts in the messages below and the
    // callers' copies recurse (a 60,000-level array in __metadata__ overflowed the stack).
    check_json_depth(text, path + " (safetensors header)");

    // nlohmann::json keeps the last of duplicate keys silently; the format forbids duplicates
    // (a lost entry could hide a polyglot payload), so track keys per object while parsing.
    std::vector<std::set<std::string>> keys;
    std::string dup;
    auto cb = [&](int /*depth*/, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
      using E = nlohmann::json::parse_event_t;
      if (ev == E::object_start) {
        keys.emplace_back();
      } else if (ev == E::object_end) {
        if (!keys.empty()) keys.pop_back();
      } else if (ev == E::key && !keys.empty()) {
        auto k = parsed.get<std::string>();
        if (!keys.back().insert(k).second && dup.empty()) dup = k;
      }
      return true;
    };
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(hdr, hdr + header_len_, cb);
    } catch (const nlohmann::json::exception& e) {
      // nlohmann quotes the whole last token ("last read: ..."), which can be megabytes long.
      std::string m = e.what();
      if (m.size() > 400) m = m.substr(0, 250) + " ... " + m.substr(m.size() - 100);
      throw_error("{}: header is not valid JSON: {}", path, m);
    }
    if (!dup.empty()) throw_error("{}: header has the key '{}' more than once", path, excerpt(dup));
    if (!header.is_object()) throw_error("{}: header JSON must be an object, got {}", path, json_type_name(header));

    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const std::string shown = excerpt(name);  // a name can be megabytes long
      const auto& v = it.value();
      if (name == "__metadata__") {
        if (!v.is_object())
          throw_error("{}: __metadata__ must be an object of strings, got {}", path, json_type_name(v));
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string())
            throw_error("{}: __metadata__['{}'] must be a string, got {}", path, excerpt(m.key()),
                        json_excerpt(m.value()));
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      if (!v.is_object() || v.size() != 3 || !v.contains("dtype") || !v.contains("shape") ||
          !v.contains("data_offsets"))
        throw_error(
            "{}: tensor '{}': entry must be an object with exactly dtype, shape, "
            "data_offsets; got {}",
            path, shown, json_excerpt(v));
      StTensorInfo t;
      t.name = name;
      if (!v["dtype"].is_string())
        throw_error("{}: tensor '{}': dtype must be a string, got {}", path, shown, json_excerpt(v["dtype"]));
      t.dtype_code = v["dtype"].get<std::string>();
      int bits = code_bits(t.dtype_code);
      if (bits == 0)
        throw_error("{}: tensor '{}': unknown dtype '{}' (not a safetensors dtype code)", path, shown,
                    excerpt(t.dtype_code));
      t.dtype_supported = lathe_dtype(t.dtype_code, &t.dtype);
      if (!t.dtype_supported) t.dtype = DType::U8;
      if (!v["shape"].is_array())
        throw_error("{}: tensor '{}': shape must be an array, got {}", path, shown, json_excerpt(v["shape"]));
      // numel * bits with overflow checks (the reference reader's ValidationOverflow). The product
      // of the non-zero dimensions is bounded too: numel() multiplies left to right in int64, so
      // [2^48, 2^48, 0] (0 bytes, valid offsets) would overflow there.
      unsigned __int128 total_bits = static_cast<unsigned __int128>(bits), nonzero = 1;
      for (const auto& d : v["shape"]) {
        uint64_t dim;
        if (!as_u64(d, &dim) || dim > (uint64_t{1} << 48))
          throw_error("{}: tensor '{}': shape entries must be non-negative integers up to 2^48, got {}", path, shown,
                      json_excerpt(v["shape"]));
        t.shape.push_back(static_cast<int64_t>(dim));
        total_bits *= dim;
        if (dim) nonzero *= dim;
        if (nonzero > (static_cast<unsigned __int128>(1) << 62))
          throw_error("{}: tensor '{}': shape {} has more than 2^62 elements", path, shown, json_excerpt(v["shape"]));
      }
      // Also bounds the byte count below 2^64 before it is narrowed.
      if (total_bits / 8 > file_size_)
        throw_error("{}: tensor '{}': dtype {} with shape {} needs more bytes than the whole file ({} bytes)", path,
                    shown, t.dtype_code, json_excerpt(v["shape"]), file_size_);
      if (total_bits % 8 != 0)
        throw_error("{}: tensor '{}': {} elements of {} bits is not a whole number of bytes", path, shown,
                    numel(t.shape), t.dtype_code);
      const auto& off = v["data_offsets"];
      uint64_t b, e;
      if (!off.is_array() || off.size() != 2 || !as_u64(off[0], &b) || !as_u64(off[1], &e))
        throw_error("{}: tensor '{}': data_offsets must be [BEGIN, END] non-negative integers, got {}", path, shown,
                    json_excerpt(off));
      if (e < b) throw_error("{}: tensor '{}': data_offsets [{}, {}] end before they begin", path, shown, b, e);
      uint64_t expect = static_cast<uint64_t>(total_bits / 8);
      if (e - b != expect)
        throw_error(
            "{}: tensor '{}': data_offsets [{}, {}] hold {} bytes but dtype {} with shape {} "
            "needs {}",
            path, shown, b, e, e - b, t.dtype_code, shape_str(t.shape), expect);
      t.data_offset = static_cast<size_t>(b);
      t.nbytes = static_cast<size_t>(e - b);
      tensors_.push_back(std::move(t));
    }

    // Sort by offset and walk: the buffer must be covered exactly, no gap, no overlap.
    std::stable_sort(tensors_.begin(), tensors_.end(), [](const StTensorInfo& a, const StTensorInfo& b) {
      return a.data_offset != b.data_offset ? a.data_offset < b.data_offset : a.nbytes < b.nbytes;
    });
    size_t pos = 0;
    for (const auto& t : tensors_) {
      if (t.data_offset != pos) {
        if (t.data_offset < pos)
          throw_error(
              "{}: tensor '{}': data_offsets [{}, {}] overlap the previous tensor, which ends "
              "at {}",
              path, t.name, t.data_offset, t.data_offset + t.nbytes, pos);
        throw_error(
            "{}: tensor '{}': data_offsets [{}, {}] leave a gap after byte {} of the data "
            "section",
            path, t.name, t.data_offset, t.data_offset + t.nbytes, pos);
      }
      pos += t.nbytes;
    }
    size_t data_size = file_size_ - 8 - header_len_;
    if (pos != data_size) {
      if (pos > data_size) {
        // Name the first tensor that runs past the end.
        for (const auto& t : tensors_)
          if (t.data_offset + t.nbytes > data_size)
            throw_error(
                "{}: tensor '{}': data_offsets [{}, {}] run past the end of the data section "
                "({} bytes): the file is truncated",
                path, t.name, t.data_offset, t.data_offset + t.nbytes, data_size);
      }
      throw_error("{}: data section has {} bytes but the tensors cover {} (trailing bytes)", path, data_size, pos);
    }
    for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  } catch (...) {
    ::munmap(const_cast<unsigned char*>(base_), file_size_);
    base_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (base_) ::munmap(const_cast<unsigned char*>(base_), file_size_);
}

const StTensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const void* SafetensorsFile::data(const StTensorInfo& t) const {
  LATHE_CHECK(t.dtype_supported, "{}: tensor '{}': dtype {} is not supported by lathe", path_, t.name, t.dtype_code);
  LATHE_CHECK(t.data_offset + t.nbytes <= file_size_ - 8 - header_len_, "{}: tensor '{}' does not belong to this file",
              path_, t.name);
  return base_ + 8 + header_len_ + t.data_offset;
}

void SafetensorsFile::read_f32(const StTensorInfo& t, float* out) const {
  const auto* src = static_cast<const unsigned char*>(data(t));
  size_t n = static_cast<size_t>(numel(t.shape));
  if (n == 0) return;  // `out` may be null for an empty tensor
  switch (t.dtype) {
    case DType::F32:
      std::memcpy(out, src, n * 4);
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = bf16_to_fp32(h);
      }
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = fp16_to_fp32(h);
      }
      return;
    default:
      throw_error("{}: tensor '{}': dtype {} cannot be read as fp32 (only F32, BF16, F16)", path_, t.name,
                  t.dtype_code);
  }
}

namespace {

struct PlannedTensor {
  std::string name;
  DType dtype;
  Shape shape;
  size_t nbytes;
};

// Header JSON text for tensors laid out back to back in the given order, padded with spaces until
// the data section (file offset 8 + N) is congruent to `residue` modulo `align` (align 8, residue
// 0: N a multiple of 8).
std::string build_header(const std::string& path, const std::vector<PlannedTensor>& ts,
                         const std::map<std::string, std::string>& metadata, size_t align = 8, size_t residue = 0) {
  std::set<std::string> seen;
  std::string h = "{";
  std::map<std::string, std::string> meta = metadata;
  if (!meta.count("format")) meta["format"] = "pt";
  h += "\"__metadata__\":{";
  bool first = true;
  for (auto& [k, v] : meta) {
    if (!first) h += ",";
    first = false;
    h += nlohmann::json(k).dump() + ":" + nlohmann::json(v).dump();
  }
  h += "}";
  size_t off = 0;
  for (const auto& t : ts) {
    LATHE_CHECK(t.name != "__metadata__", "{}: '__metadata__' cannot be a tensor name", path);
    LATHE_CHECK(!t.name.empty(), "{}: empty tensor name", path);
    LATHE_CHECK(seen.insert(t.name).second, "{}: tensor '{}' given twice", path, t.name);
    for (auto d : t.shape)
      LATHE_CHECK(d >= 0, "{}: tensor '{}': negative dimension in shape {}", path, t.name, shape_str(t.shape));
    h += ",";
    h += nlohmann::json(t.name).dump();
    h += ":{\"dtype\":\"";
    h += dtype_name(t.dtype);
    h += "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i) h += ",";
      h += std::to_string(t.shape[i]);
    }
    h += "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + t.nbytes) + "]}";
    off += t.nbytes;
  }
  h += "}";
  while ((8 + h.size()) % align != residue) h += ' ';  // every residue is reached within `align` spaces
  LATHE_CHECK(h.size() <= kMaxHeader, "{}: header of {} bytes exceeds the 100 MB format limit", path, h.size());
  return h;
}

template <class Writer>
void write_prefix(Writer& w, const std::string& header) {
  uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  w.write(len, 8);
  w.write(header.data(), header.size());
}

std::vector<PlannedTensor> plan_entries(const std::string& path, const std::vector<StWriteEntry>& tensors) {
  std::vector<PlannedTensor> plan;
  for (const auto& t : tensors) {
    size_t nb = static_cast<size_t>(numel(t.shape)) * dtype_size(t.dtype);
    LATHE_CHECK(t.data != nullptr || nb == 0, "{}: tensor '{}': null data", path, t.name);
    plan.push_back({t.name, t.dtype, t.shape, nb});
  }
  return plan;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<StWriteEntry>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::vector<PlannedTensor> plan = plan_entries(path, tensors);
  std::string header = build_header(path, plan, metadata);
  AtomicFileWriter w(path);
  write_prefix(w, header);
  for (size_t i = 0; i < tensors.size(); ++i)
    if (plan[i].nbytes) w.write(tensors[i].data, plan[i].nbytes);
  w.commit();
}

WrittenFile write_safetensors_aligned(const std::string& path, const std::vector<StWriteEntry>& tensors, StAlign align,
                                      const std::map<std::string, std::string>& metadata) {
  constexpr size_t A = DirectWriter::kAlign;
  const std::vector<PlannedTensor> given = plan_entries(path, tensors);
  const bool follow = align == StAlign::Addresses;
  // With pads: the planned tensors and their sources in file order.
  std::vector<PlannedTensor> plan;
  std::vector<const void*> src;
  static const std::vector<char> zeros(A, 0);
  const uintptr_t first = tensors.empty() || !follow ? 0 : reinterpret_cast<uintptr_t>(tensors[0].data);
  size_t off = 0;  // data-section offset
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (follow && i > 0 && t.data != static_cast<const char*>(tensors[i - 1].data) + given[i - 1].nbytes) {
      // Want (data_start + off) % A == addr % A with data_start % A == first % A.
      const size_t pad = (reinterpret_cast<uintptr_t>(t.data) - first - off) % A;
      if (pad) {
        plan.push_back({std::string(kStPadPrefix) + t.name, DType::U8, Shape{static_cast<int64_t>(pad)}, pad});
        src.push_back(zeros.data());
        off += pad;
      }
    }
    plan.push_back(given[i]);
    src.push_back(t.data);
    off += given[i].nbytes;
  }
  const std::string header = build_header(path, plan, metadata, A, first % A);
  DirectWriter w(path);
  write_prefix(w, header);
  for (size_t i = 0; i < plan.size(); ++i) w.write(src[i], plan[i].nbytes);
  return w.commit();
}

void write_safetensors_f32(const std::string& path, const std::vector<StWriteF32>& tensors, DType out_dtype,
                           const std::map<std::string, std::string>& metadata, const std::function<void()>& on_tensor) {
  LATHE_CHECK(out_dtype == DType::F32 || out_dtype == DType::BF16 || out_dtype == DType::F16,
              "{}: write_safetensors_f32 converts to F32, BF16 or F16 only, not {}", path, dtype_name(out_dtype));
  std::vector<PlannedTensor> plan;
  for (const auto& t : tensors) {
    size_t n = static_cast<size_t>(numel(t.shape));
    LATHE_CHECK(t.data != nullptr || n == 0, "{}: tensor '{}': null data", path, t.name);
    plan.push_back({t.name, out_dtype, t.shape, n * dtype_size(out_dtype)});
  }
  std::string header = build_header(path, plan, metadata);
  AtomicFileWriter w(path);
  write_prefix(w, header);
  std::vector<uint16_t> chunk(1 << 16);
  for (const auto& t : tensors) {
    size_t n = static_cast<size_t>(numel(t.shape));
    if (out_dtype == DType::F32) {
      if (n) w.write(t.data, n * 4);
    } else {
      for (size_t i = 0; i < n; i += chunk.size()) {
        size_t m = std::min(chunk.size(), n - i);
        if (out_dtype == DType::BF16)
          for (size_t j = 0; j < m; ++j) chunk[j] = fp32_to_bf16(t.data[i + j]);
        else
          for (size_t j = 0; j < m; ++j) chunk[j] = fp32_to_fp16(t.data[i + j]);
        w.write(chunk.data(), m * 2);
      }
    }
    if (on_tensor) on_tensor();
  }
  w.commit();
}

}  // namespace lathe::io
