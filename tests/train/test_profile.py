"""lathe train --profile-steps (issue 13): the trace is Chrome trace-event JSON, spans nest per
thread, each profiled step is one "step" span whose duration matches the step time the run logs
(within 5%), the step holds the data wait, the micro-batches and the optimizer, each micro-batch holds forward and backward spans per layer
(with the layer index) and each kernel call a span of its kind; profiling does not
change the losses; under mpirun every rank writes its own trace with the collectives on the
communication thread's track. A bad --profile-steps is a usage error."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import ENV, LATHE, MPIRUN, check, finish, losses, patterned_data, write_recipe  # noqa: E402


def spans_nest(events):
    by_tid = {}
    for e in events:
        if e["ph"] == "X":
            by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for tid, ev in by_tid.items():
        ev.sort(key=lambda x: (x[0], -x[1]))
        stack = []
        for b, e, n in ev:
            while stack and stack[-1] <= b + 1e-3:
                stack.pop()
            if stack and e > stack[-1] + 1e-3:
                return False, f"{n} on tid {tid} overlaps its parent"
            stack.append(e)
    return True, ""


def main():
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="lathe_profile_")
    data = patterned_data(tmp, np.random.default_rng(2))

    def recipe(out):
        return write_recipe(out, data, {"micro_batch_size": 2, "seq_len": 32, "grad_accum_steps": 2, "steps": 6,
                                        "eval_interval": 0, "log_interval": 1, "threads": 1, "peak_gflops": 100,
                                        "seed": 5})

    plain, prof = os.path.join(tmp, "plain"), os.path.join(tmp, "prof")
    p0 = subprocess.run([LATHE, "train", recipe(plain), "--quiet"], capture_output=True, text=True, timeout=300)
    p1 = subprocess.run([LATHE, "train", recipe(prof), "--quiet", "--profile-steps", "3-4"], capture_output=True,
                        text=True, timeout=300)
    check(p0.returncode == 0 and p1.returncode == 0, "training with and without --profile-steps")
    check(losses(plain) == losses(prof), "profiling does not change the losses")
    path = os.path.join(prof, "trace", "rank00000.json")
    check(os.path.exists(path) and "profile: wrote" in p1.stdout, "OUTPUT/trace/rank00000.json written and logged")
    tr = json.load(open(path))
    ev = tr["traceEvents"]
    ok, why = spans_nest(ev)
    check(ok, f"spans nest on every thread {why}")
    steps = [e for e in ev if e["ph"] == "X" and e["name"] == "step"]
    check([e["args"]["index"] for e in steps] == [3, 4], f"one step span per profiled step ({len(steps)})")
    recs = {json.loads(l)["step"]: json.loads(l) for l in open(os.path.join(prof, "metrics.jsonl")) if '"loss"' in l}
    worst = max(abs(e["dur"] / 1e3 - recs[e["args"]["index"]]["ms_per_step"]) / recs[e["args"]["index"]]["ms_per_step"]
                for e in steps)
    check(worst < 0.05, f"step span durations match the logged step times within 5% (worst {worst:.2%})")
    names = {e["name"] for e in ev if e["ph"] == "X"}
    check({"data wait", "forward+backward micro-batch", "grad norm + optimizer"} <= names, f"the step's parts ({sorted(names)})")
    mb = [e for e in ev if e["ph"] == "X" and e["name"] == "forward+backward micro-batch"]
    check(len(mb) == 4, f"two micro-batches per step ({len(mb)})")
    # Per-layer spans (gpt2-debug: 2 layers): every micro-batch runs the embedding, each layer forward,
    # the head, each layer backward and the embedding backward, nested inside the micro-batch span.
    n_layer = 2
    for kind in ("layer forward", "layer backward"):
        per = sorted(e["args"]["index"] for e in ev if e["ph"] == "X" and e["name"] == kind)
        check(per == sorted(list(range(n_layer)) * len(mb)),
              f"one '{kind}' span per layer per micro-batch, layer index in args ({per})")
    for kind in ("embedding forward", "embedding backward", "head forward+backward"):
        c = sum(1 for e in ev if e["ph"] == "X" and e["name"] == kind)
        check(c == len(mb), f"one '{kind}' span per micro-batch ({c})")
    inside = all(any(m["ts"] <= e["ts"] and e["ts"] + e["dur"] <= m["ts"] + m["dur"] + 1e-3 for m in mb)
                 for e in ev if e["ph"] == "X" and e["name"].startswith("layer "))
    check(inside, "layer spans lie inside their micro-batch span")
    # Per-kernel-kind spans (models/traced_ops.h): every kernel call is a "kernel" span named after
    # its op-table slot, nested in its layer (spans_nest above covers them too).
    kern = [e for e in ev if e["ph"] == "X" and e["cat"] == "kernel"]
    knames = {e["name"] for e in kern}
    # (GPT-2's fc GEMM, bias and GELU are one slot, matmul_bias_gelu_forward: the fused epilogue.)
    want = {"matmul_forward", "matmul_backward", "attention_forward", "attention_backward", "layernorm_forward",
            "layernorm_backward", "matmul_bias_gelu_forward", "gelu_backward", "lm_head_loss", "embedding_forward"}
    check(want <= knames, f"kernel spans by kind ({sorted(knames)})")
    # GPT-2 forward per layer: qkv, attention output and proj GEMMs = 3 matmul_forward, and the fc
    # GEMM with its GELU = 1 matmul_bias_gelu_forward.
    mf = sum(1 for e in kern if e["name"] == "matmul_forward")
    check(mf == 3 * n_layer * len(mb), f"3 matmul_forward per layer per micro-batch ({mf})")
    mg = sum(1 for e in kern if e["name"] == "matmul_bias_gelu_forward")
    check(mg == n_layer * len(mb), f"1 matmul_bias_gelu_forward per layer per micro-batch ({mg})")
    # The optimizer share in metrics.jsonl is the optimizer span's share of the step.
    opt = {e["ts"]: e["dur"] for e in ev if e["ph"] == "X" and e["name"] == "grad norm + optimizer"}
    st3 = [e for e in steps if e["args"]["index"] == 3][0]
    span_opt = [d for t, d in opt.items() if st3["ts"] <= t <= st3["ts"] + st3["dur"]][0]
    logged = recs[3]["optimizer_ms"]
    check(abs(span_opt / 1e3 - logged) <= 0.05 * max(logged, 0.1) + 0.05,
          f"optimizer_ms in metrics matches the optimizer span ({logged:.3f} ms vs {span_opt / 1e3:.3f} ms)")

    if MPIRUN:
        dp = os.path.join(tmp, "dp")
        r = recipe(dp)
        p = subprocess.run([MPIRUN, "-np", "2", LATHE, "train", r, "--quiet", "--profile-steps", "2-3"],
                           capture_output=True, text=True, timeout=300, env=ENV)
        check(p.returncode == 0, "mpirun -np 2 with --profile-steps")
        for rank in (0, 1):
            f = os.path.join(dp, "trace", f"rank{rank:05d}.json")
            ok = os.path.exists(f)
            ev = json.load(open(f))["traceEvents"] if ok else []
            names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
            comm = [e for e in ev if e["ph"] == "X" and e["cat"] == "comm" and e["name"] == "all_reduce"]
            check(ok and all(e["pid"] == rank for e in ev) and any(n.startswith("comm ") for n in names) and comm
                  and all(e["args"]["bytes"] > 0 for e in comm),
                  f"rank {rank}: its own trace (pid {rank}) with all_reduce spans and bytes on the comm track")
    else:
        print("note: mpirun not found, the multi-rank trace was not checked")
    p = subprocess.run([LATHE, "train", recipe(os.path.join(tmp, "bad")), "--profile-steps", "5-2"],
                       capture_output=True, text=True)
    check(p.returncode == 2 and "--profile-steps" in p.stderr, "--profile-steps 5-2 is a usage error")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
