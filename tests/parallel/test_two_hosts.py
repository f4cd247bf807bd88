"""DP=2 across two "hosts": two network namespaces joined by a veth pair, Open MPI over TCP with an
rsh agent of `ip netns exec` (no sshd). The oracle is the same job on one host: the reduction
order is lathe's own, so losses and final weights must be bit-identical. Exits 77 (CTest: skipped,
not passed) with the reason where namespaces cannot be created (not root, no iproute2)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import megatron_writer  # noqa: E402

LATHE = os.environ.get("LATHE_BIN", os.path.join(HERE, "..", "..", "build", "lathe"))
TAG = f"l{os.getpid() % 100000}"
NS = (f"{TAG}a", f"{TAG}b")
IPS = ("10.77.0.1", "10.77.0.2")


def sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def setup(tmp):
    steps = [("ip", "netns", "add", NS[0]), ("ip", "netns", "add", NS[1]),
             ("ip", "link", "add", f"{TAG}va", "type", "veth", "peer", "name", f"{TAG}vb"),
             ("ip", "link", "set", f"{TAG}va", "netns", NS[0]), ("ip", "link", "set", f"{TAG}vb", "netns", NS[1]),
             ("ip", "-n", NS[0], "addr", "add", f"{IPS[0]}/24", "dev", f"{TAG}va"),
             ("ip", "-n", NS[1], "addr", "add", f"{IPS[1]}/24", "dev", f"{TAG}vb"),
             ("ip", "-n", NS[0], "link", "set", "lo", "up"), ("ip", "-n", NS[1], "link", "set", "lo", "up"),
             ("ip", "-n", NS[0], "link", "set", f"{TAG}va", "up"), ("ip", "-n", NS[1], "link", "set", f"{TAG}vb", "up")]
    for s in steps:
        p = sh(*s)
        if p.returncode != 0:
            return f"{' '.join(s)}: {p.stderr.strip()}"
    agent = os.path.join(tmp, "agent.sh")
    with open(agent, "w") as f:
        f.write("#!/bin/sh\n# Open MPI rsh agent: run the command in the namespace of the host\n"
                f'host=$1; shift\ncase "$host" in {IPS[0]}) ns={NS[0]} ;; {IPS[1]}) ns={NS[1]} ;; '
                '*) echo "unknown host $host" >&2; exit 1 ;; esac\nexec ip netns exec "$ns" sh -c "$*"\n')
    os.chmod(agent, 0o755)
    with open(os.path.join(tmp, "hosts"), "w") as f:
        f.write(f"{IPS[0]} slots=1\n{IPS[1]} slots=1\n")
    return None


def teardown():
    for n in NS:
        sh("ip", "netns", "del", n)


def main():
    if not shutil.which("mpirun") or not shutil.which("ip"):
        print("SKIPPED: mpirun or ip (iproute2) missing")
        return 77
    tmp = tempfile.mkdtemp(prefix="lathe_2hosts_")
    try:
        err = setup(tmp)
        if err:
            print(f"SKIPPED: cannot create network namespaces here ({err})")
            return 77
        rng = np.random.default_rng(3)
        megatron_writer.write(os.path.join(tmp, "d"), [(np.arange(3000) * 5 + rng.integers(0, 3, 3000)) % 96])
        env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
        outs = {}
        for where in ("one_host", "two_hosts"):
            out = os.path.join(tmp, where)
            rec = {"model": {"preset": "gpt2-debug"}, "data": {"train": os.path.join(tmp, "d"), "valid_fraction": 0.1},
                   "optimizer": {"lr": 3e-3}, "parallel": {"zero": 1},
                   "training": {"micro_batch_size": 2, "seq_len": 32, "grad_accum_steps": 2, "steps": 6,
                                "eval_interval": 0, "threads": 1, "peak_gflops": 100},
                   "output": {"dir": out}}
            json.dump(rec, open(out + ".yaml", "w"))
            cmd = ["mpirun", "-np", "2"]
            if where == "two_hosts":
                cmd = ["ip", "netns", "exec", NS[0]] + cmd + [
                    "--hostfile", os.path.join(tmp, "hosts"), "--mca", "plm_rsh_agent", os.path.join(tmp, "agent.sh"),
                    "--mca", "oob_tcp_if_include", "10.77.0.0/24", "--mca", "btl_tcp_if_include", "10.77.0.0/24",
                    "--mca", "btl", "tcp,self", "-x", "OMP_NUM_THREADS"]
            p = subprocess.run(cmd + [LATHE, "train", out + ".yaml", "--quiet"], capture_output=True, text=True,
                               env=env, timeout=300)
            if p.returncode != 0:
                print(f"FAIL {where}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
                return 1
            outs[where] = out
        loss = {k: [json.loads(l)["loss"] for l in open(os.path.join(v, "metrics.jsonl")) if '"loss"' in l]
                for k, v in outs.items()}
        same_w = open(os.path.join(outs["one_host"], "model", "model.safetensors"), "rb").read() == \
            open(os.path.join(outs["two_hosts"], "model", "model.safetensors"), "rb").read()
        ok = loss["one_host"] == loss["two_hosts"] and len(loss["one_host"]) == 6 and same_w
        print(("ok   " if ok else "FAIL ") + f"DP=2 over TCP between two namespaces: losses {loss['two_hosts']} "
              f"bit-identical to one host, final weights identical: {same_w}")
        return 0 if ok else 1
    finally:
        teardown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
