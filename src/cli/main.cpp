#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "core/blas_env.h"
#include "core/cpu_isa.h"
#include "core/error.h"
#include "core/error_message.h"
#include "core/stop.h"
#include "dist/comm.h"

namespace lathe::cli {

std::map<std::string, Command>& commands() {
  static std::map<std::string, Command> table;
  return table;
}

Registrar::Registrar(const std::string& name, const std::string& help, CommandFn fn) {
  auto [it, inserted] = commands().emplace(name, Command{help, std::move(fn)});
  if (!inserted) {
    std::fprintf(stderr, "internal error: lathe subcommand '%s' registered twice\n", name.c_str());
    std::abort();
  }
}

}  // namespace lathe::cli

static void usage() {
  fmt::print(stderr, "lathe {} - LLM pretraining engine\n\nusage: lathe <command> [args...]\n\ncommands:\n",
             LATHE_VERSION);
  for (auto& [name, cmd] : lathe::cli::commands()) fmt::print(stderr, "  {:<12} {}\n", name, cmd.help);
  fmt::print(stderr, "\nRun 'lathe <command> --help' for the options of a command.\n");
}

// Whether this invocation runs a command (not usage, --help, --version, an unknown command or a
// command's --help): only then are the OpenBLAS/OpenMP start-up settings and their note wanted.
static bool runs_command(int argc, char** argv) {
  if (argc < 2 || lathe::cli::commands().count(argv[1]) == 0) return false;
  for (int i = 2; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) return false;
  }
  return true;
}

int main(int argc, char** argv) {
  if (runs_command(argc, argv)) lathe::ensure_fast_runtime(argc, argv);
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    fmt::print("lathe {}\n", LATHE_VERSION);
    return 0;
  }
  auto& table = lathe::cli::commands();
  auto it = table.find(argv[1]);
  if (it == table.end()) {
    fmt::print(stderr, "lathe: error: unknown command '{}'\n\n", argv[1]);
    usage();
    return 2;
  }
  std::string prog = std::string("lathe ") + argv[1];
  argv[1] = prog.data();
  // Every failure ends as "lathe CMD: error: ..." and exit code 1; in an MPI job the line names the
  // rank and the whole job is ended, so that no other rank waits for this one.
  auto fail = [&](const std::string& msg) {
    fmt::print(stderr, "{}: error: {}{}\n", prog, lathe::dist::job_rank_prefix(), msg);
    std::fflush(stderr);
    lathe::dist::end_job_after_error(1);
    return 1;
  };
  try {
    lathe::cpu_isa();  // reads LATHE_CPU_ISA: a bad value fails here, naming it
    return it->second.fn(argc - 1, argv + 1);
  } catch (const lathe::Interrupted& e) {
    // A stop request (SIGINT / SIGTERM) honoured before any result was written: not a failure.
    fmt::print(stderr, "{}: {}{}\n", prog, lathe::dist::job_rank_prefix(), e.what());
    std::fflush(stderr);
    lathe::dist::end_job_after_error(e.exit_code());  // no rank of an MPI job waits for this one
    return e.exit_code();
  } catch (const std::exception& e) {
    return fail(lathe::error_message(e));  // bad_alloc, filesystem and JSON errors explained
  }
}
