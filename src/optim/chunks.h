// Work split shared by the optimizers and gradient clipping: the parameter ranges cut into fixed
// chunks of kChunk elements. One parallel loop over all chunks avoids a parallel region per
// (often tiny) tensor, and reductions summed chunk by chunk in chunk order are deterministic for
// any thread count. Chunks are cut at multiples of kChunk of the flat buffer (and at range ends),
// not of each range, so a ZeRO shard (cut at kChunk multiples too) holds whole chunks: its chunk
// sums are exactly those of a single process.
#pragma once
#include <algorithm>
#include <span>
#include <vector>

#include "optim/optimizer.h"

namespace lathe::optim {

constexpr size_t kChunk = 8192;

struct Chunk {
  size_t range;       // index into the ranges
  size_t begin, end;  // element offsets in the flat buffer
};

inline std::vector<Chunk> make_chunks(std::span<const ParamRange> ranges) {
  std::vector<Chunk> chunks;
  for (size_t r = 0; r < ranges.size(); ++r)
    for (size_t b = ranges[r].offset, e = ranges[r].offset + ranges[r].size; b < e;) {
      const size_t next = std::min((b / kChunk + 1) * kChunk, e);
      chunks.push_back({r, b, next});
      b = next;
    }
  return chunks;
}

}  // namespace lathe::optim
