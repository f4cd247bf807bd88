// Subcommands of the `lathe` binary register themselves:
//   static lathe::cli::Registrar reg("encode", "text on stdin -> token ids", run_encode);
// main() dispatches argv[1] to the command; the function receives the remaining arguments
// (argv[0] is "lathe <name>") and returns the process exit code. lathe::Error thrown from a
// command is printed as "lathe <name>: error: <message>" with exit code 1.
#pragma once
#include <functional>
#include <map>
#include <string>

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
