// The op tables of the CPU backend, one per compute dtype (listed by cpu_backend().op_tables()).
#pragma once
#include "kernels/backend.h"

namespace lathe::cpu {

// fp32: the reference implementation, the kernels of kernels/cpu/ops.h as they are.
const Ops& fp32_ops();

}  // namespace lathe::cpu
