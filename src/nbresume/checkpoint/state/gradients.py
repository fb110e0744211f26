"""Gradients accumulated between two optimizer steps, carried across a save.

With gradient accumulation, a step boundary can fall between two optimizer steps: the
gradients of the micro-batches since the last ``optimizer.step()`` are part of the training
state, and a resume without them trains on fewer samples for that update. A save therefore
keeps them when they are pending: an optimizer registered with the Checkpointer did not step
in the step the save ends (or is made in), and some of its parameters hold a gradient.
Gradients left over after an optimizer step (``zero_grad()`` comes first in the next step) are
not pending, so the usual loop saves nothing more. Steps are those of ``steps()`` and
``epochs()``: a ``save()`` from a loop of the user's own carries no gradients.

The gradients go into the checkpoint's ``gradients`` tensor group, keyed by optimizer name and
``"<group>.<index>"`` of the parameter in that optimizer's parameter groups; ``restore()`` puts
them back into ``.grad``.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from typing import Any

from nbresume.errors import CheckpointError


def is_optimizer(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.optim.Optimizer)


class StepWatch:
    """Which registered optimizers stepped in the running (or the last ended) step.

    Its hooks are on the user's optimizers only while the Checkpointer is in use: they go at
    :meth:`unhook` (``Checkpointer.close()``) or when the Checkpointer is garbage, and come
    back at the next step a loop begins."""

    def __init__(self) -> None:
        self._stepped: set[int] = set()
        self._optimizers: list[weakref.ref[Any]] = []
        self._hooks: list[Any] = []  # torch.utils.hooks.RemovableHandle
        #: Whether a loop of the Checkpointer has begun a step: steps are known only there
        #: (a save() in a loop of the user's own cannot tell pending gradients from stale).
        self.active = False
        weakref.finalize(self, _remove_all, self._hooks)

    def watch(self, optimizer: Any) -> None:
        """Follow ``optimizer``'s steps (its hook holds this watch weakly: a Checkpointer
        that is gone leaves a hook that does nothing)."""
        self._optimizers.append(weakref.ref(optimizer))
        self._hook(optimizer)

    def _hook(self, optimizer: Any) -> None:
        me = weakref.ref(self)

        def hook(opt: Any, args: Any, kwargs: Any) -> None:
            watch = me()
            if watch is not None:
                watch._stepped.add(id(opt))

        self._hooks.append(optimizer.register_step_post_hook(hook))

    def unhook(self) -> None:
        """Take the hooks off the optimizers (each optimizer is again as the user made it)."""
        _remove_all(self._hooks)

    def stepped(self, optimizer: Any) -> bool:
        return id(optimizer) in self._stepped

    def step_begins(self) -> None:
        """A step begins (its body, or its first batch): no optimizer stepped in it yet. A
        save at its boundary, or after the loop, still sees the step that ended."""
        if not self._hooks:  # after unhook(): a new loop of the same Checkpointer
            for ref in self._optimizers:
                optimizer = ref()
                if optimizer is not None:
                    self._hook(optimizer)
        self._stepped.clear()
        self.active = True


def _remove_all(hooks: list[Any]) -> None:
    while hooks:
        hooks.pop().remove()


def pending(objects: Mapping[str, Any], watch: StepWatch) -> dict[str, dict[str, Any]]:
    """The pending gradients of every registered optimizer that did not step since the last
    boundary: ``{optimizer name: {"<group>.<index>": grad}}`` (empty: none pending)."""
    found: dict[str, dict[str, Any]] = {}
    if not watch.active:
        return found
    for name, obj in objects.items():
        if not is_optimizer(obj) or watch.stepped(obj):
            continue
        grads = {
            f"{g}.{i}": p.grad.detach()
            for g, group in enumerate(obj.param_groups)
            for i, p in enumerate(group["params"])
            if p.grad is not None
        }
        if grads:
            found[name] = grads
    return found


def plan_put_back(
    objects: Mapping[str, Any], saved: Mapping[str, Any], *, where: str
) -> list[tuple[Any, Any]]:
    """Check the saved pending gradients against the live parameters (changing nothing);
    the ``(parameter, gradient)`` pairs for :func:`put_back`."""
    assignments = []
    for name, grads in saved.items():
        obj = objects.get(name)
        if obj is None:
            continue  # restored without its optimizer (to evaluate, say): nothing to train
        if not is_optimizer(obj) or not isinstance(grads, Mapping):
            raise CheckpointError(
                f"the checkpoint holds pending gradients for {name!r}, which is not an "
                "optimizer here",
                where=where,
                fix=f"register the optimizer as {name}= as in the run that saved it",
            )
        params = {
            f"{g}.{i}": p
            for g, group in enumerate(obj.param_groups)
            for i, p in enumerate(group["params"])
        }
        for key, grad in grads.items():
            param = params.get(key)
            if param is None or tuple(param.shape) != tuple(grad.shape):
                raise CheckpointError(
                    f"the pending gradient {name}/{key} does not fit the optimizer's parameters",
                    where=where,
                    fix="build the model and optimizer exactly as in the run that saved it",
                )
            assignments.append((param, grad))
    return assignments


def put_back(assignments: list[tuple[Any, Any]]) -> None:
    """Set the checked gradients into ``.grad``, on each parameter's device and dtype."""
    for param, grad in assignments:
        param.grad = grad.to(device=param.device, dtype=param.dtype).clone()
