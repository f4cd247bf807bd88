"""lathe.Model, lathe.plan and lathe.check."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence, Union

import numpy as np

from . import _lathe


class Model:
    """A trained model for inference: the engine's own forward pass, as the ``lathe`` binary runs it.

    Load one with :meth:`Model.from_pretrained` from a Hugging Face model directory (config.json +
    model.safetensors, e.g. RUN/model), a run directory (its newest complete checkpoint, else
    RUN/model) or a checkpoint directory, as ``lathe export`` finds its source.
    """

    def __init__(self, native: Any) -> None:
        self._native = native
        self.config: Dict[str, Any] = json.loads(native.config_json())  #: the Hugging Face config

    @classmethod
    def from_pretrained(cls, path: Union[str, "os.PathLike[str]"], dtype: str = "fp32") -> "Model":
        """Loads the model at ``path`` to compute in ``dtype``: "fp32" (as ``lathe logits``, ``eval`` and
        ``generate``), "bf16" or "fp16" (as a run with ``precision.compute`` bf16 / fp16 computes:
        the fp32 weights rounded once to 16 bits, activations stored in 16 bits, fp32 accumulation;
        the logits are float32 either way, within the 16-bit rounding of the fp32 ones)."""
        return cls(_lathe.Model.from_pretrained(os.fspath(path), str(dtype)))

    @property
    def dtype(self) -> str:
        """The compute dtype: "fp32", "bf16" or "fp16"."""
        return self._native.dtype

    @staticmethod
    def _ids(ids: Any, what: str) -> np.ndarray:
        a = np.asarray(ids)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"Model.{what}: ids must be an integer array [B, T] (or [T]), got {a.dtype} {a.shape}")
        return np.ascontiguousarray(a, dtype=np.int32)

    def logits(self, ids: Any) -> np.ndarray:
        """float32 logits [B, T, V] of every position of ``ids`` [B, T], as ``lathe logits``."""
        return self._native.logits(self._ids(ids, "logits"))

    def loss(self, ids: Any) -> float:
        """Mean next-token cross-entropy over ``ids`` [B, T]: position t predicts token t + 1."""
        return self._native.loss(self._ids(ids, "loss"))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> List[int]:
        """The new token ids sampled after ``prompt_ids``, as ``lathe generate`` samples them (KV cache;
        temperature 0 = greedy; top_k 0 and top_p 1 = off)."""
        return self._native.generate([int(i) for i in prompt_ids], int(max_new_tokens), float(temperature),
                                     int(top_k), float(top_p), int(seed))

    def __repr__(self) -> str:
        return f"lathe.Model({self._native.source!r})"


_PLAN_ASSUMPTIONS = ("global_batch", "gpus_per_node", "memory_gb", "peak_gflops", "link_gbps", "intra_gbps",
                     "virtual_stages")


def plan(recipe_or_path: Any, world: int, **assumptions: Any) -> List[Dict[str, Any]]:
    """Every data x tensor x pipeline layout of the recipe's job on ``world`` ranks, as
    ``lathe plan --json`` lists them (``layouts``): memory per rank, predicted step time, tokens/s,
    MFU, and ``reject`` (why a layout is invalid; "" for valid ones).

    ``assumptions`` are ``lathe plan``'s options: global_batch, gpus_per_node, memory_gb,
    peak_gflops, link_gbps, intra_gbps, virtual_stages (a list). Unset figures are the recipe's or
    measured here, as by the binary.
    """
    from . import _as_recipe

    recipe = _as_recipe(recipe_or_path, None)
    a = _lathe.PlanAssumptions()
    a.world = int(world)
    for key, value in assumptions.items():
        if key not in _PLAN_ASSUMPTIONS:
            raise TypeError(f"plan: unknown assumption {key!r}; known: {', '.join(_PLAN_ASSUMPTIONS)}")
        if key == "virtual_stages":
            value = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
        elif key in ("global_batch", "gpus_per_node"):
            value = int(value)
        else:
            value = float(value)
        setattr(a, key, value)
    return json.loads(_lathe.plan(recipe._native, recipe.path, a))["layouts"]


def check(recipe: Any, world: int = 1, *, resume: Union[str, None] = None, overwrite: bool = False) -> List[str]:
    """Runs every check ``lathe train`` makes before its first step (recipe, data, tokenizer,
    model memory, output directory, resume checkpoint, ...) for a job of ``world`` processes,
    without training, as ``lathe check``. Returns the lines ``lathe check`` prints; raises
    :class:`lathe.Error` with ``lathe train``'s message at the first failure."""
    from . import _as_recipe

    r = _as_recipe(recipe, None)
    return list(_lathe.check(r._native, r.path, int(world), resume or "", bool(overwrite)))
