"""What an optimizer's ``state_dict()`` leaves out: pending gradients and added groups.

**Gradients pending between two optimizer steps**, carried across a save. With gradient
accumulation, a step boundary can fall between two optimizer steps: the gradients of the
micro-batches since the last ``optimizer.step()`` are part of the training state, and a resume
without them trains on fewer samples for that update. A save therefore keeps them when they
are pending: an optimizer registered with the Checkpointer did not step in the step the save
ends (or is made in), and some of its parameters hold a gradient. Gradients left over after an
optimizer step (``zero_grad()`` comes first in the next step) are not pending, so the usual
loop saves nothing more. Steps are those of ``steps()`` and ``epochs()``: a ``save()`` from a
loop of the user's own carries no gradients. The gradients go into the checkpoint's
``gradients`` tensor group, keyed by optimizer name and ``"<group>.<index>"`` of the parameter
in that optimizer's parameter groups; ``restore()`` puts them back into ``.grad``.

**Parameter groups added during training** (progressive unfreezing). A run that calls
``optimizer.add_param_group(...)`` part-way (unfreezing the backbone at epoch 3, say) saves an
optimizer with more groups than the one its script builds. The code that added them does not
run again after a resume past that point, so the restore adds them back itself: each
checkpoint records, for every group added since the optimizer was registered, the names of its
parameters in the registered modules (``"model.backbone.0.weight"``). A restore into an
optimizer that has exactly the groups it was registered with adds those groups (parameters
found by name, hyperparameters from the checkpoint) before the state is checked and loaded; if
the checkpoint does not fit after all, they are removed again.
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


def pending_gradients(objects: Mapping[str, Any], watch: StepWatch) -> dict[str, dict[str, Any]]:
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


def plan_gradients_back(
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


def put_gradients_back(assignments: list[tuple[Any, Any]]) -> None:
    """Set the checked gradients into ``.grad``, on each parameter's device and dtype."""
    for param, grad in assignments:
        param.grad = grad.to(device=param.device, dtype=param.dtype).clone()


# -- parameter groups added during training ----------------------------------------------

# The state member added_groups: {optimizer: {"from": groups at registration, "names": [[...]]}}.


def _named_parameters(objects: Mapping[str, Any]) -> dict[str, Any]:
    """``"<object>.<parameter name>" -> parameter`` over the registered modules."""
    params: dict[str, Any] = {}
    for name, obj in objects.items():
        module = getattr(obj, "module", obj)  # TrainableOnly wraps its module
        named = getattr(module, "named_parameters", None)
        if callable(named):
            for param_name, param in named():
                params.setdefault(f"{name}.{param_name}", param)
    return params


def added_groups(objects: Mapping[str, Any], initial: Mapping[int, int]) -> dict[str, Any]:
    """The groups each registered optimizer gained since registration, by parameter name
    (empty: none gained any, or a parameter has no name in a registered module)."""
    found: dict[str, Any] = {}
    names: dict[int, str] | None = None
    for name, obj in objects.items():
        start = initial.get(id(obj))
        if not is_optimizer(obj) or start is None or len(obj.param_groups) <= start:
            continue
        if names is None:
            names = {id(p): n for n, p in reversed(_named_parameters(objects).items())}
        added_groups = obj.param_groups[start:]
        groups = [[names.get(id(p)) for p in g["params"]] for g in added_groups]
        if all(n is not None for group in groups for n in group):
            trainable = [[bool(p.requires_grad) for p in g["params"]] for g in added_groups]
            found[name] = {"from": start, "names": groups, "requires_grad": trainable}
    return found


class Grown:
    """An optimizer given back its added groups, and how to undo it."""

    def __init__(self, optimizer: Any, before: int, flags: list[tuple[Any, bool]]) -> None:
        self.optimizer = optimizer
        self.before = before
        self.flags = flags  # (parameter, requires_grad before)

    def undo(self) -> None:
        del self.optimizer.param_groups[self.before :]
        for param, flag in self.flags:
            param.requires_grad_(flag)
        _ABSORBED.pop(id(self.optimizer), None)
        _WRAPPED.pop(id(self.optimizer), None)
        vars(self.optimizer).pop("add_param_group", None)


def grow_groups(
    saved: Mapping[str, Any], saved_objects: Mapping[str, Any], objects: Mapping[str, Any]
) -> list[Grown]:
    """Add the saved added groups to every live optimizer that has exactly the groups it was
    registered with (their parameters' ``requires_grad`` as saved), to :func:`shrink` again
    if the restore does not go through. An optimizer that cannot take them (other groups, a
    parameter not found) is left as it is: the state check then says what differs.

    The user's code that added them may run again (at the top of an epoch resumed part-way):
    the optimizer then takes that call for a group it already has as done."""
    grown: list[Grown] = []
    params: dict[str, Any] | None = None
    for name, entry in saved.items():
        obj = objects.get(name)
        tree = saved_objects.get(name)
        if obj is None or not is_optimizer(obj) or len(obj.param_groups) != entry["from"]:
            continue
        saved_groups = tree.get("param_groups") if isinstance(tree, Mapping) else None
        if not isinstance(saved_groups, list) or len(saved_groups) != entry["from"] + len(
            entry["names"]
        ):
            continue
        params = _named_parameters(objects) if params is None else params
        groups: list[dict[str, Any]] = []
        flags: list[tuple[Any, bool]] = []
        for names, trainable, saved_group in zip(
            entry["names"], entry["requires_grad"], saved_groups[entry["from"] :], strict=True
        ):
            if not all(n in params for n in names) or not isinstance(saved_group, Mapping):
                groups = []
                break
            options = {k: v for k, v in saved_group.items() if k != "params"}
            groups.append({"params": [params[n] for n in names], **options})
            flags += [(params[n], flag) for n, flag in zip(names, trainable, strict=True)]
        if not groups:
            continue
        change = Grown(obj, len(obj.param_groups), [(p, p.requires_grad) for p, _ in flags])
        try:
            for group in groups:
                obj.add_param_group(group)
        except Exception:
            change.undo()
            continue
        for param, flag in flags:
            param.requires_grad_(flag)
        _absorb_repeats(obj, groups)
        grown.append(change)
    return grown


def shrink_groups(grown: list[Grown]) -> None:
    """Undo :func:`grow`."""
    for change in reversed(grown):
        change.undo()


#: Per optimizer (by id): the parameter sets of the groups a restore gave back.
_ABSORBED: dict[int, list[set[int]]] = {}


def _absorb_repeats(optimizer: Any, groups: list[dict[str, Any]]) -> None:
    """``optimizer.add_param_group(g)`` for a group the restore already gave back does nothing
    (once per group): the call at the top of a resumed epoch would otherwise raise "some
    parameters appear in more than one parameter group"."""
    _ABSORBED[id(optimizer)] = [{id(p) for p in g["params"]} for g in groups]
    if "add_param_group" in vars(optimizer):
        return  # already wrapped
    original = type(optimizer).add_param_group

    def add_param_group(param_group: dict[str, Any]) -> None:
        pending = _ABSORBED.get(id(optimizer), [])
        params = param_group.get("params")
        ids = {id(p) for p in ([params] if hasattr(params, "shape") else list(params or []))}
        if ids in pending:
            pending.remove(ids)
            return
        original(optimizer, param_group)

    optimizer.add_param_group = add_param_group
    _WRAPPED[id(optimizer)] = weakref.ref(optimizer)


#: The optimizers whose add_param_group is wrapped, until the first step boundary.
_WRAPPED: dict[int, weakref.ref[Any]] = {}


def release_groups() -> None:
    """At a step boundary: a repeated add_param_group comes before the first one, so the
    wrappers go (the optimizer is again exactly the user's object, picklable)."""
    while _WRAPPED:
        key, ref = _WRAPPED.popitem()
        _ABSORBED.pop(key, None)
        optimizer = ref()
        if optimizer is not None:
            vars(optimizer).pop("add_param_group", None)
