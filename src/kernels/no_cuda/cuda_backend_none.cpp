// Builds without CUDA (LATHE_CUDA=OFF): the backend named "cuda" is the stand-in that refuses use.
// (With CUDA, kernels/cuda/backend_cuda.cpp defines cuda_backend(); the stand-in stays linked for
// tests of the refusal path.)
#include "kernels/backend.h"

namespace lathe {

const Backend& cuda_backend() { return no_cuda_backend(); }

}  // namespace lathe
