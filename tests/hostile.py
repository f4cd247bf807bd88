"""Harness for the hostile-input regression tests (tests/<area>/test_hostile_*.py).

Each case runs the lathe binary on a malformed input and asserts what the user must see:
  * the exit code (1 for bad input, 2 for a usage error), never a signal or a sanitizer report;
  * an error line "lathe CMD: error: ..." that names the file / field (substrings given by the case);
  * bounded time (a hang fails the case) and bounded memory: an address-space limit (RLIMIT_AS)
    in Release; under ASan/UBSan (LATHE_SANITIZED=1, ASan reserves terabytes of address space)
    ASan's hard_rss_limit_mb instead.

    from hostile import run_lathe, Cases
    cases = Cases()
    with cases.case("deep JSON in tokenizer.json"):
        run_lathe(["encode", "--tokenizer", d], rc=1, must=["tokenizer.json", "nests deeper"])
    cases.finish()   # exits non-zero when any case failed, listing them
"""
import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback

LATHE = os.environ.get("LATHE_BIN") or os.path.join(os.environ.get("LATHE_BINARY_DIR", "build"), "lathe")
SANITIZED = os.environ.get("LATHE_SANITIZED", "0") in ("1", "ON", "TRUE", "true")


class Failure(AssertionError):
    pass


def run_lathe(args, *, rc=1, must=(), must_not=(), timeout=60, mem_mb=3072, stdin=None, cwd=None, env=None,
              stream="stderr"):
    """Runs `lathe ARGS`; checks exit code `rc` (int or tuple), that the chosen stream contains
    every string of `must` and none of `must_not`, and that the run ends within `timeout` seconds
    under a `mem_mb` memory limit. Returns the CompletedProcess."""
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    if env:
        e.update(env)
    preexec = None
    if SANITIZED:
        e["ASAN_OPTIONS"] = f"detect_leaks=0:hard_rss_limit_mb={mem_mb}:allocator_may_return_null=0"
        e["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    else:
        limit = mem_mb * 1024 * 1024

        def preexec():  # noqa: F811
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    t0 = time.time()
    try:
        p = subprocess.run([LATHE] + [str(a) for a in args], input=stdin, capture_output=True, timeout=timeout,
                           cwd=cwd, env=e, preexec_fn=preexec)
    except subprocess.TimeoutExpired:
        raise Failure(f"lathe {' '.join(map(str, args))}: no exit within {timeout} s (a hang)")
    dt = time.time() - t0
    out = p.stdout.decode("utf-8", "replace")
    err = p.stderr.decode("utf-8", "replace")
    text = err if stream == "stderr" else out if stream == "stdout" else out + err
    where = f"lathe {' '.join(map(str, args))[:300]} (exit {p.returncode}, {dt:.1f} s)\nstderr: {err[-3000:]}"
    if p.returncode < 0:
        raise Failure(f"killed by signal {-p.returncode}: {where}")
    for bad in ("AddressSanitizer", "runtime error:", "LeakSanitizer", "terminate called", "Aborted"):
        if bad in err:
            raise Failure(f"sanitizer/abort report '{bad}': {where}")
    want = rc if isinstance(rc, tuple) else (rc,)
    if p.returncode not in want:
        raise Failure(f"expected exit {rc}: {where}")
    for s in must:
        if s not in text:
            raise Failure(f"'{s}' missing from {stream}: {where}")
    for s in must_not:
        if s in text:
            raise Failure(f"'{s}' must not appear in {stream}: {where}")
    if p.returncode in (1, 2) and stream == "stderr" and "error" not in err:
        raise Failure(f"a failing run must print an error line: {where}")
    return p


def error_text(p):
    """The text after "lathe CMD: error: " in the stderr of CompletedProcess p (to compare the
    messages of two commands); a Failure when there is no error line."""
    err = p.stderr.decode("utf-8", "replace")
    marker = ": error: "
    if marker not in err:
        raise Failure(f"no error line: {err}")
    return err[err.index(marker) + len(marker):].strip()


class Cases:
    """Collects named cases so that one failing case does not hide the others."""

    def __init__(self):
        self.failed = []
        self.passed = 0
        self.tmp = tempfile.mkdtemp(prefix="lathe_hostile_")

    @contextlib.contextmanager
    def case(self, name):
        t0 = time.time()
        try:
            yield
            self.passed += 1
            print(f"ok   {name} ({time.time() - t0:.1f} s)", flush=True)
        except Exception as ex:  # noqa: BLE001 - report every failure with its traceback
            self.failed.append(name)
            print(f"FAIL {name}: {ex}", flush=True)
            traceback.print_exc()

    def path(self, *parts):
        p = os.path.join(self.tmp, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def write(self, rel, data):
        p = self.path(rel)
        with open(p, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        return p

    def finish(self):
        print(f"{self.passed} passed, {len(self.failed)} failed" + (f": {self.failed}" if self.failed else ""))
        sys.exit(1 if self.failed else 0)
