#!/usr/bin/env python3
"""lathe archive RUN --out FILE.tar.zst [--with-model] [--with-checkpoint latest|STEP] and
lathe archive --verify FILE (issue 29 item 6).
  * two archives of one run are byte-identical (and a third, written after the run's files were
    touched (new mtimes), too)
  * round trip: the tar (decompressed with the zstd CLI, read with Python's tarfile) holds
    NAME/MANIFEST first, then the run's logs, report.html, tensorboard/, model/ and the chosen
    checkpoint, each member's bytes equal to the run's file, mode 0644, uid/gid 0, mtime 0; the
    MANIFEST's XXH64s equal an independent Python XXH64 (tests/train/kill_test_lib.py)
  * --verify: OK on a sound archive; a flipped byte inside a member's data (recompressed) -> exit 1
    naming that member; a flipped byte of the compressed stream -> exit 1 naming the archive
  * errors name the fix: --with-checkpoint of a missing step lists the steps; --with-model of a
    run without model/; a file that is not an archive
"""
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import numpy as np  # noqa: E402
from kill_test_lib import xxh64  # noqa: E402
from train_helpers import ENV, LATHE, check, finish, patterned_data, write_recipe  # noqa: E402

ZSTD = shutil.which("zstd")


def lathe(*args):
    return subprocess.run([LATHE, *args], capture_output=True, text=True, env=ENV, timeout=600)


def read(path):
    return open(path, "rb").read()


def untar(archive):
    raw = subprocess.run([ZSTD, "-dc", archive], capture_output=True, check=True).stdout
    return raw, tarfile.open(fileobj=io.BytesIO(raw), mode="r:")


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_archive_")
    data = patterned_data(tmp, np.random.default_rng(0))
    run = os.path.join(tmp, "myrun")
    recipe = write_recipe(run, data, {"micro_batch_size": 2, "seq_len": 16, "steps": 6, "eval_interval": 2,
                                      "peak_gflops": 100},
                          output={"dir": run, "checkpoint_every": 3, "tensorboard": True})
    check(lathe("train", recipe, "--quiet").returncode == 0, "the run trains")
    a1, a2, a3 = (os.path.join(tmp, f"a{i}.tar.zst") for i in (1, 2, 3))
    args = ["--with-model", "--with-checkpoint", "3"]
    p = lathe("archive", run, "--out", a1, *args)
    check(p.returncode == 0, "archive " + p.stderr[-300:])
    lathe("archive", run, "--out", a2, *args)
    for root, _, files in os.walk(run):
        for f in files:
            os.utime(os.path.join(root, f), (1, 1))
    lathe("archive", run, "--out", a3, *args)
    check(os.path.exists(a2) and read(a1) == read(a2) == read(a3), "three archives of the run are byte-identical")
    p = lathe("archive", "--verify", a1)
    check(p.returncode == 0 and "OK" in p.stdout, "--verify: OK " + p.stdout.strip() + p.stderr[-300:])

    if not ZSTD:
        print("note: no zstd command (scripts/setup.sh installs it): the round trip and the "
              "flipped-member checks are not run")
    else:
        raw, tar = untar(a1)
        names = tar.getnames()
        ck = "myrun/checkpoints/step_00000003/"
        logs = ["myrun/" + f for f in ["recipe.yaml", "run_info.json", "train.log", "metrics.jsonl", "report.html"]]
        check(names[0] == "myrun/MANIFEST" and names[1:6] == logs, f"MANIFEST, then the logs: {names[:6]}")
        check(any(n.startswith("myrun/tensorboard/events.out.tfevents.") for n in names), "the event file")
        check(sorted(n for n in names if n.startswith("myrun/model/")) ==
              sorted("myrun/model/" + f for f in os.listdir(os.path.join(run, "model"))), "model/")
        check(sorted(n for n in names if n.startswith(ck)) ==
              sorted(ck + f for f in os.listdir(os.path.join(run, "checkpoints", "step_00000003"))),
              "the step-3 checkpoint")
        check(not any("step_00000006" in n for n in names), "only the chosen checkpoint")
        report = os.path.join(tmp, "report.html")  # the run has none: the archive holds lathe report's page
        lathe("report", run, "--out", report)
        src = {m.name: report if m.name == "myrun/report.html" else os.path.join(tmp, m.name) for m in tar.getmembers()}
        same = all(tar.extractfile(m).read() == read(src[m.name]) for m in tar.getmembers()[1:])
        check(same, "every member's bytes are the run's file (report.html: `lathe report`'s page)")
        check(all(m.mode == 0o644 and m.uid == 0 and m.gid == 0 and m.mtime == 0 and m.isreg() and not m.uname
                  for m in tar.getmembers()), "mode 0644, uid/gid 0, mtime 0, regular files, no owner names")
        man = tar.extractfile("myrun/MANIFEST").read().decode().splitlines()
        rows = [l.split("  ") for l in man if not l.startswith("#")]
        ok = all(format(xxh64(tar.extractfile(p).read()), "016x") == h and int(s) == tar.getmember(p).size
                 for h, s, p in rows)
        check(ok and [r[2] for r in rows] == names[1:], "the MANIFEST: independent XXH64 and size of every member")

        # A flipped byte inside metrics.jsonl's data, recompressed: --verify names the member.
        off = raw.find(read(os.path.join(run, "metrics.jsonl"))[:64])
        bad = bytearray(raw)
        bad[off + 10] ^= 0x01
        damaged = os.path.join(tmp, "damaged.tar.zst")
        subprocess.run([ZSTD, "-q", "-f", "-o", damaged], input=bytes(bad), check=True)
        p = lathe("archive", "--verify", damaged)
        check(p.returncode == 1 and "myrun/metrics.jsonl: XXH64" in p.stderr and "1 of" in p.stderr,
              "a changed member is named: " + p.stderr.strip()[:300])

    blob = bytearray(read(a1))
    blob[len(blob) // 2] ^= 0xFF
    flipped = os.path.join(tmp, "flipped.tar.zst")
    open(flipped, "wb").write(blob)
    p = lathe("archive", "--verify", flipped)
    check(p.returncode == 1 and flipped in p.stderr and ("damaged" in p.stderr), "a flipped byte of the archive fails "
          "verification: " + p.stderr.strip()[:300])

    cut = os.path.join(tmp, "cut.tar.zst")
    open(cut, "wb").write(read(a1)[:len(read(a1)) // 2])
    p = lathe("archive", "--verify", cut)
    check(p.returncode == 1 and cut in p.stderr and "truncated" in p.stderr, "a truncated archive: " + p.stderr[-200:])

    # A large archive (a 72 MB file in model/) shows progress: plain lines on stderr off a terminal.
    open(os.path.join(run, "model", "big.bin"), "wb").write(np.random.default_rng(1).bytes(72 << 20))
    big = os.path.join(tmp, "big.tar.zst")
    p = lathe("archive", run, "--out", big, "--with-model")
    lines = [l for l in p.stderr.splitlines() if l.startswith("archive " + big)]
    check(p.returncode == 0 and len(lines) >= 2 and "100.0%" in lines[-1]
          and re.search(r" (\d+)/\1 bytes", lines[-1]), f"progress lines, the last at the total: {lines[-1:]}")
    p = lathe("archive", run, "--out", big, "--with-model", "--no-progress")
    check(p.returncode == 0 and "100.0%" not in p.stderr, "--no-progress: none")
    check(lathe("archive", "--verify", big).returncode == 0, "the large archive verifies")
    os.remove(big)

    p = lathe("archive", run, "--out", os.path.join(tmp, "x.tar.zst"), "--with-checkpoint", "5")
    check(p.returncode == 1 and "has no complete checkpoint of step 5 (it has steps 3, 6)" in p.stderr,
          "a missing checkpoint step lists the steps: " + p.stderr.strip()[:200])
    shutil.rmtree(os.path.join(run, "model"))
    p = lathe("archive", run, "--out", os.path.join(tmp, "x.tar.zst"), "--with-model")
    check(p.returncode == 1 and "model: no model directory" in p.stderr and "--with-checkpoint latest" in p.stderr,
          "--with-model without model/ says what to do: " + p.stderr.strip()[:200])
    p = lathe("archive", "--verify", os.path.join(run, "metrics.jsonl"))
    check(p.returncode == 1 and "metrics.jsonl: zstd decompression failed" in p.stderr, "not an archive: named")
    return finish(tmp)


if __name__ == "__main__":
    sys.exit(main())
