"""The Trainer's pickled files of a ``checkpoint-N`` folder, loaded as its resume loads them.

A ``checkpoint-N`` folder whose hashes match is loadable only if the Trainer's resume can
read what is in it: a swapped ``optimizer.pt`` whose hash was recorded anew would fail the
resume the same way at every restart. :func:`problem` loads each file the Trainer loads with
``torch.load`` as it does, safely: ``weights_only=True`` (tensors and plain values only: no
code in the file runs) and ``mmap=True`` (the tensors' bytes stay in the file, whatever its
size), and checks the shape of what it got. ``training_args.bin`` is a full pickle of the
Trainer's arguments that the resume never loads: it is hashed only, never unpickled.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from nbresume.checkpoint.format import check_mt19937_position, check_rng
from nbresume.errors import CorruptCheckpointError


def _optimizer(value: Any) -> None:
    if not isinstance(value, Mapping) or not isinstance(value.get("state"), Mapping):
        raise ValueError("not an optimizer's state_dict (no 'state' mapping)")
    groups = value.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        raise ValueError("not an optimizer's state_dict (no 'param_groups' list of groups)")


def _mapping(value: Any) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"a {type(value).__name__}, not a state_dict")


def _weights(value: Any) -> None:
    import torch

    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    ):
        raise ValueError("not a state_dict of tensors")


def _rng(value: Any) -> None:
    """The Trainer's ``rng_state.pth``: Python's, NumPy's and torch's CPU states, which its
    resume sets unconditionally, and CUDA's (one state, or one per device) when present."""
    if not isinstance(value, Mapping) or not {"python", "numpy", "cpu"} <= value.keys():
        raise ValueError("not the Trainer's RNG states (python, numpy and cpu)")
    numpy_state = value["numpy"]
    if isinstance(numpy_state, tuple) and len(numpy_state) > 2:
        check_mt19937_position(numpy_state[2])
    state = {"python": value["python"], "numpy": numpy_state, "torch": value["cpu"]}
    cuda = value.get("cuda")
    if cuda is not None:
        state["cuda"] = list(cuda) if isinstance(cuda, (list, tuple)) else [cuda]
    check_rng(state, where="")


#: The files the Trainer's resume loads with ``torch.load(weights_only=True)``, and the check
#: of what each must hold.
CHECKS: tuple[tuple[re.Pattern[str], Callable[[Any], None]], ...] = (
    (re.compile(r"optimizer\.pt"), _optimizer),
    (re.compile(r"(scheduler|scaler)\.pt"), _mapping),
    (re.compile(r"rng_state(_[0-9]+)?\.pth"), _rng),
    (re.compile(r"pytorch_model(-[0-9]+-of-[0-9]+)?\.bin"), _weights),
)


def _numpy_globals() -> AbstractContextManager[Any]:
    """What the Trainer allows ``torch.load`` to rebuild in ``rng_state.pth`` beyond tensors
    (its ``safe_globals``): NumPy's arrays and dtypes, for NumPy's generator state."""
    import numpy as np
    import torch

    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    return torch.serialization.safe_globals(allowed)


def problem(path: Path) -> str:
    """Why the Trainer's resume could not load the file ``path`` (``""``: it loads, or the
    Trainer does not load a file of its name). Needs torch; without it nothing is loaded (the
    Trainer cannot run there either)."""
    check = next((c for pattern, c in CHECKS if pattern.fullmatch(path.name)), None)
    if check is None:
        return ""
    try:
        import torch
    except ImportError:
        return ""
    allowed = _numpy_globals() if check is _rng else nullcontext()
    try:
        with allowed:
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        return (
            f"{path.name}: the Trainer's resume cannot load it (torch.load with "
            f"weights_only=True refuses it: {_reason(exc)})"
        )
    try:
        check(value)
    except CorruptCheckpointError as exc:  # an RNG state, named by check_rng
        return f"{path.name}: {exc.message}"
    except Exception as exc:
        return f"{path.name}: the Trainer's resume cannot use it ({_reason(exc)})"
    return ""


def _reason(exc: Exception) -> str:
    """The line of ``exc`` that says what is wrong (torch's refusal of a global, where it
    names one), without terminal escapes, at most 300 characters."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line] or [type(exc).__name__]
    named = [line for line in lines if "Unsupported" in line or "WeightsUnpickler" in line]
    return (named or lines)[0][:300]
