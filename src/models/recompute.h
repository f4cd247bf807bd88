// Activation recompute: which activations the arena keeps per layer and which backward recomputes
// from what it kept (Model::allocate, Model::plan_activations, estimate_memory). Recomputing repeats
// exactly the floating-point operations of the forward pass on the same inputs, so losses and
// gradients are bit-identical to `none`; only memory and time change.
#pragma once
#include <cstdint>
#include <string_view>

namespace lathe {

enum class Recompute : uint8_t {
  // Every activation of every layer is kept (no recompute).
  None,
  // The norm outputs (ln1, ln2) and the MLP activation output (GELU / SwiGLU) are not kept: one
  // shared buffer of each is recomputed in backward from the kept inputs (the residual streams and
  // the MLP pre-activation), elementwise work instead of GEMMs or attention.
  Selective,
  // Only the residual stream between layers is kept; layer_backward(l) first re-runs layer l's
  // forward (all but its output projection, which backward does not read) into one shared set of
  // layer activations.
  Full,
};

// "none" | "selective" | "full".
const char* recompute_name(Recompute r);
// Parses the names above; anything else throws lathe::Error "WHAT: unknown recompute mode '...';
// use none, selective or full" (the value shown as a bounded excerpt).
Recompute parse_recompute(std::string_view text, std::string_view what);

}  // namespace lathe
