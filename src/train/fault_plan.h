// Faults a test injects into a training run (the LATHE_TEST_* environment variables). `lathe train`
// reads them once (src/cli/cmd_train.cpp) and hands them to train() in TrainOptions::faults, so the
// library never consults the environment mid-run and an in-process caller can plan faults directly.
#pragma once
#include <cstdint>
#include <vector>

namespace lathe {

struct FaultPlan {
  // LATHE_TEST_NONFINITE_STEPS="3,5": the gradients of these optimizer steps (1-based) become
  // non-finite, as an fp16 overflow would (one element of this rank's part of the reduced gradient
  // -- its ZeRO shard; with ZeRO 0 element 0 on every rank -- is set to +Inf).
  std::vector<int64_t> nonfinite_steps;
  // LATHE_TEST_LOSS_SPIKE_STEPS="9,10": the global loss and this rank's part of the reduced gradient
  // (so the global norm) of these steps are multiplied by loss_spike_factor
  // (LATHE_TEST_LOSS_SPIKE_FACTOR, default 100), once each per run: a step re-run after a rollback
  // is not spiked again (train_step removes a step from the list when it spikes it).
  std::vector<int64_t> loss_spike_steps;
  double loss_spike_factor = 100.0;
  // LATHE_TEST_STALL_RANK / LATHE_TEST_STALL_STEP (both set): that rank of the data-parallel group
  // stops before the gradient reduction of that step, as a hung process would; the other ranks'
  // watchdog must end the job. -1: no stall.
  int stall_rank = -1;
  int64_t stall_step = -1;
  // LATHE_TEST_CKPT_SLEEP_MS=N: every checkpoint save pauses N ms after the data files, after
  // recipe.yaml and before the rename, so a kill test can aim into those windows. 0: none.
  int checkpoint_pause_ms = 0;
  // LATHE_TEST_DEVICE_PATH_ON_HOST=1: a CPU model trains through the device step path (the CPU's
  // step ops behind the device wiring, a second host group standing in for NCCL; parallel/dist_optimizer.h),
  // so that wiring is tested bit for bit against the CPU path without a GPU.
  bool device_path_on_host = false;
};

}  // namespace lathe
