// Small filesystem helpers shared by everything that writes files. Every file lathe produces is
// written to "<path>.tmp", fsync'ed, renamed over <path>, and the directory is fsync'ed, so a crash
// leaves either the old file or the new one, never a torn one.
#pragma once
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace lathe::io {

// Write `contents` to path atomically (tmp + fsync + rename + fsync dir). Errors name the path.
void atomic_write_file(const std::string& path, std::string_view contents);
// fsync a directory so that a rename inside it is durable. Errors name the directory.
void fsync_dir(const std::string& dir);
// Whole file as bytes (only a regular file, see open_input). Errors name the path.
std::string read_file(const std::string& path);
// Reads `fd` (from open_input) to its end in pieces of at most `chunk` bytes, handing each to
// on_chunk, and closes it (also when an error unwinds). Returns the byte count. Errors name `path`.
size_t read_to_end(int fd, const std::string& path, size_t chunk,
                   const std::function<void(const char*, size_t)>& on_chunk);
// True when anything (even a broken or looping symlink) is at `path`, or when that cannot be told
// (any lstat error but ENOENT): "missing" messages are only given when nothing is there.
bool entry_present(const std::string& path);
// Opens an input file read-only and returns the fd (O_CLOEXEC, blocking). Only a regular file is
// accepted: a FIFO (which would block forever), a directory, a device or a socket is refused with
// its kind named; a symlink loop, a missing file or a permission problem names the path. `size`
// receives the file size when non-null. Every reader of user-supplied files opens through this.
int open_input(const std::string& path, size_t* size = nullptr);
// The same check without keeping the file open (for paths handed to libraries that open them).
void require_regular_file(const std::string& path);
// "a directory", "a FIFO (named pipe)", ... for a st_mode that is not a regular file.
const char* file_kind(unsigned mode);
// Directory part of a path ("." when there is none).
std::string parent_dir(const std::string& path);

// ---- outputs that must not overwrite inputs -----------------------------------------------
// Absolute, normalised form of a path that may not exist yet: the existing part's symlinks are
// resolved (std::filesystem::weakly_canonical), "." and ".." removed, no trailing slash. Never
// throws: an unreadable component keeps the lexical form.
std::string canonical_path(const std::string& path);
// True when both name the same file or directory: equal canonical paths, or (both existing) the
// same inode (a hard link).
bool same_path(const std::string& a, const std::string& b);
// True when `path` is `dir` or lies anywhere below it (canonical paths, component-wise).
bool path_within(const std::string& path, const std::string& dir);

// A path a command reads or writes, with the option that named it ("--to-onnx", "the source").
struct PathUse {
  enum Kind {
    File,  // one file or directory: an output may not be it
    Dir,   // a directory whose every path is input: nothing may be written inside it either
  };
  std::string path;
  std::string what;
  Kind kind = File;
};
// Every writing command calls this before it writes anything. Refuses (naming both options and
// paths) an output that is one of the inputs, lies inside an input Dir, or names the same path
// as another output. Empty output paths are refused too ("--to \"\""
// would write into the current directory).
void check_output_paths(const std::vector<PathUse>& inputs, const std::vector<PathUse>& outputs);

// Streaming version of atomic_write_file for large outputs (safetensors, checkpoints):
//   AtomicFileWriter w(path); w.write(p, n); ...; w.commit();
// Writes are buffered; commit() flushes, fsyncs, renames and fsyncs the directory. If the writer
// is destroyed without commit() (an exception unwound past it), the temporary file is removed and
// `path` is left untouched.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(const std::string& path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t n);
  void commit();
  size_t bytes_written() const { return written_; }
  const std::string& path() const { return path_; }

 private:
  void flush();
  std::string path_, tmp_;
  int fd_ = -1;
  std::string buf_;
  size_t written_ = 0;
  bool committed_ = false;
};

}  // namespace lathe::io
