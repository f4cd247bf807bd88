"""lathe: the Python API of the lathe LLM pretraining engine.

The same C++ engine as the ``lathe`` binary, in this process: recipes are validated as by
``lathe train``, training writes the same run directory, and errors raise :class:`Error` with the
message the binary prints.

>>> import lathe
>>> result = lathe.train("configs/quickstart.yaml", overrides={"training.steps": 20})
>>> result.losses[-1], result.output_dir

Before the extension loads, ``import lathe`` applies the OpenBLAS/OpenMP settings the binary would
re-execute itself with (see ``lathe._runtime``); import lathe before modules that load libgomp.
"""

from __future__ import annotations

import json as _json
import os as _os
import threading as _threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from . import _runtime

_runtime.apply_runtime_settings()

from . import _lathe  # noqa: E402  (after the settings: the extension loads OpenBLAS and libgomp)

_lathe._set_runtime_note(_runtime.note)  # into each run's train.log, as the binary's note

__version__: str = _lathe.__version__
Error = _lathe.Error
Error.__module__ = "lathe"

__all__ = ["__version__", "Error", "Recipe", "RunResult", "train", "Tokenizer", "IndexedDataset", "Model", "plan",
           "check"]

PathLike = Union[str, "_os.PathLike[str]"]


def _override_list(overrides: Optional[Mapping[str, Any]]) -> List[str]:
    """{"training.steps": 20} -> ["training.steps=20"], the form of ``lathe train --set``."""
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a dict of 'key.path': value, got {type(overrides).__name__}")
    out = []
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise TypeError(f"overrides: key {key!r} must be a string such as 'training.steps'")
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif value is None:
            text = "null"
        elif isinstance(value, (int, float, str)):
            text = str(value) if not isinstance(value, float) else repr(value)
        else:
            text = _json.dumps(value)  # lists and mappings: JSON is YAML flow syntax
        out.append(f"{key}={text}")
    return out


class Recipe:
    """A training recipe, validated exactly as ``lathe train`` validates it.

    Create one with :meth:`Recipe.load`; pass it to :func:`train`, :func:`plan` or :func:`check`.
    """

    def __init__(self, native: Any, path: str, overrides: List[str]) -> None:
        self._native = native
        self.path = path
        self._overrides = overrides

    @classmethod
    def load(cls, path: PathLike, overrides: Optional[Mapping[str, Any]] = None) -> "Recipe":
        """Loads and validates the YAML recipe at ``path``.

        ``overrides`` maps dotted keys to values, as ``lathe train --set key=value`` does
        (``{"training.steps": 20, "output.dir": "runs/x"}``). Raises :class:`Error` with the
        message ``lathe train`` prints for an invalid recipe.
        """
        sets = _override_list(overrides)
        return cls(_lathe.load_recipe(_os.fspath(path), sets), _os.fspath(path), sets)

    def to_dict(self) -> Dict[str, Any]:
        """The fully resolved recipe as a dict (the model section as Hugging Face config fields)."""
        return _json.loads(self._native.to_json())

    def to_yaml(self) -> str:
        """The resolved recipe as YAML, loadable again by :meth:`Recipe.load` and ``lathe train``."""
        return self._native.to_yaml()

    @property
    def output_dir(self) -> str:
        """``output.dir``: where training writes the run."""
        return self._native.output_dir

    def __repr__(self) -> str:
        return f"lathe.Recipe({self.path!r}, output_dir={self.output_dir!r})"


def _as_recipe(recipe_or_path: Union[Recipe, PathLike], overrides: Optional[Mapping[str, Any]]) -> Recipe:
    if isinstance(recipe_or_path, Recipe):
        if overrides:
            return Recipe.load(recipe_or_path.path, {**dict(_split(recipe_or_path._overrides)), **overrides})
        return recipe_or_path
    return Recipe.load(recipe_or_path, overrides)


def _split(sets: List[str]):
    for s in sets:
        k, _, v = s.partition("=")
        yield k, v


@dataclass
class RunResult:
    """What :func:`train` returns."""

    output_dir: str  #: the run directory (output.dir)
    steps: int  #: optimizer steps done when training returned
    losses: List[float] = field(default_factory=list)  #: training loss per optimizer step of this call
    final_val_loss: Optional[float] = None  #: the last validation loss (None without validation data)
    start_step: int = 0  #: steps already done when this call started (a resume)
    model_dir: str = ""  #: the Hugging Face model directory written at the end ("" when stopped early)
    last_checkpoint: str = ""  #: the newest checkpoint this call wrote
    resumed_from: str = ""  #: the checkpoint this call resumed from ("" for a fresh start)


_train_lock = _threading.Lock()


def train(recipe_or_path: Union[Recipe, PathLike], overrides: Optional[Mapping[str, Any]] = None,
          on_step: Optional[Callable[[Dict[str, Any]], None]] = None, resume: Optional[str] = None, *,
          overwrite: bool = False, quiet: bool = False, stop_after: int = 0) -> RunResult:
    """Trains a recipe in this process, as ``lathe train RECIPE`` does (same run directory, losses
    bit for bit).

    ``on_step(metrics)`` receives every record written to OUTPUT/metrics.jsonl (each step's, and
    validation, checkpoint and end-of-run records) as a dict; it runs with the GIL held while the
    engine waits. ``resume`` is ``"auto"`` (the newest checkpoint of output.dir) or a checkpoint
    directory; ``overwrite=True`` moves an old run in output.dir aside (``--overwrite``),
    ``stop_after=N`` saves a checkpoint after N steps and returns (``--stop-after``).

    The GIL is released while training. Ctrl-C (SIGINT) or a KeyboardInterrupt raised by ``on_step``
    saves a checkpoint at the next step boundary, then KeyboardInterrupt is raised (a second Ctrl-C
    ends the process at once, as with the binary); SIGTERM does the same and raises SystemExit(75).
    Continue with ``resume="auto"``. Other exceptions of ``on_step`` end the run and propagate.
    """
    recipe = _as_recipe(recipe_or_path, overrides)
    callback = None
    if on_step is not None:
        def callback(record: str) -> None:
            on_step(_json.loads(record))
    # One run per process: the stop request (Ctrl-C), the signal handlers and the OpenMP state are
    # process-wide, so a second run (another thread, or on_step itself) is refused, not interleaved.
    if not _train_lock.acquire(blocking=False):
        raise Error("lathe.train: another lathe.train is running in this process (the stop request, signal "
                    "handlers and OpenMP state are process-wide); wait for it to return, or train in another process")
    try:
        r = _lathe.train(recipe._native, callback, resume or "", overwrite, quiet, int(stop_after))
    finally:
        _train_lock.release()
    return RunResult(output_dir=r["output_dir"], steps=r["steps"], losses=list(r["losses"]),
                     final_val_loss=r["final_val_loss"], start_step=r["start_step"], model_dir=r["model_dir"],
                     last_checkpoint=r["last_checkpoint"], resumed_from=r["resumed_from"])


class Tokenizer:
    """A tokenizer as ``lathe encode`` and ``lathe tokenize`` load it."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @classmethod
    def load(cls, path: PathLike) -> "Tokenizer":
        """``"byte"``, a directory (tokenizer.json, encoder.json + vocab.bpe, tokenizer.model) or a file."""
        return cls(_lathe.Tokenizer.load(_os.fspath(path)))

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no special tokens added), as ``lathe encode``."""
        return self._native.encode(text)

    def encode_batch(self, texts: Sequence[str], workers: Optional[int] = None) -> list:
        """Token ids of each text as int32 numpy arrays, encoded by ``workers`` threads (None: one
        per CPU) with the GIL released; the result is in input order and independent of ``workers``."""
        if workers is not None and workers < 1:
            raise ValueError(f"workers = {workers} must be >= 1 (or None: one per CPU)")
        return self._native.encode_batch(list(texts), 0 if workers is None else int(workers))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, as ``lathe decode``."""
        return self._native.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._native.vocab_size

    @property
    def eos_id(self) -> Optional[int]:
        """The end-of-text id, None when the tokenizer has none (``byte``)."""
        return self._native.eos_id

    def __repr__(self) -> str:
        return f"lathe.Tokenizer({self._native.kind!r}, vocab_size={self.vocab_size})"


class IndexedDataset(_lathe.IndexedDataset):
    """A Megatron PREFIX.bin/.idx token dataset (what ``lathe tokenize`` writes and training reads).

    ``ds[i]`` is sequence i as a read-only numpy view of the memory-mapped .bin in the shard's dtype
    (uint16 or int32, ...): no copy; the view keeps the dataset open. ``len(ds)`` is the number of
    sequences, ``ds.sizes`` their lengths (int32, a copy: the index array is not aligned).
    """

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"lathe.IndexedDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype})"


from ._model import Model, check, plan  # noqa: E402,F401
