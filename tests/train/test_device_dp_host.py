#!/usr/bin/env python3
"""The trainer's device data-parallel wiring (parallel/dist_optimizer.h) end to end on
the CPU: LATHE_TEST_DEVICE_PATH_ON_HOST=1 sends the CPU model through the device path (the step
kernels are optim/'s CPU code behind the device table; a second MPI group of the same ranks stands
in for NCCL). Over MPI both paths sum in rank order with the same optimizer code, so the oracle is
exact: the device path's losses and final weights must be BIT-identical to the CPU path's for
DP = 2 with ZeRO 0/1/2 (AdamW), ZeRO 1 (LAMB, bf16 compute), one process, tensor parallelism (TP=2, with
sequence parallelism, TP=2 x DP=2 ZeRO 1; parallel/tensor_parallel_device.cpp), pipeline parallelism with its
host-staged messages (PP=2, PP=2 x DP=2 ZeRO 1 LAMB, TP=2 x PP=2), and runs checkpointed at step 4
(moments staged off the "device") and resumed (staged back), which equal the uninterrupted runs.
What this cannot check: NCCL itself, the CUDA kernels, the stream synchronisation and the 16-bit
NCCL reductions of the device hooks (tests/train/test_device_dp_train.py on
>= 2 GPUs)."""
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "parallel"))
import mpi_train  # noqa: E402
from mpi_train import ENV, MPIRUN, check, failures, run, series  # noqa: E402

TMP = tempfile.mkdtemp(prefix="lathe_devdp_host_")
TRAINING = {"micro_batch_size": 2, "seq_len": 32, "grad_accum_steps": 2, "steps": 8, "eval_interval": 0,
            "log_interval": 1, "threads": 1, "peak_gflops": 100, "seed": 5}
DEVICE_ENV = dict(ENV, LATHE_TEST_DEVICE_PATH_ON_HOST="1")


def train(np_, data, name, device_path, extra=(), env=None, **kw):
    out = os.path.join(TMP, name)
    r = mpi_train.write_recipe(data, "gpt2-debug", out, TRAINING, **kw)
    p, dt = run(np_, ["train", r, "--quiet", *extra], env=dict(DEVICE_ENV if device_path else ENV, **(env or {})))
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-3000:])
    check(p.returncode == 0, f"{name}: mpirun -np {np_} trains ({dt:.1f} s)")
    hooked = "LATHE_TEST_DEVICE_PATH_ON_HOST: the cpu model trains through the device path" in p.stderr
    check(hooked == device_path, f"{name}: {'through' if device_path else 'not through'} the device path")
    return out


def same(a, b):
    blob = lambda d: open(os.path.join(d, "model", "model.safetensors"), "rb").read()  # noqa: E731
    return series(a, "loss") == series(b, "loss") and len(series(a, "loss")) == TRAINING["steps"] and blob(a) == blob(b)


def main():
    if not MPIRUN:
        print("SKIPPED: mpirun not found (apt-get install openmpi-bin); this is not a pass")
        return 77
    data = mpi_train.make_data(TMP)
    for z in (0, 1, 2):
        cpu = train(2, data, f"cpu_zero{z}", False, parallel__zero=z)
        dev = train(2, data, f"dev_zero{z}", True, parallel__zero=z)
        check(same(dev, cpu), f"DP=2 ZeRO {z}: the device path's losses and final weights are bit-identical to the CPU path's")
    # Buckets reduced after backward instead of from the grads_ready hook (parallel/dist_optimizer.h).
    dev = train(2, data, "dev_zero1_after", True, env={"LATHE_DEVICE_DP_OVERLAP": "0"}, parallel__zero=1)
    check(same(dev, os.path.join(TMP, "cpu_zero1")), "DP=2 ZeRO 1, LATHE_DEVICE_DP_OVERLAP=0: bit-identical to the CPU path")
    cpu = train(2, data, "cpu_lamb", False, parallel__zero=1, optimizer__name="lamb")
    dev = train(2, data, "dev_lamb", True, parallel__zero=1, optimizer__name="lamb")
    check(same(dev, cpu), "DP=2 ZeRO 1 LAMB: bit-identical to the CPU path")
    cpu = train(2, data, "cpu_bf16", False, parallel__zero=1, precision__compute="bf16")
    dev = train(2, data, "dev_bf16", True, parallel__zero=1, precision__compute="bf16")
    check(same(dev, cpu), "DP=2 ZeRO 1 bf16 compute: bit-identical to the CPU path")
    cpu1 = train(1, data, "cpu_one", False, training__grad_accum_steps=4)
    dev1 = train(1, data, "dev_one", True, training__grad_accum_steps=4)
    check(same(dev1, cpu1), "one process: bit-identical to the CPU path")

    # Tensor parallelism (parallel/tensor_parallel_device.cpp: its device hooks (fp32) over a second group standing in
    # for NCCL, the norm over the owned ranges): TP=2, TP=2 with sequence parallelism, TP=2 x DP=2 with ZeRO 1.
    for name, np_, kw in (("tp2", 2, {}), ("tp2_sp", 2, {"parallel__sequence": True}),
                          ("tp2_dp2_zero1", 4, {"parallel__zero": 1, "training__grad_accum_steps": 1})):
        cpu = train(np_, data, f"cpu_{name}", False, parallel__tensor=2, **kw)
        dev = train(np_, data, f"dev_{name}", True, parallel__tensor=2, **kw)
        check(same(dev, cpu), f"{name}: the device path is bit-identical to the CPU path")

    # Pipeline parallelism (its messages and the tied wte's all-reduce staged through host buffers as
    # for a device stage): PP=2 (GPT-2: tied), PP=2 x DP=2 ZeRO 1 with LAMB, TP=2 x PP=2.
    for name, np_, kw in (("pp2", 2, {}),
                          ("pp2_dp2_zero1_lamb", 4, {"parallel__zero": 1, "optimizer__name": "lamb"}),
                          ("tp2_pp2", 4, {"parallel__tensor": 2})):
        cpu = train(np_, data, f"cpu_{name}", False, parallel__pipeline=2, **kw)
        dev = train(np_, data, f"dev_{name}", True, parallel__pipeline=2, **kw)
        check(same(dev, cpu), f"{name}: the device path is bit-identical to the CPU path")

    # Checkpoint at step 4 on the device path (ZeRO 1: each rank's moment shard downloaded), resume
    # on it (uploaded): the same bits as the uninterrupted CPU run.
    ref = os.path.join(TMP, "cpu_zero1")
    ck = train(2, data, "dev_ck", True, extra=("--stop-after", "4"), parallel__zero=1, output__checkpoint_every=4)
    check(os.path.isdir(os.path.join(ck, "checkpoints", "step_00000004")), "the device path saved a checkpoint at step 4")
    train(2, data, "dev_ck", True, extra=("--resume", "auto"), parallel__zero=1, output__checkpoint_every=4)
    check(same(ck, ref), "checkpointed at step 4 and resumed on the device path: bit-identical to the uninterrupted run")
    ref = os.path.join(TMP, "cpu_tp2")
    ck = train(2, data, "dev_tp_ck", True, extra=("--stop-after", "4"), parallel__tensor=2, output__checkpoint_every=4)
    train(2, data, "dev_tp_ck", True, extra=("--resume", "auto"), parallel__tensor=2, output__checkpoint_every=4)
    check(same(ck, ref), "TP=2 checkpointed at step 4 and resumed on the device path: bit-identical to the uninterrupted run")

    print(f"{len(failures)} failed" if failures else "all checks passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    rc = main()
    shutil.rmtree(TMP, ignore_errors=True)
    sys.exit(rc)
