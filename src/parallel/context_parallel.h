// Context parallelism (issue 27): the sequence of every sample is cut across the ranks of a
// context group, and attention runs over the whole sequence with each rank holding its rows only.
//
// Load-balanced causal split (Megatron-Core, torchtitan): the T positions are cut into 2N chunks of
// T / (2N) and context rank i holds chunks i and 2N-1-i, so every rank has the same causal work
// (an early chunk, few keys; a late one, many). A rank's rows are in increasing global position.
//
// Attention of a rank's rows against every rank's keys/values, one block per source rank
// (kernels/cpu/ops.h "block attention": masks by global position, documents and window), the
// partial (out, lse) merged in fp32 by log-sum-exp in a fixed order: source r, r-1, r-2, ...
// (mod N) on rank r. Two ways of getting the other ranks' K/V:
//  * Ring: K/V blocks pass around the group (rank r sends to r+1, receives from r-1) with
//    Communicator::sendrecv_async, each transfer overlapped with the current block's compute.
//    Backward: dQ accumulates locally; each block's dK/dV is computed into a zeroed buffer and added
//    to a dK/dV buffer that travels with the K/V and reaches its owner after N hops, so the owner's
//    gradient is ((c_own + c_own+1) + c_own+2) + ... in ring order.
//  * All-gather: the group's K/V gathered at once; backward reduce-scatters the per-source dK/dV
//    (lathe's rank-ordered sum ((c_0 + c_1) + c_2) + ...).
// Both compute the same blocks in the same order: out, lse and dQ are bit-identical between the two;
// dK, dV are bit-identical at N = 2 (a + b = b + a) and agree to fp32 rounding for N >= 3 (the two
// sum the N contributions in different orders). Every run of one layout gives the same bits.
//
// fp32 buffers (the CPU fp32 table). Document starts are given per local query row as GLOBAL
// positions (each rank knows the whole sequence's document starts; models/documents.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "kernels/cpu/ops.h"

namespace lathe {
class Model;
struct DocumentOptions;
}

namespace lathe::parallel {

enum class ContextImpl { Ring, AllGather };
// "ring" | "allgather"; anything else is an error naming the key parallel.context_impl.
ContextImpl parse_context_impl(const std::string& s);
const char* context_impl_name(ContextImpl impl);

// Seconds this process has spent waiting for the context group's K/V and dK/dV exchanges (the ring's
// waits after each block's compute, the all-gathers and reduce-scatters): the communication the
// compute did not hide. Cumulative since the process started (the trainer records per-step deltas).
double context_comm_wait_seconds();

// Errors naming the values unless T splits into 2N chunks (T % (2N) == 0, N >= 1).
void check_context_split(int64_t T, int N);
// Global positions of context rank r's rows, increasing: chunks r and 2N-1-r of T / (2N).
std::vector<int32_t> context_rows(int64_t T, int N, int r);

struct ContextAttentionShape {
  int64_t B = 0, T = 0, H = 0, KVH = 0, D = 0;  // B: the largest micro-batch; T: the whole sequence
  float scale = 0.0f, softcap = 0.0f;           // Gemma 2's score scale and soft cap (0 = none)
};

// Attention over one context group. Collective: every rank of `group` calls forward / backward in
// the same order. Local rows Tl = 2 T / (2N) = T / N.
class ContextAttention {
 public:
  ContextAttention(dist::Communicator& group, ContextImpl impl, const ContextAttentionShape& s);

  int64_t local_rows() const { return Tl_; }
  const std::vector<int32_t>& rows() const { return rows_[static_cast<size_t>(rank_)]; }

  // qkv[B, Tl, (H + 2 KVH) D] packed as attention_forward's, this rank's rows; q_doc[B, Tl] the
  // global position of each row's document start, or nullptr (causal over the whole sequence).
  // out[B, Tl, H D] (overwritten), lse[B, H, Tl] (fp32), as attention_forward's for these rows.
  // B <= the shape's B; window: sliding window of this call (0 = none; per layer in a model).
  void forward(float* out, float* lse, const float* qkv, const int32_t* q_doc, int64_t B, int64_t window = 0);
  // dqkv[B, Tl, (H + 2 KVH) D] (overwritten) from dout[B, Tl, H D] and forward's out and lse.
  void backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                const int32_t* q_doc, int64_t B, int64_t window = 0);

 private:
  // The block kernels' description of this rank's queries against source rank src's K/V.
  struct Call {
    int64_t B = 0, window = 0, kv_floats = 0;  // kv_floats: one rank's packed K|V [B, Tl, 2 KVH D]
    const int32_t* q_doc = nullptr;
  };
  Call call(const char* fn, int64_t B, int64_t window, const int32_t* q_doc) const;
  void pack_kv(float* kv, const float* qkv, int64_t B) const;
  cpu::BlockAttention block(const Call& c, const float* qkv, const float* kv, int src) const;

  dist::Communicator& group_;
  ContextImpl impl_;
  ContextAttentionShape s_;
  int N_ = 1, rank_ = 0;
  int64_t Tl_ = 0;
  std::vector<std::vector<int32_t>> rows_;
  std::vector<float> kv_a_, kv_b_, dkv_a_, dkv_b_, dkv_tmp_, out_b_, lse_b_;
};

// Makes `m` (unallocated, fp32 host) a context-parallel rank's model: TensorShard::context_T = T (the
// RoPE tables cover the whole sequence, positions are global) and StepHooks::cp calling a
// ContextAttention over `group` for micro-batches of up to B samples. Then allocate(B, T / N) and
// before each pass set_documents(global document starts or nullptr, global positions) for this
// rank's rows (context_rows; context_batch below). `group` must outlive the model's passes.
void attach_context_parallel(Model& m, dist::Communicator& group, ContextImpl impl, int64_t B, int64_t T);

// This rank's rows of a batch of whole samples: tokens/targets [B, T] -> [B, Tl] (rows of
// context_rows), and the per-row arrays Model::set_documents takes: doc_start [B, Tl] (global
// document starts, from doc_start_full [B, T] as models/documents.h builds it; nullptr: none) and
// positions [B, Tl] (positions_full [B, T] restarting per document, or nullptr: the global position).
void context_batch(const std::vector<int32_t>& rows, int64_t B, int64_t T, const int32_t* full, int32_t* local);
void context_positions(const std::vector<int32_t>& rows, int64_t B, int64_t T, const int32_t* positions_full,
                       int32_t* positions);

// Before a pass of a context rank over whole samples tokens / targets [B, T]: this rank's rows into
// tokens_l / targets_l [B, Tl], and the model's documents set for them (set_documents: global
// document starts under data.attention: document, positions restarting per document under
// data.reset_position_ids, else the global positions). ds / pos: scratch reused between calls.
void set_context_pass(Model& m, const DocumentOptions& o, const std::vector<int32_t>& rows, const int32_t* tokens,
                      const int32_t* targets, int64_t B, int64_t T, std::vector<int32_t>& tokens_l,
                      std::vector<int32_t>& targets_l, std::vector<int32_t>& ds, std::vector<int32_t>& pos);

}  // namespace lathe::parallel
