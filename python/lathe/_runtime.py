"""OpenMP / OpenBLAS settings for an in-process engine.

The ``lathe`` binary decides two settings that OpenBLAS and libgomp read only when they load
(src/core/blas_env.h): ``OPENBLAS_CORETYPE`` on AVX-512 CPUs that Debian's OpenBLAS misdetects, and
how idle OpenMP workers wait (``GOMP_SPINCOUNT`` bounded spinning, or ``OMP_WAIT_POLICY=PASSIVE``
when the CPUs are oversubscribed). It sets them and re-executes itself. A Python process cannot
re-execute itself, so ``import lathe`` asks the same C++ function in a short child process (the
extension, with ``LATHE_RUNTIME_PROBE=1`` so that it does not ask in turn) and puts the
answer into ``os.environ`` *before* the extension is loaded here. Values the user set are kept,
as by the binary. If OpenBLAS or libgomp were already loaded by another module (numpy's own BLAS is
a separate library; torch's libgomp is the same one), those settings apply only to what loads
later: import lathe first, or set the variables yourself. ``LATHE_RUNTIME_SET=1`` skips all this.
"""

import json
import os
import subprocess
import sys

_PROBE = "import json, lathe._lathe as m; e, n = m._runtime_settings(); print(json.dumps([e, n]))"

#: The note line printed here ("" for none): the engine copies it into each run's train.log, as the
#: binary does with the note it printed before re-executing itself.
note = ""


def apply_runtime_settings() -> None:
    """Put the binary's OpenBLAS/OpenMP settings into os.environ (before the extension loads)."""
    global note
    if os.environ.get("LATHE_RUNTIME_SET") or os.environ.get("LATHE_RUNTIME_PROBE"):
        return  # already applied, or this is the probe itself
    probe_env = dict(os.environ, LATHE_RUNTIME_PROBE="1")
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=probe_env, capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:  # not fatal: the engine runs with the defaults
        note = f"lathe: note: could not determine the OpenBLAS/OpenMP settings ({e}); running as is\n"
        sys.stderr.write(note)
        os.environ["LATHE_RUNTIME_SET"] = "1"
        return
    settings, note = json.loads(out.strip().splitlines()[-1])
    if note:
        sys.stderr.write(note)
    for name, value in settings:
        os.environ[name] = value
    os.environ["LATHE_RUNTIME_SET"] = "1"
