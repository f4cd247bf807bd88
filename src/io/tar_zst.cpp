#include "io/tar_zst.h"

#include <fmt/format.h>
#include <zstd.h>

#include <cstring>
#include <fstream>
#include <vector>

#include "core/error.h"

namespace lathe::io {

namespace {

constexpr size_t kBlock = 512;

void octal(char* field, size_t width, uint64_t v) {  // width-1 digits and a NUL
  const std::string s = fmt::format("{:0{}o}", v, width - 1);
  std::memcpy(field, s.data(), width - 1);
  field[width - 1] = '\0';
}

// The ustar header of a regular file: the name in `name` (<= 100 bytes) or split at a '/' into
// prefix (<= 155) and name.
}  // namespace

std::string ustar_header(const std::string& name, uint64_t size) {
  char h[kBlock] = {0};
  std::string prefix, base = name;
  if (name.size() > 100) {
    const size_t cut = name.rfind('/', 155);
    LATHE_CHECK(cut != std::string::npos && cut > 0 && name.size() - cut - 1 <= 100 && name.size() - cut - 1 > 0,
                "{}: a path too long for a ustar archive (at most 155 + 100 bytes split at a '/')", name);
    prefix = name.substr(0, cut);
    base = name.substr(cut + 1);
  }
  std::memcpy(h, base.data(), base.size());
  octal(h + 100, 8, 0644);
  octal(h + 108, 8, 0);
  octal(h + 116, 8, 0);
  if (size < (uint64_t{1} << 33)) {
    octal(h + 124, 12, size);
  } else {  // 8 GiB and more: the base-256 size of GNU tar and star (big-endian, first byte 0x80)
    h[124] = static_cast<char>(0x80);
    for (int i = 0; i < 8; ++i) h[135 - i] = static_cast<char>((size >> (8 * i)) & 0xFF);
  }
  octal(h + 136, 12, 0);  // mtime: fixed, for reproducible archives
  std::memset(h + 148, ' ', 8);
  h[156] = '0';
  std::memcpy(h + 257, "ustar", 6);
  std::memcpy(h + 263, "00", 2);
  std::memcpy(h + 345, prefix.data(), prefix.size());
  unsigned sum = 0;
  for (size_t i = 0; i < kBlock; ++i) sum += static_cast<unsigned char>(h[i]);
  const std::string c = fmt::format("{:06o}", sum);
  std::memcpy(h + 148, c.data(), 6);
  h[154] = '\0';
  h[155] = ' ';
  return std::string(h, kBlock);
}

namespace {

uint64_t parse_octal(const char* f, size_t width) {
  uint64_t v = 0;
  for (size_t i = 0; i < width && f[i] >= '0' && f[i] <= '7'; ++i) v = v * 8 + static_cast<uint64_t>(f[i] - '0');
  return v;
}

}  // namespace

uint64_t ustar_size(const char* header) {
  const auto* f = reinterpret_cast<const unsigned char*>(header + 124);
  if (f[0] != 0x80) return parse_octal(header + 124, 12);
  uint64_t v = 0;
  for (int i = 1; i < 12; ++i) v = v << 8 | f[i];
  return v;
}

TarZstWriter::TarZstWriter(const std::string& path, int level) : out_(path), cctx_(ZSTD_createCCtx()) {
  LATHE_CHECK(cctx_ != nullptr, "{}: ZSTD_createCCtx failed (out of memory?)", path);
  ZSTD_CCtx_setParameter(cctx_, ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(cctx_, ZSTD_c_checksumFlag, 1);
  ZSTD_CCtx_setParameter(cctx_, ZSTD_c_nbWorkers, 0);  // one thread: the same bytes every time
  obuf_.resize(ZSTD_CStreamOutSize());
}

TarZstWriter::~TarZstWriter() { ZSTD_freeCCtx(cctx_); }

void TarZstWriter::compress(const void* data, size_t n, bool end) {
  ZSTD_inBuffer in{data, n, 0};
  for (;;) {
    ZSTD_outBuffer o{obuf_.data(), obuf_.size(), 0};
    const size_t left = ZSTD_compressStream2(cctx_, &o, &in, end ? ZSTD_e_end : ZSTD_e_continue);
    LATHE_CHECK(!ZSTD_isError(left), "{}: zstd compression failed: {}", out_.path(), ZSTD_getErrorName(left));
    out_.write(obuf_.data(), o.pos);
    if (end ? left == 0 : in.pos == in.size) break;
  }
}

void TarZstWriter::put(const void* data, size_t n) {
  compress(data, n, false);
  tar_bytes_ += n;
}

void TarZstWriter::add(const std::string& name, uint64_t size,
                       const std::function<void(const std::function<void(const void*, size_t)>&)>& fill) {
  const std::string h = ustar_header(name, size);
  put(h.data(), h.size());
  uint64_t wrote = 0;
  fill([&](const void* p, size_t n) {
    put(p, n);
    wrote += n;
  });
  LATHE_CHECK(wrote == size,
              "{}: {} bytes written to the archive, {} expected (did the file change while it was "
              "archived?)",
              name, wrote, size);
  static const char zeros[kBlock] = {0};
  if (size % kBlock) put(zeros, kBlock - size % kBlock);
}

void TarZstWriter::add(const std::string& name, std::string_view data) {
  add(name, data.size(), [&](const auto& write) { write(data.data(), data.size()); });
}

void TarZstWriter::finish() {
  static const char zeros[2 * kBlock] = {0};
  put(zeros, sizeof(zeros));
  compress(nullptr, 0, true);
  out_.commit();
}

void read_tar_zst(const std::string& path, const TarVisitor& v) {
  std::ifstream f(path, std::ios::binary);
  LATHE_CHECK(f.good(), "{}: cannot open the archive", path);
  std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> d(ZSTD_createDCtx(), ZSTD_freeDCtx);
  std::vector<char> ibuf(ZSTD_DStreamInSize()), obuf(ZSTD_DStreamOutSize());
  // The tar parser: a header block, then `left` data bytes, then padding to the block.
  std::string hdr;
  uint64_t left = 0, pad = 0, consumed = 0;
  bool in_member = false, ended = false;
  auto feed = [&](const char* p, size_t n) {
    while (n > 0 && !ended) {
      if (in_member && left > 0) {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(left, n));
        v.on_data(p, k);
        p += k, n -= k, left -= k;
        if (left == 0) v.on_end();
        continue;
      }
      if (pad > 0) {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(pad, n));
        p += k, n -= k, pad -= k;
        continue;
      }
      const size_t k = std::min(kBlock - hdr.size(), n);
      hdr.append(p, k);
      p += k, n -= k;
      if (hdr.size() < kBlock) continue;
      if (hdr.find_first_not_of('\0') == std::string::npos) {
        ended = true;  // the end-of-archive block
        break;
      }
      unsigned sum = 0;
      for (size_t i = 0; i < kBlock; ++i) sum += (i >= 148 && i < 156) ? ' ' : static_cast<unsigned char>(hdr[i]);
      LATHE_CHECK(sum == parse_octal(hdr.data() + 148, 8),
                  "{}: the tar header at byte {} of the archive's data has a bad checksum (the archive is damaged)",
                  path, consumed);
      LATHE_CHECK(hdr[156] == '0' || hdr[156] == '\0',
                  "{}: member at byte {} is not a regular file (type '{}'); "
                  "lathe archives hold only files",
                  path, consumed, hdr[156]);
      const std::string prefix(hdr.data() + 345, strnlen(hdr.data() + 345, 155));
      const std::string base(hdr.data(), strnlen(hdr.data(), 100));
      const std::string name = prefix.empty() ? base : prefix + "/" + base;
      left = ustar_size(hdr.data());
      pad = (kBlock - left % kBlock) % kBlock;
      consumed += kBlock + left + pad;
      hdr.clear();
      in_member = true;
      v.on_member(name, left);
      if (left == 0) v.on_end();
    }
  };
  size_t last = 0;
  uint64_t read = 0;
  while (f) {
    f.read(ibuf.data(), static_cast<std::streamsize>(ibuf.size()));
    const size_t got = static_cast<size_t>(f.gcount());
    if (got == 0) break;
    ZSTD_inBuffer in{ibuf.data(), got, 0};
    while (in.pos < in.size) {
      ZSTD_outBuffer o{obuf.data(), obuf.size(), 0};
      last = ZSTD_decompressStream(d.get(), &o, &in);
      LATHE_CHECK(
          !ZSTD_isError(last),
          "{}: zstd decompression failed near compressed byte {}: {} (the archive is damaged or not a .tar.zst)", path,
          read + in.pos, ZSTD_getErrorName(last));
      feed(obuf.data(), o.pos);
    }
    read += got;
  }
  LATHE_CHECK(last == 0 && read > 0,
              "{}: truncated: the zstd frame ends early after {} bytes (the archive is "
              "incomplete; write it again)",
              path, read);
  LATHE_CHECK(ended && left == 0,
              "{}: the tar stream ends without its end-of-archive blocks (the archive is incomplete)", path);
}

}  // namespace lathe::io
