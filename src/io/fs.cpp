#include "io/fs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/stop_signal.h"

namespace lathe::io {

namespace {
std::string errno_str() { return std::strerror(errno); }

void write_all(int fd, const char* p, size_t n, const std::string& what) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_error("{}: write failed: {}", what, errno_str());
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}
}  // namespace

std::string parent_dir(const std::string& path) {
  auto pos = path.find_last_of('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return path.substr(0, pos);
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_error("{}: cannot open directory to fsync it: {}", dir, errno_str());
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some filesystems (e.g. certain network/overlay mounts) refuse fsync on directories with
  // EINVAL; the data itself was already fsync'ed, so that case is not an error.
  if (rc != 0 && err != EINVAL) throw_error("{}: fsync of directory failed: {}", dir, std::strerror(err));
}

const char* file_kind(unsigned mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

int open_input(const std::string& path, size_t* size) {
  // O_NONBLOCK: opening a FIFO with no writer would otherwise block here forever.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    if (err == ELOOP) throw_error("{}: cannot open: too many levels of symbolic links (a symlink loop?)", path);
    if (err == ENOENT) throw_error("{}: no such file", path);
    throw_error("{}: cannot open: {}", path, std::strerror(err));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw_error("{}: fstat failed: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw_error("{}: is {}, not a regular file; give the path of a file", path, file_kind(st.st_mode));
  }
  int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  if (size) *size = static_cast<size_t>(st.st_size);
  return fd;
}

void require_regular_file(const std::string& path) { ::close(open_input(path)); }

bool entry_present(const std::string& path) {
  struct stat sb;
  return ::lstat(path.c_str(), &sb) == 0 || errno != ENOENT;
}

size_t read_to_end(int fd, const std::string& path, size_t chunk,
                   const std::function<void(const char*, size_t)>& on_chunk) {
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::vector<char> buf(chunk);
  size_t total = 0;
  for (;;) {
    ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_error("{}: read failed: {}", path, errno_str());
    }
    if (r == 0) break;
    on_chunk(buf.data(), static_cast<size_t>(r));
    total += static_cast<size_t>(r);
  }
  return total;
}

std::string read_file(const std::string& path) {
  size_t size = 0;
  int fd = open_input(path, &size);
  std::string out;
  out.reserve(size);
  read_to_end(fd, path, size_t{1} << 16, [&](const char* p, size_t n) { out.append(p, n); });
  return out;
}

std::string canonical_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p = fs::absolute(fs::path(path), ec);
  if (ec) p = fs::path(path);
  fs::path c = fs::weakly_canonical(p, ec);
  if (ec) c = p.lexically_normal();
  std::string s = c.lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

bool same_path(const std::string& a, const std::string& b) {
  if (canonical_path(a) == canonical_path(b)) return true;
  std::error_code ec;
  return std::filesystem::equivalent(a, b, ec) && !ec;  // false when either is missing
}

bool path_within(const std::string& path, const std::string& dir) {
  if (same_path(path, dir)) return true;
  const std::string p = canonical_path(path), d = canonical_path(dir);
  if (d == "/") return true;
  return p.size() > d.size() && p.compare(0, d.size(), d) == 0 && p[d.size()] == '/';
}

void check_output_paths(const std::vector<PathUse>& inputs, const std::vector<PathUse>& outputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const PathUse& o = outputs[i];
    LATHE_CHECK(!o.path.empty(), "{} \"\": an empty path; give the {} to write", o.what,
                o.kind == PathUse::File ? "file" : "directory");
    for (const PathUse& in : inputs) {
      if (same_path(o.path, in.path))
        throw_error("{} {} is {} ({}): it would be overwritten; write to another path", o.what, o.path, in.what,
                    in.path);
      if (in.kind == PathUse::Dir && path_within(o.path, in.path))
        throw_error("{} {} lies inside {} {}: writing there would change the input; write outside it", o.what, o.path,
                    in.what, in.path);
    }
    for (size_t j = 0; j < i; ++j) {
      const PathUse& q = outputs[j];
      if (same_path(o.path, q.path))
        throw_error("{} {} and {} {} are the same path: one output would replace the other; give two paths", q.what,
                    q.path, o.what, o.path);
    }
  }
}

void atomic_write_file(const std::string& path, std::string_view contents) {
  AtomicFileWriter w(path);
  w.write(contents.data(), contents.size());
  w.commit();
}

AtomicFileWriter::AtomicFileWriter(const std::string& path) : path_(path), tmp_(path + ".tmp") {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw_error("{}: cannot create temporary file {}: {} (does the directory exist and is it writable?)", path_, tmp_,
                errno_str());
  buf_.reserve(1 << 20);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFileWriter::flush() {
  if (!buf_.empty()) {
    write_all(fd_, buf_.data(), buf_.size(), tmp_);
    buf_.clear();
  }
}

void AtomicFileWriter::write(const void* data, size_t n) {
  LATHE_CHECK(fd_ >= 0 && !committed_, "{}: write after commit", path_);
  // Under a StopSignalGuard (export, reshard) a SIGINT/SIGTERM stops here; the destructor removes
  // the temporary and `path` keeps what it held.
  if (const int sig = stop_signal())
    throw_error("{}: interrupted by {} while writing it; the temporary {} is removed, {} is unchanged", path_,
                signal_name(sig), tmp_, path_);
  const char* p = static_cast<const char*>(data);
  written_ += n;
  if (buf_.size() + n > buf_.capacity()) flush();
  if (n >= buf_.capacity()) {
    write_all(fd_, p, n, tmp_);
  } else {
    buf_.append(p, n);
  }
}

void AtomicFileWriter::commit() {
  LATHE_CHECK(fd_ >= 0 && !committed_, "{}: commit called twice", path_);
  flush();
  if (::fsync(fd_) != 0) throw_error("{}: fsync failed: {}", tmp_, errno_str());
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) throw_error("{}: close failed: {}", tmp_, errno_str());
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw_error("{}: rename from {} failed: {}", path_, tmp_, errno_str());
  committed_ = true;
  fsync_dir(parent_dir(path_));
}

}  // namespace lathe::io
