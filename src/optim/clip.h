// Global gradient norm and clipping over the flat gradient buffer.
#pragma once
#include <cstddef>

namespace lathe::optim {

// L2 norm of grads[n], accumulated in double per fixed chunk and summed in chunk order:
// deterministic for any thread count. NaN/Inf in the gradients give a NaN/Inf norm.
double global_grad_norm(const float* grads, size_t n);
// The pieces of global_grad_norm, for gradients spread over ranks (parallel/grad_sync.h):
// out[c] = sum of squares of grads[c*kChunk, min((c+1)*kChunk, n)) in double, for every chunk c;
// norm_from_chunk_sums adds them in chunk order and takes the square root.
void grad_sq_chunk_sums(const float* grads, size_t n, double* out);
double norm_from_chunk_sums(const double* sums, size_t nchunks);
// torch.nn.utils.clip_grad_norm_ semantics: if max_norm > 0 and norm > max_norm, grads *=
// max_norm / (norm + 1e-6). Returns the pre-clip norm. A non-finite norm is returned without
// touching the gradients: the caller's NaN/Inf guard decides (skip the step, stop), not clipping.
double clip_grad_norm(float* grads, size_t n, double max_norm);
// The factor clip_grad_norm would scale the gradients by (1 when no clipping applies), for
// optimizers that apply it on the fly (Optimizer::step's grad_scale).
float clip_coefficient(double norm, double max_norm);

}  // namespace lathe::optim
