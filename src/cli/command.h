// Subcommands of the `lathe` binary register themselves:
//   static lathe::cli::Registrar reg("encode", "text on stdin -> token ids", run_encode);
// main() dispatches argv[1] to the command; the function receives the remaining arguments
// (argv[0] is "lathe <name>") and returns the process exit code. Any exception thrown from a
// command (lathe::Error, and also std::bad_alloc, filesystem or JSON library errors) is printed as
// "lathe <name>: error: <message>" with exit code 1; a usage error (LATHE_CLI_PARSE) exits 2.
#pragma once
#include <cstdio>
#include <functional>
#include <map>
#include <string>

// Parses a CLI11 command line inside a command function: --help prints the help and returns 0,
// a usage error (unknown option, "--seq-len 12abc", missing argument) prints it and returns 2.
#define LATHE_CLI_PARSE(app, argc, argv)                                                          \
  do {                                                                                            \
    try {                                                                                         \
      (app).parse((argc), (argv));                                                                \
    } catch (const CLI::ParseError& e_) {                                                         \
      if (e_.get_exit_code() == 0) return (app).exit(e_); /* --help */                            \
      std::fprintf(stderr, "%s: usage error: %s\nRun '%s --help' for the options.\n",              \
                   (app).get_name().c_str(), e_.what(), (app).get_name().c_str());                \
      return 2;                                                                                   \
    }                                                                                             \
  } while (0)

namespace lathe::cli {

using CommandFn = std::function<int(int argc, char** argv)>;

struct Command {
  std::string help;
  CommandFn fn;
};

std::map<std::string, Command>& commands();

struct Registrar {
  Registrar(const std::string& name, const std::string& help, CommandFn fn);
};

}  // namespace lathe::cli
