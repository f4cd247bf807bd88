// Per-kernel-kind profiler spans without touching the call sites (issue 13 item 1): the model calls
// kernels only through an Ops table (kernels/backend.h), so it is given a copy of its table whose
// every kernel slot opens a trace::Scope named after the slot (Cat::Kernel, e.g.
// "matmul_forward", "attention_backward") and calls the original. When profiling is off a call
// costs one more indirect call and one relaxed atomic load (trace.h), against kernels of
// microseconds and more. The *_scratch_bytes slots are copied as they are (not kernels).
#pragma once
#include "kernels/backend.h"

namespace lathe {

// The traced twin of `inner` (built once per table, process lifetime; at most 8 distinct tables).
const Ops& traced_ops(const Ops& inner);
// The table a traced twin wraps (Model::ops() is the traced twin of the table the model was built
// with); `t` itself when it is not a traced table.
const Ops& untraced_ops(const Ops& t);

}  // namespace lathe
