// A model's residency: its parameters and gradients in backend memory (upload/download between
// the host fp32 buffers and a device's), the input-id staging ring that overlaps the next
// micro-batch's copy with this one's compute, and the compute-dtype copies of the weights (bf16 /
// fp16 runs keep fp32 masters on the host side of the table and compute from these).
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/ops_bf16.h"
#include "models/model.h"

namespace lathe {

void Model::upload_params() {
  if (on_device()) backend_->copy(dparams_.data(), params_.data(), params_.bytes(), CopyKind::HostToDevice);
}

void Model::download_params() {
  if (!on_device()) return;
  backend_->copy(params_.data(), dparams_.data(), params_.bytes(), CopyKind::DeviceToHost);
  backend_->synchronize();
}

void Model::download_grads() {
  if (!on_device() || !has_gradients()) return;
  backend_->copy(grads_.data(), dgrads_.data(), grads_.bytes(), CopyKind::DeviceToHost);
  backend_->synchronize();
}

int Model::stage_ids(const int32_t* host, int64_t n, int kind, bool prefetched) {
  DeviceBuffer& buf = kind == 0 ? dtokens_ : dtargets_;
  const int64_t per_slot = max_B_ * max_T_;
  LATHE_CHECK(n >= 0 && n <= per_slot && static_cast<size_t>(per_slot * kIdSlots) <= buf.size(),
              "model: {} ids exceed the {} a device slot holds (allocate() first)", n, per_slot);
  StagedIds* slots = staged_[kind];
  // A free slot, else the oldest one that no coming pass waits for, else the oldest.
  int victim = -1;
  for (int pass = 0; pass < 3 && victim < 0; ++pass)
    for (int i = 0; i < kIdSlots; ++i) {
      const StagedIds& e = slots[i];
      const bool ok = pass == 0 ? e.host == nullptr : pass == 1 ? !e.prefetched : true;
      if (ok && (victim < 0 || e.age < slots[victim].age)) victim = i;
    }
  // The copy is ordered after the work issued so far, which may still read this slot's old ids.
  StagedIds& e = slots[victim];
  e.ticket = backend_->stage_upload(static_cast<int32_t*>(buf.data()) + victim * per_slot, host,
                                    static_cast<size_t>(n) * sizeof(int32_t));
  e.host = host;
  e.n = n;
  e.age = ++staged_age_;
  e.prefetched = prefetched;
  return victim;
}

void Model::stage_inputs(const int32_t* tokens, const int32_t* targets, int64_t n) {
  if (!on_device()) return;
  const int32_t* arrays[2] = {tokens, targets};
  for (int kind = 0; kind < 2; ++kind) {
    if (arrays[kind] == nullptr) continue;
    for (StagedIds& e : staged_[kind])  // an older copy of the same array is stale
      if (e.host == arrays[kind]) e = StagedIds{};
    stage_ids(arrays[kind], n, kind, true);
  }
}

void Model::drop_staged_inputs() {
  for (auto& slots : staged_)
    for (StagedIds& e : slots) e = StagedIds{};
}

const int32_t* Model::to_backend(const int32_t* host, int64_t n, bool tokens, bool pass_start) {
  if (!on_device() || host == nullptr) return host;
  const int kind = tokens ? 0 : 1;
  StagedIds* slots = staged_[kind];
  // Copies made by earlier passes: the host array may have been refilled since (only stage_inputs'
  // callers promise otherwise). Targets are read once per pass, so theirs never carry over.
  if (pass_start || !tokens)
    for (int i = 0; i < kIdSlots; ++i)
      if (!slots[i].prefetched) slots[i] = StagedIds{};
  int slot = -1;
  for (int i = 0; i < kIdSlots; ++i)
    if (slots[i].host == host && slots[i].n == n) slot = i;
  if (slot < 0) slot = stage_ids(host, n, kind, false);
  slots[slot].prefetched = false;  // consumed by this pass
  backend_->wait_staged(slots[slot].ticket);
  return static_cast<const int32_t*>((tokens ? dtokens_ : dtargets_).data()) + slot * max_B_ * max_T_;
}

void Model::refresh_compute_weights() {
  if (cweights_.size() == 0) return;
  if (on_device()) {
    // The fp32 masters are on the device (the optimizer wrote them there): converted there when
    // the backend can (CUDA: convert.cu), else on the host from a downloaded copy, then uploaded.
    if (backend_->convert_from_f32(cweights_.data(), cweights_.dtype(), static_cast<const float*>(dparams_.data()),
                                   static_cast<int64_t>(table_.total()))) {
      cweights_refreshed_ = true;
      return;
    }
    download_params();
    const int64_t n = static_cast<int64_t>(table_.total());
    std::vector<uint16_t> tmp(static_cast<size_t>(n));
    if (cweights_.dtype() == DType::BF16)
      cpu::convert_fp32_to_bf16(tmp.data(), params_.data(), n);
    else
      for (int64_t i = 0; i < n; ++i) tmp[static_cast<size_t>(i)] = fp32_to_fp16(params_.data()[i]);
    backend_->copy(cweights_.data(), tmp.data(), cweights_.bytes(), CopyKind::HostToDevice);
    backend_->synchronize();
    cweights_refreshed_ = true;
    return;
  }
  // Every tensor (norm weights and biases too, which the kernels read in fp32 from the masters):
  // one conversion of the whole flat buffer is simpler than walking the GEMM weights and costs
  // about one pass over the parameters, small against a training step.
  refresh_compute_weights(cw_begin_, std::min(cw_end_, table_.total()));
  cweights_refreshed_ = true;
}

void Model::refresh_compute_weights(size_t begin, size_t end) {
  if (cweights_.size() == 0 || begin >= end) return;
  LATHE_CHECK(!on_device() && end <= table_.total(),
              "model: the weight copies of [{}, {}) converted on a {} model of {} parameters (host models only)", begin,
              end, backend_->name(), table_.total());
  const int64_t n = static_cast<int64_t>(end - begin);
  auto* dst = static_cast<uint16_t*>(cweights_.data()) + begin;
  const float* src = params_.data() + begin;
  switch (cweights_.dtype()) {
    case DType::BF16:
      cpu::convert_fp32_to_bf16(dst, src, n);
      break;
    case DType::F16: {
#pragma omp parallel for schedule(static) if (n >= (1 << 15))
      for (int64_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
      break;
    }
    default:
      throw_error("model: no weight copies for compute dtype {}", compute_dtype_name(cweights_.dtype()));
  }
}

void Model::keep_compute_weights(size_t begin, size_t end) {
  LATHE_CHECK(begin <= end && end <= table_.total() && !on_device(),
              "model: keep_compute_weights({}, {}) on a {} model of {} parameters (host models only)", begin, end,
              backend_->name(), table_.total());
  cw_begin_ = begin;
  cw_end_ = end;
}

void Model::check_compute_weights() const {
  if (cweights_.size() == 0) return;
  LATHE_CHECK(cweights_refreshed_,
              "model: the {} weight copies were never filled from the fp32 weights; call "
              "refresh_compute_weights() after setting or loading the weights (init_weights and load_hf_weights do)",
              compute_dtype_name(cweights_.dtype()));
  if (on_device()) return;  // device copies are only refreshed as a whole (no per-pass sampling there)
  // ZeRO 3 (keep_compute_weights): only this rank's range is current between passes.
  const int64_t lo = static_cast<int64_t>(std::min(cw_begin_, table_.total()));
  const int64_t n = static_cast<int64_t>(std::min(cw_end_, table_.total())) - lo;
  if (n <= 0) return;
  const auto* copy = static_cast<const uint16_t*>(cweights_.data());
  const bool bf16 = cweights_.dtype() == DType::BF16;
  for (int64_t k = 0; k < kWeightSamples; ++k) {
    // Evenly spread samples, the last element included; 2 x 16-bit compares per sample.
    const int64_t i = lo + (n <= 1 ? 0 : k * (n - 1) / (kWeightSamples - 1));
    if (i >= lo + n) break;
    const uint16_t want = bf16 ? fp32_to_bf16(params_.data()[i]) : fp32_to_fp16(params_.data()[i]);
    if (copy[i] == want) continue;
    const ParamSpec* owner = nullptr;
    for (const ParamSpec& s : table_.specs())
      if (static_cast<int64_t>(s.offset) <= i && i < static_cast<int64_t>(s.offset) + s.numel()) owner = &s;
    throw_error(
        "model: the {} weight copies are stale: element {} of '{}' is {} in the fp32 weights but {} in the copy; "
        "call refresh_compute_weights() after every optimizer step and after loading weights",
        compute_dtype_name(cweights_.dtype()), owner ? i - static_cast<int64_t>(owner->offset) : i,
        owner ? owner->name : std::string("?"), params_.data()[i],
        bf16 ? bf16_to_fp32(copy[i]) : fp16_to_fp32(copy[i]));
  }
}

// ZeRO 3's shard-only startup: the shard's values of init_weights(seed) (models/model.h).
void Model::init_weights(uint64_t seed, size_t begin, size_t end) {
  LATHE_CHECK(params_.size() == table_.total() && begin <= end && end <= table_.total(),
              "model: init_weights of [{}, {}) on a model of {} parameters", begin, end, params_.size());
  for (const ParamSpec& s : table_.specs()) {
    const size_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + static_cast<size_t>(s.numel()));
    if (lo < hi)
      init_param_values(s, seed, params_.data() + lo, static_cast<int64_t>(lo - s.offset),
                        static_cast<int64_t>(hi - s.offset));
  }
  upload_params();
  refresh_compute_weights();
}

}  // namespace lathe
