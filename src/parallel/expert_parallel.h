// Expert parallelism (issue 28 item 4; parallel.expert): the experts of every MoE layer spread over
// an expert group of E consecutive data ranks (Megatron's expert-data-parallel layout: the data
// ranks {g*E, ..., g*E + E-1} form expert group g; expert e runs on member e / (experts / E)).
//
// Per MoE layer, forward (every rank of the group, collective):
//   router, top-k, moe_permute and moe_gather locally, exactly as kernels/cpu/moe.cpp: the N*k
//   slots are sorted by expert id, so the rows for member m are one contiguous run
//   -> counts exchanged first (rows per local expert, per source), then the rows (all_to_allv)
//   -> on the owner, rows reordered (expert id, source rank, token order) and the grouped SwiGLU
//      GEMMs of its experts run over them
//   -> outputs returned through all_to_allv into the source's slot order; weighted combine in slot
//      order exactly as one process.
// Backward mirrors it: combine backward locally, the slot gradients travel to the owners, the
// experts' backward runs there (weight gradients of its experts only), input gradients travel
// back, then gather backward and the router backward locally.
//
// What is sharded: the expert compute (each rank runs the GEMMs of its experts only, over every
// token of the group routed to them). What is not (yet): the expert weights. Every rank keeps the
// whole [E, F, C] tensors; a rank's gradient of an expert it does not own stays zero, so the
// ordinary data-parallel reduction over the whole data group sums exactly the owners' gradients
// (the reduction over the expert-data group: the ranks holding that expert) and every rank applies
// the same update. Checkpoints are therefore layout-free (resume with another parallel.expert).
// Aux loss: each rank's load statistics are its own micro-batch's, as under plain data parallelism
// (models/moe_layer.cpp), so EP changes no loss.
// Arithmetic: each expert's GEMMs see the group's rows together instead of one rank's, so results
// agree with data parallelism to fp32 summation-order rounding, not bit for bit (BLAS may pick other
// kernels for other row counts; the weight gradients sum the sources' rows inside one GEMM).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "dist/comm.h"
#include "kernels/cpu/ops.h"

#include "models/model.h"

namespace lathe::parallel {

class ExpertParallel {
 public:
  // group: the expert group (its size is parallel.expert; it must divide `experts`).
  ExpertParallel(dist::Communicator& group, int64_t experts);

  // Same contracts as cpu::moe_forward / moe_backward (kernels/cpu/ops.h), collective over the
  // group; layer: which layer's saved exchange state to use (forward of layer l before its backward).
  void forward(float* out, const cpu::MoeActs& a, const float* x, const float* wr, const float* w1, const float* w3,
               const float* w2, const cpu::MoeShape& s, int64_t layer);
  void backward(float* dx, float* dwr, float* dw1, float* dw3, float* dw2, const float* dout, const float* dlogits_add,
                const cpu::MoeActs& a, const float* x, const float* wr, const float* w1, const float* w3,
                const float* w2, const cpu::MoeShape& s, float* scratch, int64_t layer);

  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return local_; }

 private:
  // One layer's exchange and what the owner's expert backward needs (rows this rank computed).
  struct Layer {
    std::vector<size_t> send_rows, recv_rows;  // per member: slots sent to it / rows received from it
    std::vector<int64_t> recv_cnt;             // [member, local expert]: rows received
    std::vector<int32_t> offsets;              // [local + 1]: local experts' row ranges (expert-major)
    std::vector<int64_t> perm;                 // expert-major row r <- received (source-major) row perm[r]
    std::vector<float> xp, gate, up, act;      // owner's rows [R, C] / [R, F]
  };
  Layer& layer(int64_t l);
  // Moves rows [.., C] of `src` (per-member runs of `send`) to `dst` (per-member runs of `recv`).
  void exchange(const float* src, const std::vector<size_t>& send, float* dst, const std::vector<size_t>& recv,
                int64_t C);

  dist::Communicator& group_;
  int64_t experts_, local_, first_;
  std::vector<Layer> layers_;
};

// Splits the data group (ranks of the same tensor/pipeline/context coordinates; the world under pure
// data parallelism) into expert groups of `expert` consecutive data ranks and installs the model's
// ExpertHooks. The returned object (and its group) must outlive the model's passes.
struct ExpertAttachment {
  std::unique_ptr<dist::Communicator> group;
  std::unique_ptr<ExpertParallel> ep;
};
ExpertAttachment attach_expert_parallel(Model& m, dist::Communicator& data, int expert);

// While it lives, the model runs every expert itself (its ExpertHooks cleared, restored at the end):
// the weights are whole on every rank, so forward-only passes that the ranks do not run in step
// (validation over uneven sample shares, task scoring, rank 0's sample) need no collective.
class LocalExperts {
 public:
  explicit LocalExperts(Model& m);
  ~LocalExperts();
  LocalExperts(const LocalExperts&) = delete;
  LocalExperts& operator=(const LocalExperts&) = delete;

 private:
  Model& m_;
  ExpertHooks saved_;
};

}  // namespace lathe::parallel
