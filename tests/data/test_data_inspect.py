"""lathe data inspect (issue 11) against numpy on a dataset written by the independent numpy writer
(tests/train/megatron_writer.py): sizes, length statistics and histogram, vocabulary use, the most
frequent ids, EOD counts and the decoded sample must equal what numpy computes from the same
documents. A missing prefix is named."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN") or os.path.join(os.environ.get("LATHE_BINARY_DIR", os.path.join(HERE, "..", "..", "build")), "lathe")
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def main():
    tmp = tempfile.mkdtemp(prefix="lathe_inspect_")
    rng = np.random.default_rng(11)
    eod = 255
    docs = []
    for d in range(300):
        n = int(rng.integers(1, 700)) if d % 50 else 1  # some documents of length 1
        doc = rng.integers(32, 127, n)
        if d % 3:  # two thirds end with EOD
            doc[-1] = eod
        docs.append(doc)
    prefix = os.path.join(tmp, "ds")
    megatron_writer.write(prefix, docs)
    p = subprocess.run([LATHE, "data", "inspect", prefix, "--tokenizer", "byte", "--eod", str(eod), "--json"],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode == 0, "lathe data inspect --json runs")
    j = json.loads(p.stdout)
    lens = np.array([len(d) for d in docs])
    allt = np.concatenate(docs)
    check(j["sequences"] == len(docs) and j["documents"] == len(docs) and j["tokens"] == int(lens.sum()),
          f"sizes: {j['sequences']} sequences, {j['tokens']} tokens")
    s = np.sort(lens)
    want = {"min": int(s[0]), "max": int(s[-1]), "median": int(s[len(s) // 2]), "p90": int(s[int(0.9 * len(s))]),
            "p99": int(s[int(0.99 * len(s))])}
    check(all(j["length"][k] == v for k, v in want.items()) and abs(j["length"]["mean"] - lens.mean()) < 1e-9,
          f"length statistics {j['length']}")
    hist = {}
    for l in lens:
        b = int(np.floor(np.log2(l)))
        hist[b] = hist.get(b, 0) + 1
    got_hist = {int(np.log2(h["from"])): h["sequences"] for h in j["length_histogram"]}
    check(got_hist == hist, f"log2 length histogram {got_hist}")
    ids, counts = np.unique(allt, return_counts=True)
    check(j["vocabulary"]["max_id"] == int(allt.max()) and j["vocabulary"]["distinct_ids"] == len(ids),
          f"vocabulary: max id {j['vocabulary']['max_id']}, {j['vocabulary']['distinct_ids']} distinct")
    order = sorted(zip(-counts, ids))[:10]
    check([(t["id"], t["count"]) for t in j["top_ids"]] == [(int(i), int(-c)) for c, i in order],
          "the 10 most frequent ids and their counts")
    check(all(t["text"] == bytes([t["id"]]).decode("latin-1") or t["id"] >= 128 for t in j["top_ids"]),
          "top ids decoded with the tokenizer")
    ends = sum(1 for d in docs if d[-1] == eod)
    check(j["eod"]["count"] == int((allt == eod).sum()) and j["eod"]["sequences_ending_with_it"] == ends,
          f"EOD: {j['eod']}")
    check(j["samples"][0]["first_ids"] == [int(x) for x in docs[0][:64]], "the first sequence's first ids")
    p = subprocess.run([LATHE, "data", "inspect", prefix, "--tokenizer", "byte"], capture_output=True, text=True)
    check(p.returncode == 0 and "distinct ids" in p.stdout and "sequence length" in p.stdout, "the plain output")
    p = subprocess.run([LATHE, "data", "inspect", os.path.join(tmp, "nope")], capture_output=True, text=True)
    check(p.returncode == 1 and "nope" in p.stderr, "a missing prefix is named")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
