// lathe archive RUN --out FILE.tar.zst [--with-model] [--with-checkpoint latest|STEP]
// lathe archive --verify FILE.tar.zst
//
// One reproducible archive of a training run (io/tar_zst.h: ustar, fixed modes, owners and times,
// one single-threaded zstd frame), every member under RUN's name:
//   NAME/MANIFEST          "XXH64  size  path" per member, in archive order (first, so --verify streams)
//   NAME/recipe.yaml, run_info.json, train.log, metrics.jsonl, anomalies.jsonl (those the run wrote)
//   NAME/report.html       the run's own, else `lathe report`'s page made from the run (the same bytes)
//   NAME/tensorboard/...   the event files, when the run wrote them (output.tensorboard)
//   NAME/model/...         with --with-model: the final Hugging Face directory
//   NAME/checkpoints/step_XXXXXXXX/...  with --with-checkpoint: the newest (latest) or that step's,
//                          verified against its own checksums first
// Within a directory the files are sorted by name. The same run gives the same bytes.
// --verify decompresses the archive and checks each member against the MANIFEST (hash, size, none
// missing, none extra), naming every member that differs.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/report_html.h"
#include "core/error.h"
#include "core/progress.h"
#include "io/fs.h"
#include "io/tar_zst.h"
#include "io/xxh64.h"
#include "io/yaml.h"
#include "train/checkpoint.h"

namespace {

namespace fs = std::filesystem;

constexpr const char* kLogs[] = {"recipe.yaml", "run_info.json", "train.log", "metrics.jsonl", "anomalies.jsonl"};
constexpr uint64_t kProgressBytes = 64ull << 20;  // a progress bar from this size on
constexpr size_t kChunk = 4 << 20;

struct Member {
  std::string name;    // inside the archive
  std::string source;  // a file of the run, or "" for `data`
  std::string data;
  uint64_t size = 0;
  std::string hash;
};

// Streams the file `path` in chunks to `fn`; the bytes read.
template <class Fn>
uint64_t read_chunks(const std::string& path, Fn&& fn) {
  std::ifstream f(path, std::ios::binary);
  LATHE_CHECK(f.good(), "{}: cannot read (a file of the run to archive)", path);
  std::vector<char> buf(kChunk);
  uint64_t n = 0;
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const size_t got = static_cast<size_t>(f.gcount());
    if (got == 0) break;
    fn(buf.data(), got);
    n += got;
  }
  LATHE_CHECK(!f.bad(), "{}: read error", path);
  return n;
}

// Every regular file below `dir`, sorted by path, as members named PREFIX/relative path.
void add_tree(std::vector<Member>& m, const fs::path& dir, const std::string& prefix) {
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const fs::path& f : files)
    m.push_back({prefix + "/" + fs::relative(f, dir).generic_string(), f.string(), "", 0, ""});
}

fs::path choose_checkpoint(const fs::path& run, const std::string& which) {
  const auto ck = lathe::list_checkpoints(run.string());
  std::string have;
  for (const auto& [s, d] : ck) have += (have.empty() ? "" : ", ") + std::to_string(s);
  LATHE_CHECK(!ck.empty(),
              "{}: no complete checkpoint in {}/checkpoints (drop --with-checkpoint, or train with "
              "output.checkpoint_every)",
              run.string(), run.string());
  if (which == "latest") return ck.back().second;
  int64_t step = -1;
  try {
    size_t used = 0;
    step = std::stoll(which, &used);
    if (used != which.size()) step = -1;
  } catch (const std::exception&) {
  }
  LATHE_CHECK(step >= 0, "--with-checkpoint {}: expected 'latest' or a step number (this run has steps {})", which,
              have);
  for (const auto& [s, d] : ck)
    if (s == step) return d;
  lathe::throw_error("--with-checkpoint {}: {} has no complete checkpoint of step {} (it has steps {})", which,
                     run.string(), step, have);
}

std::vector<Member> collect(const fs::path& run, const std::string& name, bool with_model, const std::string& ckpt) {
  std::vector<Member> m;
  for (const char* f : kLogs)
    if (fs::is_regular_file(run / f)) m.push_back({name + "/" + f, (run / f).string(), "", 0, ""});
  if (fs::is_regular_file(run / "report.html"))
    m.push_back({name + "/report.html", (run / "report.html").string(), "", 0, ""});
  else if (fs::is_regular_file(run / "metrics.jsonl"))
    m.push_back({name + "/report.html", "", lathe::report::build_html({lathe::report::load_run(run.string())}), 0, ""});
  if (fs::is_directory(run / "tensorboard")) add_tree(m, run / "tensorboard", name + "/tensorboard");
  if (with_model) {
    LATHE_CHECK(fs::is_directory(run / "model"),
                "{}: no model directory (the run has not finished; archive a checkpoint with --with-checkpoint latest)",
                (run / "model").string());
    add_tree(m, run / "model", name + "/model");
  }
  if (!ckpt.empty()) {
    const fs::path dir = choose_checkpoint(run, ckpt);
    lathe::verify_checkpoint(dir.string());  // a damaged checkpoint is not archived as if it were sound
    add_tree(m, dir, name + "/checkpoints/" + dir.filename().string());
  }
  LATHE_CHECK(!m.empty(),
              "{}: not a lathe run directory (no recipe.yaml, metrics.jsonl or train.log; pass the "
              "output.dir of a `lathe train` run)",
              run.string());
  return m;
}

std::string manifest(const std::vector<Member>& m) {
  std::string s = "# lathe archive 1: XXH64 (hex), size in bytes, path of each member after this one\n";
  for (const Member& x : m) s += fmt::format("{}  {}  {}\n", x.hash, x.size, x.name);
  return s;
}

int write_archive(const fs::path& run, const std::string& out, bool with_model, const std::string& ckpt,
                  bool no_progress) {
  LATHE_CHECK(fs::is_directory(run), "{}: not a directory (pass the output.dir of a `lathe train` run)", run.string());
  const fs::path canon = fs::weakly_canonical(run);
  const std::string name = canon.filename().string();
  std::vector<lathe::io::PathUse> in = {
      {run.string() + "/checkpoints", "the run's checkpoints/", lathe::io::PathUse::Dir},
      {run.string() + "/model", "the run's model/", lathe::io::PathUse::Dir},
      {run.string() + "/tensorboard", "the run's tensorboard/", lathe::io::PathUse::Dir}};
  for (const char* f : kLogs) in.push_back({(run / f).string(), fmt::format("the run's {}", f)});
  lathe::io::check_output_paths(in, {{out, "--out"}});
  std::vector<Member> members = collect(run, name, with_model, ckpt);
  uint64_t total = 0;
  for (Member& x : members) {  // the MANIFEST goes first: hash everything before writing
    lathe::io::Xxh64 h;
    if (x.source.empty()) {
      h.update(x.data.data(), x.data.size());
      x.size = x.data.size();
    } else {
      x.size = read_chunks(x.source, [&](const char* p, size_t n) { h.update(p, n); });
    }
    x.hash = lathe::io::hex64(h.digest());
    total += x.size;
  }
  lathe::io::TarZstWriter w(out);
  w.add(name + "/MANIFEST", manifest(members));
  lathe::progress::Bar bar("archive " + out, static_cast<int64_t>(total), "bytes",
                           !no_progress && total >= kProgressBytes);
  for (const Member& x : members) {
    if (x.source.empty()) {
      w.add(x.name, x.data);
      bar.add(static_cast<int64_t>(x.data.size()));
    } else {
      lathe::io::Xxh64 h;  // the bytes archived are the bytes hashed (a file changed meanwhile is refused)
      w.add(x.name, x.size, [&](const auto& write) {
        read_chunks(x.source, [&](const char* p, size_t n) {
          h.update(p, n);
          write(p, n);
          bar.add(static_cast<int64_t>(n));
        });
      });
      LATHE_CHECK(lathe::io::hex64(h.digest()) == x.hash,
                  "{}: changed while it was archived (run `lathe archive` "
                  "again once the run is not writing it)",
                  x.source);
    }
  }
  w.finish();
  bar.finish();
  fmt::print("wrote {} ({} files, {} bytes before compression, {} bytes)\n", out, members.size() + 1, total,
             fs::file_size(out));
  return 0;
}

// The MANIFEST's lines: path -> (hash, size), and the paths in order.
struct Manifest {
  std::map<std::string, std::pair<std::string, uint64_t>> files;
  std::vector<std::string> order;
};

Manifest parse_manifest(const std::string& file, const std::string& text) {
  Manifest m;
  std::istringstream lines(text);
  std::string line;
  for (int n = 1; std::getline(lines, line); ++n) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream f(line);
    std::string hash, path;
    uint64_t size = 0;
    f >> hash >> size;
    std::getline(f, path);
    const size_t start = path.find_first_not_of(' ');
    LATHE_CHECK(hash.size() == 16 && start != std::string::npos, "{}: MANIFEST line {} is not 'XXH64  size  path': {}",
                file, n, lathe::io::excerpt(line));
    path = path.substr(start);
    m.files[path] = {hash, size};
    m.order.push_back(path);
  }
  return m;
}

int verify_archive(const std::string& file) {
  std::optional<Manifest> man;
  std::string manifest_text, current;
  std::unique_ptr<lathe::io::Xxh64> h;
  uint64_t got = 0, bytes = 0;
  std::vector<std::string> bad, seen;
  lathe::io::TarVisitor v;
  v.on_member = [&](const std::string& name, uint64_t) {
    current = name;
    got = 0;
    h = std::make_unique<lathe::io::Xxh64>();
    LATHE_CHECK(man || (name.size() >= 9 && name.compare(name.size() - 9, 9, "/MANIFEST") == 0),
                "{}: the first member is {}, not NAME/MANIFEST (not an archive of `lathe archive`)", file, name);
    if (man && !man->files.count(name)) bad.push_back(fmt::format("{}: in the archive but not in the MANIFEST", name));
  };
  v.on_data = [&](const char* p, size_t n) {
    if (!man) manifest_text.append(p, n);
    h->update(p, n);
    got += n;
  };
  v.on_end = [&]() {
    if (!man) {
      man = parse_manifest(file, manifest_text);
      return;
    }
    seen.push_back(current);
    bytes += got;
    const auto it = man->files.find(current);
    if (it == man->files.end()) return;
    const std::string hash = lathe::io::hex64(h->digest());
    if (hash != it->second.first || got != it->second.second)
      bad.push_back(
          fmt::format("{}: XXH64 {} over {} bytes, the MANIFEST says {} over {} bytes (this file's bytes "
                      "changed)",
                      current, hash, got, it->second.first, it->second.second));
  };
  lathe::io::read_tar_zst(file, v);
  LATHE_CHECK(man.has_value(), "{}: an empty archive (no MANIFEST)", file);
  for (const std::string& p : man->order)
    if (std::find(seen.begin(), seen.end(), p) == seen.end())
      bad.push_back(fmt::format("{}: in the MANIFEST but missing from the archive", p));
  if (!bad.empty()) {
    std::string msg;
    for (const auto& b : bad) msg += "\n  " + b;
    lathe::throw_error("{}: {} of {} files fail verification (the archive is damaged; archive the run again):{}", file,
                       bad.size(), man->order.size(), msg);
  }
  fmt::print("{}: OK: {} files, {} bytes, every XXH64 matches the MANIFEST\n", file, seen.size(), bytes);
  return 0;
}

int run_archive(int argc, char** argv) {
  CLI::App app{"Write (or verify) one reproducible .tar.zst archive of a training run", "lathe archive"};
  std::string run, out, verify, ckpt;
  bool with_model = false, no_progress = false;
  app.add_option("run", run, "the run directory (output.dir of `lathe train`)");
  app.add_option("--out", out, "the archive to write (FILE.tar.zst)");
  app.add_flag("--with-model", with_model, "include the final model directory (RUN/model)");
  app.add_option("--with-checkpoint", ckpt, "include a checkpoint: 'latest' or a step number");
  app.add_option("--verify", verify, "check an archive against its MANIFEST instead of writing one");
  app.add_flag("--no-progress", no_progress, "no progress bar / lines on stderr");
  LATHE_CLI_PARSE(app, argc, argv);
  auto usage = [](const std::string& what) {
    fmt::print(stderr, "lathe archive: usage error: {}\nRun 'lathe archive --help' for the options.\n", what);
    return 2;
  };
  if (!verify.empty()) {
    if (!run.empty() || !out.empty() || with_model || !ckpt.empty())
      return usage("--verify FILE takes no run, --out, --with-model or --with-checkpoint");
    return verify_archive(verify);
  }
  if (run.empty() || out.empty()) return usage("give a run directory and --out FILE.tar.zst (or --verify FILE)");
  if (app.count("--with-checkpoint") && ckpt.empty())
    return usage("--with-checkpoint is empty: give 'latest' or a step number");
  return write_archive(run, out, with_model, ckpt, no_progress);
}

lathe::cli::Registrar reg("archive",
                          "write or verify one reproducible .tar.zst archive of a run (logs, metrics, "
                          "report; optionally the model or a checkpoint)",
                          run_archive);

}  // namespace
