// lathe export CHECKPOINT_OR_RUN_OR_MODEL_DIR --to DIR [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
//              [--to-gguf FILE [--gguf-pre NAME] [--gguf-tokenizer PATH]]
//              [--to-onnx FILE [--static-seq-len N] [--external-data]]   (interop/onnx_export.h)
// Source, in this order:
//   * a checkpoint directory (state.json: checksums verified, weights loaded by load_checkpoint);
//   * a run directory (its newest complete checkpoint; corrupt ones are skipped and said so;
//     without checkpoints, RUN/model written at the end of training);
//   * a Hugging Face model directory (config.json + safetensors, e.g. RUN/model).
// Writes config.json, model.safetensors (sharded with an index above --max-shard-size),
// generation_config.json and the tokenizer files of the run's data.tokenizer (none for "byte").
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/validators.h"
#include "core/progress.h"
#include "core/stop_signal.h"
#include "interop/gguf_export.h"
#include "interop/hf_weights.h"
#include "interop/onnx_export.h"
#include "io/fs.h"
#include "io/json.h"
#include "io/onnx_writer.h"
#include "tokenizer/tokenizer.h"
#include "train/checkpoint.h"
#include "train/model_source.h"

namespace lathe::cli {

// Defined in cmd_convert.cpp.
DType parse_dtype(const std::string& s, const std::string& flag);
uint64_t parse_size(const std::string& s);
std::vector<std::string> tokenizer_files_in(const std::string& dir);
std::vector<io::PathUse> hf_dir_inputs(const std::string& dir, const std::string& what);

namespace {

namespace fs = std::filesystem;

using Source = ModelSource;

Source load_source(const std::string& path) {
  return load_model_source(path, [](const std::string& log) {
    fmt::print("{}", log.back() == '\n' ? log : log + "\n");
  });
}

// What the export reads (the source's directory, the tokenizer files) and writes (--to and the
// files it puts there, --to-gguf, --to-onnx with its external-data companion): no output may be
// an input, lie inside the source directory, or share its path with another output (D3, D5).
void check_export_paths(const Source& s, const std::string& to, const std::string& gguf, const std::string& onnx,
                        const std::vector<std::string>& tok_files, const std::string& gguf_tok) {
  // A checkpoint directory is lathe's own (checksummed): nothing may be written inside it. Beside an
  // HF directory's files a new file is fine (model.gguf next to model.safetensors).
  std::vector<io::PathUse> in = s.hf_dir.empty()
                                    ? std::vector<io::PathUse>{{s.read_dir, "the source directory", io::PathUse::Dir}}
                                    : hf_dir_inputs(s.hf_dir, "the source directory");
  // A tokenizer is a file, or a directory read like an HF directory's tokenizer files.
  const auto add_tokenizer = [&](const std::string& t, const std::string& what) {
    if (t.empty() || t == "byte") return;
    std::error_code ec;
    if (!fs::is_directory(t, ec)) return in.push_back({t, what});
    for (auto& u : hf_dir_inputs(t, what)) in.push_back(std::move(u));
  };
  add_tokenizer(s.tokenizer, "the tokenizer");
  add_tokenizer(gguf_tok, "--gguf-tokenizer");
  for (const auto& f : tok_files) in.push_back({f, "the tokenizer file"});
  std::vector<io::PathUse> out;
  if (!to.empty()) {
    out.push_back({to, "--to", io::PathUse::Dir});
    for (const char* f : {"config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json"})
      out.push_back({(fs::path(to) / f).string(), fmt::format("--to's {}", f)});
  }
  if (!gguf.empty()) out.push_back({gguf, "--to-gguf"});
  if (!onnx.empty()) {
    out.push_back({onnx, "--to-onnx"});
    out.push_back({onnx + ".data", "--to-onnx's external-data file"});
  }
  io::check_output_paths(in, out);
  // The external-data file of --to-onnx X is X.<hash>.data (io/onnx_writer.h): the export removes
  // the stale ones of that naming, so no other output may take such a name.
  if (!onnx.empty() && !gguf.empty() && io::same_path(io::parent_dir(gguf), io::parent_dir(onnx)) &&
      io::onnx::is_external_data_name(fs::path(onnx).filename().string(), fs::path(gguf).filename().string()))
    throw_error("--to-gguf {} has the name of an external-data file of --to-onnx {}; give another name", gguf, onnx);
}

// Test hook, read here and nowhere else (the library takes OnnxExportOptions::inline_limit):
// LATHE_TEST_ONNX_INLINE_LIMIT=BYTES lowers the size above which --to-onnx moves the weights to
// FILE.<hash>.data by itself, so tests reach the 2 GiB switch with tiny models.
uint64_t onnx_inline_limit() {
  const char* e = std::getenv("LATHE_TEST_ONNX_INLINE_LIMIT");
  if (e == nullptr) return io::onnx::kProtoLimit;
  const char* end = e + std::strlen(e);
  uint64_t v = 0;
  const auto [p, ec] = std::from_chars(e, end, v);
  LATHE_CHECK(p != e && p == end && ec == std::errc(),
              "LATHE_TEST_ONNX_INLINE_LIMIT={}: expected a size in bytes (digits only); unset it for the 2 GiB default",
              e);
  return v;
}

int run_export(int argc, char** argv) {
  CLI::App app{"Checkpoint or run -> Hugging Face directory (and GGUF)", "lathe export"};
  std::string src, to, dtype_s = "fp32", shard_s = "5GB", gguf, gguf_pre, gguf_tok;
  app.add_option("source", src, "checkpoint directory, run directory or HF model directory")->required();
  app.add_option("--to", to, "output Hugging Face directory");
  app.add_option("--dtype", dtype_s, "fp32, bf16 or fp16 (GGUF: fp32 or fp16)");
  app.add_option("--max-shard-size", shard_s, "shard model.safetensors above this size (default 5GB)");
  bool no_progress = false;
  app.add_flag("--no-progress", no_progress, "no progress bar / lines on stderr");
  app.add_option("--to-gguf", gguf, "also write a GGUF file for llama.cpp (gpt2, llama, qwen2, mistral, qwen3, phi3)");
  app.add_option("--gguf-pre", gguf_pre, "llama.cpp pre-tokenizer name (default: derived from the tokenizer)");
  app.add_option("--gguf-tokenizer", gguf_tok, "tokenizer for the GGUF (default: the run's or the model directory's)");
  std::string onnx;
  int64_t onnx_seq = 0;
  bool onnx_external = false;
  app.add_option("--to-onnx", onnx, "also write an ONNX decoder graph for onnxruntime (fp32 or fp16)");
  app.add_option("--static-seq-len", onnx_seq,
                 "ONNX: fixed-shape graph [1, N] without past key/values, N in [1, max_position_embeddings] "
                 "(default: dynamic shapes with past key/values)")
      ->check(int_range(1));
  app.add_flag("--external-data", onnx_external, "ONNX: weights in FILE.<hash>.data beside it (automatic above 2 GiB)");
  LATHE_CLI_PARSE(app, argc, argv);
  LATHE_CHECK(!to.empty() || !gguf.empty() || !onnx.empty(),
              "nothing to do: give --to DIR, --to-gguf FILE and/or --to-onnx FILE");
  LATHE_CHECK(onnx.empty() ? onnx_seq == 0 && !onnx_external : true,
              "--static-seq-len and --external-data apply to --to-onnx FILE, which is not given");
  const DType dtype = parse_dtype(dtype_s, "--dtype");
  if (!onnx.empty())
    LATHE_CHECK(dtype == DType::F32 || dtype == DType::F16,
                "--to-onnx writes fp32 or fp16 graphs; --dtype {} is not supported (onnxruntime's CPU provider has "
                "no bf16 kernels for most operators)",
                dtype_s);
  const uint64_t onnx_limit = onnx_inline_limit();  // before the model is loaded: a bad value fails at once
  StopSignalGuard stop;  // SIGINT/SIGTERM: the writers stop at the next tensor and remove their temporaries
  Source s = load_source(src);

  // Tokenizer files: the run's data.tokenizer, else those beside an HF source.
  std::vector<std::string> tok_files;
  std::string tok_note = "no tokenizer recorded";
  if (!s.tokenizer.empty()) {
    auto tok = tok::load_tokenizer(s.tokenizer);
    tok_files = tok->source_files();
    tok_note = tok_files.empty() ? fmt::format("tokenizer '{}' has no files to copy", s.tokenizer)
                                 : fmt::format("{} tokenizer file(s) from {}", tok_files.size(), s.tokenizer);
  } else if (!s.hf_dir.empty()) {
    tok_files = tokenizer_files_in(s.hf_dir);
    if (!tok_files.empty()) tok_note = fmt::format("{} tokenizer file(s) from {}", tok_files.size(), s.hf_dir);
  }
  check_export_paths(s, to, gguf, onnx, tok_files, gguf_tok);
  throw_if_stopped("lathe export", "nothing was written");
  fmt::print("source: {}\n", s.desc);
  if (!to.empty()) {
    HfSaveOptions so;
    so.dtype = dtype;
    so.max_shard_bytes = parse_size(shard_s);
    so.extra_files = tok_files;
    if (!s.hf_dir.empty()) so.generation_config = generation_config_in(s.hf_dir);
    std::unique_ptr<progress::Bar> bar;  // per tensor written (issue 13 item 5)
    so.on_tensor = [&](int64_t done, int64_t total) {
      if (!bar) bar = std::make_unique<progress::Bar>("write " + to, total, "tensors", !no_progress);
      bar->update(done);
    };
    save_hf_model(*s.model, to, so);
    if (bar) bar->finish();
    fmt::print("wrote {} ({}, {})\n", to, dtype_name(dtype), tok_note);
  }
  if (!gguf.empty()) {
    LATHE_CHECK(dtype == DType::F32 || dtype == DType::F16, "--to-gguf writes f32 or f16; --dtype is {}", dtype_s);
    GgufExportOptions go;
    go.dtype = dtype;
    go.pre = gguf_pre;
    go.model_dir = s.hf_dir;  // its generation_config.json
    // The tokenizer lathe used: --gguf-tokenizer, the run's data.tokenizer, else the HF directory's.
    go.tokenizer = !gguf_tok.empty()      ? gguf_tok
                   : !s.tokenizer.empty() ? s.tokenizer
                   : s.hf_dir.empty()     ? ""
                                          : gguf_tokenizer_in(s.hf_dir);
    fmt::print("{}\n", save_gguf(*s.model, gguf, go));
  }
  if (!onnx.empty()) {
    OnnxExportOptions oo;
    oo.dtype = dtype;
    oo.static_seq_len = onnx_seq;
    oo.external_data = onnx_external;
    oo.inline_limit = onnx_limit;
    fmt::print("{}\n", save_onnx(*s.model, onnx, oo));
  }
  return 0;
}

Registrar reg("export", "checkpoint or run -> Hugging Face directory (safetensors) and GGUF", run_export);

}  // namespace
}  // namespace lathe::cli
