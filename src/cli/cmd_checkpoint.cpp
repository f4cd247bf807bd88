// lathe checkpoint reshard SRC_STEP_DIR --to DST_RUN_DIR [--tensor T] [--pipeline P] [--data D] [--zero Z]
//                          [--context C]
//   Rewrites a checkpoint as a run of another parallel layout would have saved it
//   (DST_RUN_DIR/checkpoints/step_XXXXXXXX + latest, atomic; train/reshard.h). Degrees not given
//   keep the source's. Resume it with `lathe train RECIPE --set output.dir=DST_RUN_DIR --resume auto`
//   (or --resume DST_RUN_DIR/checkpoints/step_XXXXXXXX) at that layout.
// lathe checkpoint info CHECKPOINT_DIR [--json]
//   Step, layout, model, files and how every tensor is stored (pieces), after checking state.json
//   and that the pieces cover every tensor exactly once (file checksums with --verify).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/stop_signal.h"
#include "train/checkpoint.h"
#include "train/reshard.h"

namespace lathe::cli {
namespace {

void usage() {
  std::fprintf(stderr,
               "usage: lathe checkpoint reshard SRC_STEP_DIR --to DST_RUN_DIR [--tensor T] [--pipeline P] [--data D] "
               "[--zero Z] [--context C]\n"
               "       lathe checkpoint info CHECKPOINT_DIR [--verify] [--json]\n");
}

std::string layout_str(const CheckpointLayout& l) {
  return fmt::format("tensor {} x pipeline {} x data {}{} (ZeRO {}; {} rank{})", l.tensor, l.pipeline, l.data,
                     l.context > 1 ? fmt::format(" x context {}", l.context) : std::string(), l.zero, l.world(),
                     l.world() == 1 ? "" : "s");
}

// "a, b, c" for a few files; the first and last two with a count for many (a --data 1000 layout
// writes 1001 files: one line per run, not a thousand names).
std::string files_summary(const std::vector<std::string>& files) {
  if (files.size() <= 6) return fmt::format("{}", fmt::join(files, ", "));
  return fmt::format("{} files: {}, {}, ..., {}, {}", files.size(), files[0], files[1], files[files.size() - 2],
                     files.back());
}

int run_reshard(int argc, char** argv) {
  CLI::App app{"Rewrite a checkpoint for another parallel layout (tensor x pipeline x data, ZeRO stage)",
               "lathe checkpoint reshard"};
  std::string src, dst;
  int64_t tensor = 0, pipeline = 0, data = 0, zero = -1, context = 0;
  app.add_option("src", src, "checkpoint directory (RUN/checkpoints/step_XXXXXXXX)")->required();
  app.add_option("--to", dst, "output run directory: the checkpoint goes to DST/checkpoints/step_XXXXXXXX")->required();
  app.add_option("--tensor", tensor, "tensor-parallel degree (default: the source's)");
  app.add_option("--pipeline", pipeline, "pipeline-parallel degree (default: the source's)");
  app.add_option("--data", data, "data-parallel degree (default: the source's)");
  app.add_option("--zero", zero, "ZeRO stage 0, 1 or 2 (default: the source's)");
  app.add_option("--context", context, "context-parallel degree (default: the source's)");
  LATHE_CLI_PARSE(app, argc, argv);
  const CheckpointLayout from = checkpoint_layout(read_checkpoint_state(src));
  CheckpointLayout to = from;
  // 0 or negative given explicitly is refused by validate_layout, naming the option.
  if (app.count("--tensor")) to.tensor = tensor;
  if (app.count("--pipeline")) to.pipeline = pipeline;
  if (app.count("--data")) to.data = data;
  if (app.count("--zero")) to.zero = zero;
  if (app.count("--context")) to.context = context;
  StopSignalGuard stop;  // SIGINT/SIGTERM: stop at a safe point, remove what this run began
  const ReshardResult r = reshard_checkpoint(src, dst, to);
  fmt::print("resharded {}\n  from {}\n  to   {}\nwrote {} ({:.1f} MB: {})\n", src, layout_str(r.from),
             layout_str(r.to), r.dir, static_cast<double>(r.bytes) / 1e6, files_summary(r.files));
  return 0;
}

int run_info(int argc, char** argv) {
  CLI::App app{"Describe a checkpoint: step, layout, model, files, tensors and their pieces", "lathe checkpoint info"};
  std::string dir;
  bool json_out = false, verify = false;
  app.add_option("dir", dir, "checkpoint directory (RUN/checkpoints/step_XXXXXXXX)")->required();
  app.add_flag("--verify", verify, "also check every file's size and XXH64 checksum");
  app.add_flag("--json", json_out, "print one JSON object");
  LATHE_CLI_PARSE(app, argc, argv);
  if (verify) verify_checkpoint(dir);
  const CheckpointPieces ck(dir);
  const CheckpointState& st = ck.state();
  const CheckpointLayout l = checkpoint_layout(st);
  checkpoint_model_config(dir);  // the saved recipe names a valid model
  // Counted from the tables (no model is built: info stays cheap for any size).
  int64_t weights = 0, moments = 0, pieces = 0, params = 0;
  for (const std::string& name : ck.names()) {
    ck.check(name, ck.global_shape(name));  // every element exactly once
    const bool weight = name.find('/') == std::string::npos;
    (weight ? weights : moments) += 1;
    if (weight) params += numel(ck.global_shape(name));
    pieces += static_cast<int64_t>(ck.pieces(name));
  }
  int64_t bytes = 0;
  for (const CheckpointFile& f : st.files) bytes += f.bytes;
  if (json_out) {
    nlohmann::json j = {
        {"dir", dir},
        {"step", st.step},
        {"consumed_samples", st.consumed_samples},
        {"layout",
         {{"tensor", l.tensor}, {"pipeline", l.pipeline}, {"data", l.data}, {"zero", l.zero}, {"context", l.context}}},
        {"writers", st.world_size},
        {"parameters", params},
        {"optimizer", st.optimizer},
        {"lathe_version", st.lathe_version},
        {"bytes", bytes},
        {"weights", weights},
        {"moments", moments},
        {"pieces", pieces},
        {"verified", verify}};
    nlohmann::json files = nlohmann::json::object();
    for (const CheckpointFile& f : st.files) files[f.name] = {{"bytes", f.bytes}, {"xxh64", f.xxh64}};
    j["files"] = files;
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("checkpoint {}\n  step {} ({} samples consumed), lathe {}\n", dir, st.step, st.consumed_samples,
             st.lathe_version);
  fmt::print("  layout: {}, written by {} writer{}\n", layout_str(l), st.world_size, st.world_size == 1 ? "" : "s");
  fmt::print("  model: {} parameters; optimizer: {}\n", params,
             st.optimizer.empty() ? std::string("(none saved)") : st.optimizer);
  fmt::print("  tensors: {} weights, {} moments in {} pieces, each element stored exactly once\n", weights, moments,
             pieces);
  fmt::print("  files ({:.1f} MB{}):\n", static_cast<double>(bytes) / 1e6, verify ? ", checksums verified" : "");
  for (const CheckpointFile& f : st.files) fmt::print("    {:<44} {:>12} bytes  xxh64 {}\n", f.name, f.bytes, f.xxh64);
  return 0;
}

int run_checkpoint(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string sub = argv[1];
  std::string prog = std::string(argv[0]) + " " + sub;
  argv[1] = prog.data();
  if (sub == "reshard") return run_reshard(argc - 1, argv + 1);
  if (sub == "info") return run_info(argc - 1, argv + 1);
  std::fprintf(stderr, "lathe checkpoint: usage error: unknown subcommand '%s' (reshard or info)\n", sub.c_str());
  usage();
  return 2;
}

Registrar reg("checkpoint", "checkpoint tools: reshard to another parallel layout, info", run_checkpoint);

}  // namespace
}  // namespace lathe::cli
