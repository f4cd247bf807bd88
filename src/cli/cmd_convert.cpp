// lathe convert --from-hf DIR [--to DIR] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
//               [--resize-vocab N] [--to-gguf FILE [--gguf-pre NAME] [--gguf-tokenizer PATH]] [--verify]
//               [--tol 1e-4]
//   Imports a Hugging Face model directory strictly (load report printed), writes it back out as
//   an HF directory and/or GGUF, and with --verify compares lathe's logits against `transformers`
//   (run by /usr/bin/python3, or $LATHE_PYTHON) on fixed token sequences.
// lathe logits --model DIR --tokens 1,2,3 [--tokens ...] --out FILE
//   (testing) raw float32 logits [n_seq, T, V] of each sequence, concatenated, written to FILE.
//
// The helpers below (parse_dtype, parse_size, tokenizer_files_in, verify_against_transformers) are
// also used by cmd_export.cpp, which declares them.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/command.h"
#include "core/progress.h"
#include "interop/gguf_export.h"
#include "interop/hf_weights.h"
#include "io/fs.h"

namespace lathe::cli {

namespace fs = std::filesystem;

DType parse_dtype(const std::string& s, const std::string& flag) {
  if (s == "fp32" || s == "f32" || s == "float32") return DType::F32;
  if (s == "bf16" || s == "bfloat16") return DType::BF16;
  if (s == "fp16" || s == "f16" || s == "float16") return DType::F16;
  throw_error("{} '{}': expected fp32, bf16 or fp16", flag, s);
}

uint64_t parse_size(const std::string& s) {
  // "5GB", "500MB", "2GiB", "1000" (bytes); decimal units as transformers' max_shard_size.
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (...) {
    throw_error("--max-shard-size '{}': expected a size like 5GB, 500MB or a byte count", s);
  }
  std::string unit = s.substr(pos);
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  double mul = 1;
  if (unit == "" || unit == "B")
    mul = 1;
  else if (unit == "KB")
    mul = 1e3;
  else if (unit == "MB")
    mul = 1e6;
  else if (unit == "GB")
    mul = 1e9;
  else if (unit == "KIB")
    mul = 1024.0;
  else if (unit == "MIB")
    mul = 1024.0 * 1024;
  else if (unit == "GIB")
    mul = 1024.0 * 1024 * 1024;
  else
    throw_error("--max-shard-size '{}': unknown unit '{}' (B, KB, MB, GB, KiB, MiB, GiB)", s, unit);
  LATHE_CHECK(v > 0, "--max-shard-size '{}' must be > 0", s);
  return static_cast<uint64_t>(v * mul);
}

// Tokenizer files of an HF model directory, to copy next to the converted weights.
std::vector<std::string> tokenizer_files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                        "merges.txt", "tokenizer.model", "added_tokens.json"}) {
    const fs::path p = fs::path(dir) / f;
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(p, ec))) continue;
    io::require_regular_file(p.string());  // a FIFO, directory or symlink loop is named, not skipped
    out.push_back(p.string());
  }
  return out;
}

namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::pair<int, std::string> run_capture(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  LATHE_CHECK(p != nullptr, "cannot run: {}", cmd);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128, out};
}

std::string python_bin() {
  const char* e = std::getenv("LATHE_PYTHON");
  return e && *e ? e : "/usr/bin/python3";
}

// The reference: transformers in float32, eager attention, one sequence at a time.
const char* kTransformersScript = R"PY(
import json, sys
import numpy as np
import torch
import transformers
torch.set_num_threads(2)
req = json.load(open(sys.argv[1]))
model = transformers.AutoModelForCausalLM.from_pretrained(req["dir"], torch_dtype=torch.float32,
                                                          attn_implementation="eager")
model.eval()
# phi3: transformers 4.45 applies sliding_window only in Phi3FlashAttention2, as flash-attn's
# window_size=(S, S) (S + 1 keys; lathe's ModelConfig::layer_window); its eager mask has none, so
# that window is given as a 4D additive mask, which the eager model uses as it is.
win = model.config.sliding_window if model.config.model_type == "phi3" else None
def mask(T):
    if win is None:
        return None
    i, j = torch.arange(T).reshape(-1, 1), torch.arange(T).reshape(1, -1)
    m = torch.zeros(T, T).masked_fill(~((j <= i) & (i - j <= win)), torch.finfo(torch.float32).min)
    return m[None, None]
out = []
with torch.no_grad():
    for s in req["seqs"]:
        out.append(model(torch.tensor([s], dtype=torch.long), attention_mask=mask(len(s)),
                         use_cache=False).logits[0].float().numpy().reshape(-1))
np.concatenate(out).astype("<f4").tofile(req["out"])
print("transformers", transformers.__version__, "torch", torch.__version__)
)PY";

}  // namespace

// Fixed sequences: an arithmetic ramp, a pseudo-random walk over the whole vocabulary, and the
// top ids; length min(16, max_position_embeddings).
std::vector<std::vector<int32_t>> verify_sequences(const ModelConfig& cfg) {
  const int64_t T = std::min<int64_t>(16, cfg.max_position_embeddings), V = cfg.vocab_size;
  std::vector<std::vector<int32_t>> seqs(3);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int64_t t = 0; t < T; ++t) {
    seqs[0].push_back(static_cast<int32_t>((t * 7 + 1) % V));
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    seqs[1].push_back(static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(V)));
    seqs[2].push_back(static_cast<int32_t>(V - 1 - (t % std::min<int64_t>(V, 5))));
  }
  return seqs;
}

std::vector<float> lathe_logits(Model& model, const std::vector<std::vector<int32_t>>& seqs) {
  int64_t Tmax = 0;
  for (const auto& s : seqs) Tmax = std::max<int64_t>(Tmax, static_cast<int64_t>(s.size()));
  if (model.max_batch() < 1 || model.max_seq() < Tmax) model.allocate(1, Tmax);
  const int64_t V = model.config().vocab_size;
  std::vector<float> out;
  for (const auto& s : seqs) {
    std::vector<float> l(s.size() * static_cast<size_t>(V));
    model.forward_logits(s.data(), 1, static_cast<int64_t>(s.size()), l.data());
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

// Returns true when the check ran and passed; false when it ran and failed. *ran = false when
// transformers is unavailable (then nothing is claimed).
bool verify_against_transformers(Model& model, const std::string& hf_dir, double tol, const std::string& what,
                                 bool* ran) {
  *ran = false;
  const std::string py = python_bin();
  auto probe = run_capture(shell_quote(py) + " -c 'import transformers, torch, numpy'");
  if (probe.first != 0) {
    fmt::print(
        "verify {}: NOT RUN - {} cannot import transformers/torch/numpy, so lathe's logits were NOT compared "
        "with a reference (this is not a pass). Install with: {} -m pip install transformers\n",
        what, py, py);
    return true;
  }
  const auto seqs = verify_sequences(model.config());
  const std::vector<float> ours = lathe_logits(model, seqs);
  for (float v : ours) LATHE_CHECK(std::isfinite(v), "verify {}: lathe produced a non-finite logit", what);
  const fs::path tmp = fs::temp_directory_path() / fmt::format("lathe_verify_{}_{}", ::getpid(), what);
  fs::create_directories(tmp);
  const std::string script = (tmp / "ref.py").string(), req = (tmp / "req.json").string(),
                    out = (tmp / "logits.f32").string();
  io::atomic_write_file(script, kTransformersScript);
  nlohmann::json j = {{"dir", fs::absolute(hf_dir).string()}, {"seqs", seqs}, {"out", out}};
  io::atomic_write_file(req, j.dump());
  auto r = run_capture(shell_quote(py) + " " + shell_quote(script) + " " + shell_quote(req));
  if (r.first != 0) {
    fs::remove_all(tmp);
    throw_error("verify {}: transformers failed to run {} (exit {}):\n{}", what, hf_dir, r.first, r.second);
  }
  std::string raw = io::read_file(out);
  fs::remove_all(tmp);
  LATHE_CHECK(raw.size() == ours.size() * 4,
              "verify {}: transformers returned {} logits, lathe {} (vocab or length "
              "differ)",
              what, raw.size() / 4, ours.size());
  std::vector<float> ref(ours.size());
  std::memcpy(ref.data(), raw.data(), raw.size());
  double maxd = 0, maxref = 0;
  size_t at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(double(ours[i]) - ref[i]);
    if (!(d <= maxd)) maxd = d, at = i;  // NaN counts as the largest
    maxref = std::max(maxref, std::fabs(double(ref[i])));
  }
  // Absolute tolerance for logits of magnitude <= 1, relative beyond (fp32 rounding grows with it).
  const double bound = tol * std::max(1.0, maxref);
  *ran = true;
  const bool ok = maxd <= bound;
  std::string ver = r.second;
  while (!ver.empty() && (ver.back() == '\n' || ver.back() == '\r')) ver.pop_back();
  if (auto nl = ver.rfind('\n'); nl != std::string::npos) ver = ver.substr(nl + 1);
  fmt::print(
      "verify {}: {} sequences x {} tokens vs {} ({}): max |logit diff| = {:.3g} (max |logit| {:.3g}, "
      "tolerance {:.3g}) -> {}\n",
      what, seqs.size(), seqs[0].size(), hf_dir, ver, maxd, maxref, bound, ok ? "PASS" : "FAIL");
  if (!ok) {
    const size_t V = static_cast<size_t>(model.config().vocab_size), T = seqs[0].size();
    fmt::print("  largest difference at sequence {}, position {}, token id {}: lathe {:.6g} vs transformers {:.6g}\n",
               at / (T * V), (at / V) % T, at % V, ours[at], ref[at]);
  }
  return ok;
}

// What reading an HF directory `dir` touches, as inputs of io::check_output_paths: the directory
// itself, its *.safetensors files, and the names the loader and tokenizers look for even where
// absent (a new model.safetensors.index.json or lathe.json written there would change what the
// directory loads as). Other new files beside them are fine (model.gguf next to the weights).
std::vector<io::PathUse> hf_dir_inputs(const std::string& dir, const std::string& what) {
  std::vector<io::PathUse> in{{dir, what}};
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                        "lathe.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                        "merges.txt", "encoder.json", "vocab.bpe", "special_tokens_map.json"})
    in.push_back({(fs::path(dir) / f).string(), fmt::format("{}'s {}", what, f)});
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".safetensors")
      in.push_back({it->path().string(), fmt::format("{}'s {}", what, it->path().filename().string())});
  return in;
}

namespace {

int run_convert(int argc, char** argv) {
  CLI::App app{"Import a Hugging Face model directory; write HF safetensors and/or GGUF; check parity",
               "lathe convert"};
  std::string from, to, dtype_s = "fp32", shard_s = "5GB", gguf, gguf_pre, gguf_tok;
  int64_t resize = 0;
  double tol = 1e-4;
  bool verify = false;
  app.add_option("--from-hf", from, "Hugging Face model directory (config.json + safetensors)")->required();
  app.add_option("--to", to, "output Hugging Face directory");
  app.add_option("--dtype", dtype_s, "output dtype: fp32, bf16 or fp16 (GGUF: fp32 or fp16)");
  app.add_option("--max-shard-size", shard_s, "shard model.safetensors above this size (default 5GB)");
  app.add_option("--resize-vocab", resize, "grow the vocabulary to N rows (new rows = mean embedding)");
  app.add_option("--to-gguf", gguf, "also write a GGUF file for llama.cpp (gpt2, llama, qwen2, mistral, qwen3, phi3)");
  app.add_option("--gguf-pre", gguf_pre, "llama.cpp pre-tokenizer name (default: derived from the tokenizer)");
  app.add_option("--gguf-tokenizer", gguf_tok, "tokenizer for the GGUF (default: the directory's tokenizer files)");
  bool no_progress = false;
  app.add_flag("--no-progress", no_progress, "no progress bar / lines on stderr");
  app.add_flag("--verify", verify, "compare logits with transformers on fixed token sequences");
  app.add_option("--tol", tol, "--verify tolerance on the max abs logit difference (x max(1, max|logit|))");
  LATHE_CLI_PARSE(app, argc, argv);
  LATHE_CHECK(!to.empty() || !gguf.empty() || verify, "nothing to do: give --to DIR, --to-gguf FILE and/or --verify");
  const DType dtype = parse_dtype(dtype_s, "--dtype");
  HfLoadOptions lo;
  lo.resize_vocab = resize;
  std::string report;
  {  // no output may be the source directory, lie inside it, or be the same path as the other (D3, D5)
    std::vector<io::PathUse> in = hf_dir_inputs(from, "the --from-hf directory");
    if (!gguf_tok.empty() && gguf_tok != "byte") in.push_back({gguf_tok, "--gguf-tokenizer"});
    std::vector<io::PathUse> outs;
    if (!to.empty()) outs.push_back({to, "--to", io::PathUse::Dir});
    if (!gguf.empty()) outs.push_back({gguf, "--to-gguf"});
    if (!to.empty())
      for (const char* f :
           {"config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json"})
        outs.push_back({(fs::path(to) / f).string(), fmt::format("--to's {}", f)});
    io::check_output_paths(in, outs);
  }
  auto model = load_hf_model(from, &report, lo);
  fmt::print("{}: {} ({} parameters): {}\n", from, model->config().model_type, model->num_params(), report);
  if (!to.empty()) {
    HfSaveOptions so;
    so.dtype = dtype;
    so.max_shard_bytes = parse_size(shard_s);
    so.extra_files = tokenizer_files_in(from);
    so.generation_config = generation_config_in(from);
    std::unique_ptr<progress::Bar> bar;  // per tensor written (issue 13 item 5)
    so.on_tensor = [&](int64_t done, int64_t total) {
      if (!bar) bar = std::make_unique<progress::Bar>("write " + to, total, "tensors", !no_progress);
      bar->update(done);
    };
    save_hf_model(*model, to, so);
    if (bar) bar->finish();
    fmt::print("wrote {} ({}{})\n", to, dtype_name(dtype),
               so.extra_files.empty() ? ", no tokenizer files in the source"
                                      : fmt::format(", {} tokenizer files copied", so.extra_files.size()));
  }
  if (!gguf.empty()) {
    LATHE_CHECK(dtype == DType::F32 || dtype == DType::F16, "--to-gguf writes f32 or f16; --dtype is {}", dtype_s);
    GgufExportOptions go;
    go.dtype = dtype;
    go.name = fs::path(fs::absolute(from)).filename().string();
    go.pre = gguf_pre;
    go.model_dir = from;
    go.tokenizer = !gguf_tok.empty() ? gguf_tok : gguf_tokenizer_in(from);
    fmt::print("{}\n", save_gguf(*model, gguf, go));
  }
  if (!verify) return 0;
  // A resized vocabulary has no reference to compare against.
  LATHE_CHECK(resize == 0 || resize == load_hf_config(from).vocab_size,
              "--verify compares with the source model, which --resize-vocab changed; verify without resizing");
  bool ran = false;
  bool ok = verify_against_transformers(*model, from, tol, "import", &ran);
  if (ran && ok && !to.empty()) {
    if (dtype == DType::F32) {
      bool ran2 = false;
      ok = verify_against_transformers(*model, to, tol, "export", &ran2) && ok;
    } else {
      fmt::print("verify export: NOT RUN - {} output is rounded, so its logits are not expected to match to {}\n",
                 dtype_name(dtype), tol);
    }
  }
  return ok ? 0 : 1;
}

int run_logits(int argc, char** argv) {
  CLI::App app{"(testing) raw float32 logits of token sequences", "lathe logits"};
  std::string model_dir, out;
  std::vector<std::string> toks;
  app.add_option("--model", model_dir, "Hugging Face model directory")->required();
  app.add_option("--tokens", toks, "comma-separated token ids (repeat for more sequences)")->required();
  app.add_option("--out", out, "output file: float32 [n_seq, T, V] concatenated")->required();
  LATHE_CLI_PARSE(app, argc, argv);
  io::check_output_paths(hf_dir_inputs(model_dir, "--model"), {{out, "--out"}});
  std::string report;
  auto model = load_hf_model(model_dir, &report);
  std::vector<std::vector<int32_t>> seqs;
  for (const auto& t : toks) {
    std::vector<int32_t> s;
    std::stringstream ss(t);
    std::string item;
    while (std::getline(ss, item, ',')) {
      long v = std::stol(item);
      LATHE_CHECK(v >= 0 && v < model->config().vocab_size, "--tokens: id {} outside [0, {})", v,
                  model->config().vocab_size);
      s.push_back(static_cast<int32_t>(v));
    }
    LATHE_CHECK(!s.empty(), "--tokens: empty sequence");
    seqs.push_back(std::move(s));
  }
  auto l = lathe_logits(*model, seqs);
  io::atomic_write_file(out, std::string_view(reinterpret_cast<const char*>(l.data()), l.size() * 4));
  fmt::print("{}\n", report);
  return 0;
}

Registrar reg_convert("convert", "Hugging Face directory -> HF safetensors / GGUF, with a transformers parity check",
                      run_convert);
Registrar reg_logits("logits", "(testing) float32 logits of a model on token sequences", run_logits);

}  // namespace
}  // namespace lathe::cli
