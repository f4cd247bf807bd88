// The message `lathe` prints after "error: " for an exception that ends a command (src/cli/main.cpp):
// what() for lathe::Error and most others; bad_alloc and JSON library errors explained. The Python
// package (src/python) raises lathe.Error with the same text.
#pragma once
#include <exception>
#include <string>

namespace lathe {

std::string error_message(const std::exception& e);

}  // namespace lathe
