"""What the hostile checkpoint tests share (test_hostile_checkpoint.py, test_hostile_reshard.py):
one tiny checkpoint trained once (gpt2-debug, 2 steps, kill_test_lib.HOSTILE_RECIPE), and
resealing state.json: a new body with body_xxh64 recomputed by an independent Python XXH64 of the
compact, key-sorted body text (as lathe writes it), so that an edit passes the checksum and tests
the validation behind it. Not a test itself (tests/CMakeLists.txt registers only test_*.py)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.environ.get("LATHE_SOURCE_DIR", os.path.join(HERE, "..", "..")), "tests"))
sys.path.insert(0, HERE)
from hostile import run_lathe  # noqa: E402
from kill_test_lib import HOSTILE_RECIPE, make_data, xxh64  # noqa: E402


def train_base(tmp):
    """Trains TMP/recipe.yaml into TMP/base, stopped after 2 steps. Returns (recipe path, run
    directory, its step-2 checkpoint directory)."""
    data = make_data(tmp, "shake", 20000)
    recipe = os.path.join(tmp, "recipe.yaml")
    base_run = os.path.join(tmp, "base")
    open(recipe, "w").write(HOSTILE_RECIPE.format(data=data, out=base_run))
    run_lathe(["train", recipe, "--quiet", "--stop-after", "2"], rc=0, timeout=120)
    return recipe, base_run, os.path.join(base_run, "checkpoints", "step_00000002")


def canonical(body):
    """lathe's body text: compact, keys sorted, UTF-8 as is, NaN/Infinity as JSON5 words."""
    return json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=True)


def reseal_text(ckpt, body_text):
    """Writes CKPT/state.json with this body text and its valid body_xxh64."""
    digest = format(xxh64(body_text.encode("utf-8")), "016x")
    open(os.path.join(ckpt, "state.json"), "w", encoding="utf-8").write(
        '{"body":' + body_text + ',"body_xxh64":"' + digest + '"}\n')
