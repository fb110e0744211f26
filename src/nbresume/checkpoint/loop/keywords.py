"""The keywords of ``Checkpointer(...)``, checked before anything is built.

The protocol: :func:`check_arguments` checks every option and every stateful keyword of the
constructor and raises :class:`~nbresume.errors.ArgumentError` for the first wrong one,
naming it, its value and the fix, so that a refused call changes nothing. A keyword that is
not an option must be a stateful object or a DataLoader: a plain value there is most often a
misspelled option (``evry=2``), and the option it resembles is named.
"""

from __future__ import annotations

import difflib
import inspect
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

from nbresume.checkpoint.arguments import (
    check_bool,
    check_callbacks,
    check_keep,
    check_keep_best,
    check_storage_options,
    kind,
    refused,
    show,
)
from nbresume.checkpoint.backends import Backend, check_location
from nbresume.checkpoint.loop.cadence import parse_every
from nbresume.checkpoint.loop.deadline import check_deadline
from nbresume.checkpoint.state import (
    GRADIENTS_GROUP,
    RNG_GROUP,
    STATE_FILE,
    VALUES_GROUP,
    is_generator,
    is_stateful,
)
from nbresume.errors import UsageError

#: Names the checkpoint uses for its own files and groups.
RESERVED = {STATE_FILE, RNG_GROUP, VALUES_GROUP, GRADIENTS_GROUP, "manifest"}


def check_arguments(
    dir: object,
    *,
    every: object,
    keep: object,
    keep_best: object,
    deadline: object,
    async_save: object,
    callbacks: object,
    storage_options: object,
    trainable_only: object,
    state: Mapping[str, Any],
    options: Collection[str],
    quiet: object = False,
) -> None:
    """Check every argument of ``Checkpointer(...)``; raise ArgumentError for the first wrong
    one, naming it, its value and the fix. ``options`` are the names of its options (a
    misspelled one among the state keywords is named: :func:`option_names`)."""
    call = "Checkpointer"
    if not isinstance(dir, Backend):
        check_location(dir, call, "dir")
    parse_every(every, call)
    check_keep(call, keep)
    check_keep_best(call, keep_best)
    check_deadline(deadline, call)
    check_bool(call, "async_save", async_save)
    check_bool(call, "trainable_only", trainable_only)
    check_bool(call, "quiet", quiet)
    check_callbacks(call, callbacks)
    check_storage_options(call, storage_options)
    for name, value in state.items():
        _check_state_keyword(name, value, options)


def check_name(name: object) -> None:
    """A name of checkpointed state: an identifier, and not one of the checkpoint's own."""
    if not isinstance(name, str) or name in RESERVED or not name.isidentifier():
        raise UsageError(
            f"{name!r} cannot name checkpointed state",
            fix=f"choose a Python identifier other than {sorted(RESERVED)}",
        )


def _check_state_keyword(name: str, value: Any, options: Collection[str]) -> None:
    """A keyword of ``Checkpointer(...)`` that is not an option must be a stateful object or
    a DataLoader. A plain value there is most often a misspelled option (``evry=2``), which
    would otherwise be saved as a value and change nothing: it is refused, and the option it
    resembles is named."""
    check_name(name)
    if is_dataloader(value) or is_generator(value):
        return
    if not isinstance(value, type) and is_stateful(value):
        return
    shown = show(value)
    close = difflib.get_close_matches(name, list(options), n=1)
    if close:
        raise refused(
            "Checkpointer",
            name,
            value,
            f"{name} is not an option of Checkpointer; did you mean {close[0]}=?",
            f"spell the option {close[0]}=; to save a plain value named {name!r} with the "
            f"checkpoints, set ckpt[{name!r}] = {shown} after creating the Checkpointer",
        )
    if isinstance(value, type) and is_stateful(value):
        raise refused(
            "Checkpointer",
            name,
            value,
            "this is a class, not an object of it",
            f"pass the object: {name}={value.__name__}(...)",
        )
    if value is None:
        raise refused(
            "Checkpointer",
            name,
            value,
            "None is not an object to save",
            f"leave {name}= out when there is no such object",
        )
    raise refused(
        "Checkpointer",
        name,
        value,
        f"{kind(value)} is not a stateful object; the keywords after the options name "
        "objects with state_dict() and load_state_dict() (a model, an optimizer, ...) and "
        "DataLoaders",
        "set a plain value after creating the Checkpointer: "
        f"ckpt[{name!r}] = {shown if not shown.startswith('<') else name}; an object of "
        "your own gets state_dict() and load_state_dict() methods",
    )


def option_names(init: Callable[..., Any]) -> list[str]:
    """The names of the options of a constructor ``init``: its parameters other than
    ``self`` and ``**state``."""
    parameters = inspect.signature(init).parameters.values()
    return [p.name for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD]


def is_dataloader(value: Any) -> bool:
    torch_data = sys.modules.get("torch.utils.data")
    return torch_data is not None and type(value) is torch_data.DataLoader
