#pragma once
#include <cstdint>

namespace lathe {
// Peak resident set size of this process in bytes (VmHWM from /proc/self/status; 0 if unknown).
int64_t peak_rss_bytes();
}  // namespace lathe
