// Work split shared by the optimizers and gradient clipping: the parameter ranges cut into fixed
// chunks of kChunk elements (kernels/step_ops.h's kStepChunk, make_step_chunks: the step kernels
// of every backend cut them so). One parallel loop over all chunks avoids a parallel region per
// (often tiny) tensor, and reductions summed chunk by chunk in chunk order are deterministic for
// any thread count. Chunks are cut at multiples of kChunk of the flat buffer (and at range ends),
// not of each range, so a ZeRO shard (cut at kChunk multiples too) holds whole chunks: its chunk
// sums are exactly those of a single process.
#pragma once
#include <span>
#include <vector>

#include "kernels/step_ops.h"
#include "optim/optimizer.h"

namespace lathe::optim {

constexpr size_t kChunk = kStepChunk;
using Chunk = StepChunk;

inline std::vector<Chunk> make_chunks(std::span<const ParamRange> ranges) { return make_step_chunks(ranges); }

}  // namespace lathe::optim
