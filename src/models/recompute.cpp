#include "models/recompute.h"

#include <string>

#include "core/error.h"

namespace lathe {

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None:
      return "none";
    case Recompute::Selective:
      return "selective";
    case Recompute::Full:
      return "full";
  }
  return "?";
}

Recompute parse_recompute(std::string_view text, std::string_view what) {
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full})
    if (text == recompute_name(r)) return r;
  // Untrusted text: show at most 40 characters of it.
  std::string shown(text.substr(0, 40));
  if (text.size() > 40) shown += "...";
  throw_error("{}: unknown recompute mode '{}'; use none, selective or full", what, shown);
}

}  // namespace lathe
