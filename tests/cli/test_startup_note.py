#!/usr/bin/env python3
"""The start-up wait-policy note (core/blas_env.h: "lathe: note: N OpenMP threads x ... > M CPUs:
threads wait passively") is printed for invocations that run a command, not for `lathe --version`,
`lathe --help`, the usage text, an unknown command or a command's --help (issue 22). The note is
provoked by asking for more OpenMP threads than this process may use CPUs, with the wait policy
left to lathe (OMP_WAIT_POLICY, GOMP_SPINCOUNT and the re-exec marker removed from the environment)."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LATHE = os.environ.get("LATHE_BIN") or os.path.join(
    os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
NOTE = "threads wait passively"

env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LATHE_RUNTIME_SET")}
env["OMP_NUM_THREADS"] = str(2 * len(os.sched_getaffinity(0)) + 1)  # more threads than CPUs on any machine
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(args):
    p = subprocess.run([LATHE] + args, capture_output=True, text=True, timeout=60, env=env)
    return p.returncode, p.stderr


# A command that runs (here it fails at once on a missing recipe): the note comes first.
rc, err = run(["check", "/nonexistent/recipe.yaml"])
check(rc == 1 and NOTE in err and "lathe check: error:" in err, f"lathe check prints the note (exit {rc}): {err!r}")
for args, want_rc in ((["--version"], 0), (["--help"], 0), (["-h"], 0), ([], 2), (["no-such-command"], 2),
                      (["train", "--help"], 0), (["generate", "-h"], 0)):
    rc, err = run(args)
    check(rc == want_rc and NOTE not in err and "lathe: note:" not in err,
          f"lathe {' '.join(args)}: exit {want_rc}, no note ({rc}: {err[:300]!r})")
print(f"{len(failures)} failed" if failures else "all passed")
sys.exit(1 if failures else 0)
