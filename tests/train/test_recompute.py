"""recompute: none | selective | full in a recipe (issue 9): the training runs are bit-identical
(losses and final weights: recompute repeats the same operations; tests/models/test_model_recompute
checks every gradient), the activation memory the run reports shrinks none > selective > full, the
mode may change on resume (logged, not refused), and a bad value names the key."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import LATHE, check, finish, losses, patterned_data, write_recipe  # noqa: E402


def main():
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="lathe_recompute_")
    data = patterned_data(tmp, np.random.default_rng(4))
    outs = {}
    for preset, prec in (("gpt2-debug", "fp32"), ("llama-debug", "bf16")):
        for mode in ("none", "selective", "full"):
            out = os.path.join(tmp, f"{preset}_{prec}_{mode}")
            recipe = write_recipe(out, data, {"micro_batch_size": 8, "seq_len": 64, "grad_accum_steps": 2, "steps": 6,
                                              "eval_interval": 0, "log_interval": 1, "threads": 2, "peak_gflops": 100,
                                              "seed": 5},
                                  model={"preset": preset}, precision={"compute": prec}, recompute=mode,
                                  output={"dir": out, "checkpoint_every": 3})
            p = subprocess.run([LATHE, "train", recipe], capture_output=True, text=True, timeout=300)
            check(p.returncode == 0, f"{preset} {prec} recompute {mode} trains")
            act = [l for l in p.stdout.splitlines() if "memory estimate per rank" in l]
            outs[(preset, prec, mode)] = (out, act[0] if act else "")
        runs = [outs[(preset, prec, m)] for m in ("none", "selective", "full")]
        ls = [losses(o) for o, _ in runs]
        blobs = [open(os.path.join(o, "model", "model.safetensors"), "rb").read() for o, _ in runs]
        check(ls[0] == ls[1] == ls[2] and blobs[0] == blobs[1] == blobs[2],
              f"{preset} {prec}: none, selective and full give bit-identical losses and weights")
        mb = []
        for _, line in runs:
            part = line.split("activations")[1] if "activations" in line else ""
            mb.append(float(part.split("MB")[0].split()[-1]) if "MB" in part else -1)
        check(mb[0] > mb[1] > mb[2] > 0, f"{preset} {prec}: activation memory none > selective > full ({mb} MB)")
    # Resume with another mode: allowed and logged.
    out, _ = outs[("gpt2-debug", "fp32", "none")]
    r = json.load(open(out + ".yaml"))
    r["recompute"] = "full"
    r["training"]["steps"] = 8
    json.dump(r, open(out + ".yaml", "w"))
    p = subprocess.run([LATHE, "train", out + ".yaml", "--resume", "auto"], capture_output=True, text=True, timeout=300)
    check(p.returncode == 0 and "recompute" in p.stdout, "resume with another recompute mode: allowed, the change is logged")
    p = subprocess.run([LATHE, "check", out + ".yaml", "--set", "recompute=most"], capture_output=True, text=True)
    check(p.returncode == 1 and "recompute" in p.stderr and "none, selective, full" in p.stderr,
          "a bad recompute value names the key and the choices")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
