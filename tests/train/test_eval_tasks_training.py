"""In-training multiple-choice evaluation (issue 13 item 7; recipe training.eval_tasks): the run
scores the task file every training.eval_tasks_interval steps and at the end, writing tasks_acc /
tasks_acc_norm / tasks_items to metrics.jsonl and a log line; the end-of-run figures equal `lathe
eval --tasks` on the saved model exactly (same code, same weights: seq_len = n_positions so the
contexts are cut the same way). Under mpirun -np 2 each replica scores half of the items and the
counts are all-reduced: tasks_items is the whole file and the accuracy again equals `lathe eval
--tasks` on that run's model. A missing task file is refused before training, naming the key."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import ENV, LATHE, MPIRUN, check, finish, patterned_data, write_recipe  # noqa: E402


def main():
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="lathe_eval_tasks_training_")
    rng = np.random.default_rng(7)
    # Patterned sequences so that a few steps already prefer some endings over others.
    data = patterned_data(tmp, rng)
    tasks = os.path.join(tmp, "tasks.jsonl")
    with open(tasks, "w") as f:
        for i in range(13):  # odd: the two replicas score 7 and 6 items
            k = i % 5 + 1
            start = int(rng.integers(0, 50))
            ctx = [(start + j) * k % 96 for j in range(int(rng.integers(4, 90)))]  # some longer than 64: cut
            right = [(start + len(ctx) + j) * k % 96 for j in range(3)]
            wrong = [[int(x) for x in rng.integers(0, 96, int(rng.integers(1, 5)))] for _ in range(2)]
            endings = wrong[:i % 3] + [right] + wrong[i % 3:]
            f.write(json.dumps({"context_ids": ctx, "ending_ids": endings, "label": i % 3}) + "\n")

    def recipe(out, tasks_path=tasks):
        return write_recipe(out, data, {"micro_batch_size": 2, "seq_len": 64, "steps": 8, "eval_interval": 0,
                                        "log_interval": 1, "threads": 1, "peak_gflops": 100, "seed": 3,
                                        "eval_tasks": tasks_path, "eval_tasks_interval": 3},
                            model={"preset": "gpt2-debug", "n_positions": 64})

    def task_recs(out):
        return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"tasks_acc"' in l]

    def cli(out):
        p = subprocess.run([LATHE, "eval", "--model", os.path.join(out, "model"), "--tasks", tasks, "--json",
                            "--no-progress"], capture_output=True, text=True, timeout=300)
        return json.loads(p.stdout) if p.returncode == 0 else None

    one = os.path.join(tmp, "one")
    p = subprocess.run([LATHE, "train", recipe(one)], capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, "training with training.eval_tasks")
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:])
        return 1
    recs = task_recs(one)
    check([r["step"] for r in recs] == [3, 6, 8], f"tasks scored at steps 3, 6 and the end ({[r['step'] for r in recs]})")
    check(all(r["tasks_items"] == 13 and 0 <= r["tasks_acc"] <= 1 for r in recs), "every score covers the 13 items")
    logged = [l for l in p.stdout.splitlines() if "| tasks " in l and "acc_norm" in l]
    check(len(logged) == 3, f"a log line per score ({len(logged)})")
    ref = cli(one)
    check(ref is not None and ref["acc"] == recs[-1]["tasks_acc"] and ref["acc_norm"] == recs[-1]["tasks_acc_norm"],
          f"end of run equals lathe eval --tasks on the saved model (run {recs[-1]['tasks_acc']:.4f}/"
          f"{recs[-1]['tasks_acc_norm']:.4f}, eval {ref and ref['acc']}/{ref and ref['acc_norm']})")
    # The equality above is not vacuous: the endings get distinct log-likelihoods.
    check(ref is not None and len({round(x, 6) for it in ref["per_item"] for x in it["loglik"]}) > 13,
          "the endings get distinct log-likelihoods")

    if MPIRUN:
        dp = os.path.join(tmp, "dp")
        p = subprocess.run([MPIRUN, "-np", "2", LATHE, "train", recipe(dp), "--quiet"], capture_output=True,
                           text=True, timeout=600, env=ENV)
        check(p.returncode == 0, "mpirun -np 2 with training.eval_tasks")
        if p.returncode == 0:
            recs = task_recs(dp)
            ref = cli(dp)
            check([r["step"] for r in recs] == [3, 6, 8] and all(r["tasks_items"] == 13 for r in recs),
                  "data parallel: every score covers all 13 items (7 + 6, all-reduced)")
            check(ref is not None and ref["acc"] == recs[-1]["tasks_acc"] and ref["acc_norm"] == recs[-1]["tasks_acc_norm"],
                  "data parallel: the end of run equals lathe eval --tasks on its saved model")
        else:
            print(p.stdout[-2000:], p.stderr[-2000:])
        # Tensor parallel: the shards' logits are vocab-parallel, forward_logits gathers the whole
        # vocabulary for scoring; the result equals lathe eval --tasks on the saved (whole) model.
        tp = os.path.join(tmp, "tp")
        p = subprocess.run([MPIRUN, "-np", "2", LATHE, "train", recipe(tp), "--quiet", "--set", "parallel.tensor=2"],
                           capture_output=True, text=True, timeout=600, env=ENV)
        check(p.returncode == 0, "mpirun -np 2 with parallel.tensor=2 and training.eval_tasks")
        if p.returncode == 0:
            recs = task_recs(tp)
            ref = cli(tp)
            check([r["step"] for r in recs] == [3, 6, 8] and all(r["tasks_items"] == 13 for r in recs),
                  "tensor parallel: every score covers all 13 items")
            check(ref is not None and ref["acc"] == recs[-1]["tasks_acc"] and ref["acc_norm"] == recs[-1]["tasks_acc_norm"],
                  "tensor parallel: the end of run equals lathe eval --tasks on its saved model")
        else:
            print(p.stdout[-2000:], p.stderr[-2000:])
        # Pipeline (PP=2: one layer per stage) and tensor x pipeline (4 ranks): the stages run each
        # ending's forward together, the last stage scores; equal to lathe eval --tasks again.
        for name, np_, sets in [("pipeline", 2, ["parallel.pipeline=2"]),
                                ("tensor x pipeline", 4, ["parallel.pipeline=2", "parallel.tensor=2"])]:
            out = os.path.join(tmp, name.replace(" ", "_"))
            args = [a for s in sets + ["training.grad_accum_steps=2"] for a in ("--set", s)]
            p = subprocess.run([MPIRUN, "-np", str(np_), LATHE, "train", recipe(out), "--quiet", *args],
                               capture_output=True, text=True, timeout=600, env=ENV)
            check(p.returncode == 0, f"mpirun -np {np_} with {name} and training.eval_tasks")
            if p.returncode != 0:
                print(p.stdout[-2000:], p.stderr[-2000:])
                continue
            recs = task_recs(out)
            ref = cli(out)
            check([r["step"] for r in recs] == [3, 6, 8] and all(r["tasks_items"] == 13 for r in recs),
                  f"{name}: every score covers all 13 items")
            check(ref is not None and ref["acc"] == recs[-1]["tasks_acc"] and ref["acc_norm"] == recs[-1]["tasks_acc_norm"],
                  f"{name}: the end of run equals lathe eval --tasks on its saved model")
    else:
        print("note: mpirun not found, the data-parallel split was not checked")

    bad = os.path.join(tmp, "bad")
    p = subprocess.run([LATHE, "train", recipe(bad, os.path.join(tmp, "missing.jsonl"))], capture_output=True,
                       text=True, timeout=300)
    check(p.returncode == 1 and "training.eval_tasks" in p.stderr and "missing.jsonl" in p.stderr
          and not os.path.exists(os.path.join(bad, "model")),
          f"a missing task file is refused naming the key and the file ({p.stderr.strip()[-200:]})")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
