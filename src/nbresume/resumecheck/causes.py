"""Why a resumed run ends differently: the known causes, and which of them the evidence names.

The evidence is of three kinds: which parts of the state differ (the steps trained, the random
streams, the data position, a learning rate, the weights alone); which of the script's globals
ended differently in the resumed run (:mod:`~nbresume.resumecheck.observe`: an object's own
random generator, a counter), which is observed; and what the script's source shows (a
generator it makes and does not give to the Checkpointer, an optimizer step taken every few
steps). The source is only read, never run, and what it shows is a heuristic: a cause named
from it is reported as *likely*. Where nothing points at a cause, none is named.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from nbresume.resumecheck.compare import (
    LOADER,
    MODEL,
    OPTIMIZER,
    PROGRESS,
    RNG,
    VALUE,
    Comparison,
)


@dataclass(frozen=True)
class Cause:
    """A known reason for a resumed run to differ, and its fix."""

    title: str
    why: str
    fix: str


PENDING_GRADIENTS = Cause(
    "pending gradients (gradient accumulation)",
    "a save between two optimizer steps holds the weights but not the gradients accumulated "
    "since the last optimizer step: the resumed run starts those micro-steps again from zero "
    "gradients (a save can land on any step: a stop before a deadline or on SIGTERM saves "
    "wherever the run is)",
    "make one step of ckpt.steps() one optimizer step: take the micro-batches of a step "
    "inside it (for _ in range(accum): x, y = next(batches); loss.backward()), then "
    "optimizer.step()",
)
UNSAVED_GENERATOR = Cause(
    "an unsaved random generator",
    "a generator the script makes (np.random.default_rng, torch.Generator, random.Random) "
    "starts over from its seed in a resumed run; nbresume saves the global streams, and the "
    "generators it is given",
    "give it to the Checkpointer: Checkpointer(..., noise=rng) or ckpt['noise'] = rng, "
    "before restore() or the loop; its state is then saved and restored into it",
)
GLOBAL_STREAMS = Cause(
    "draws from the global random streams that a resumed run does not repeat",
    "a sampler or a DataLoader that ckpt.loader() does not wrap (it shuffles with the global "
    "torch, random or NumPy stream when an iterator is made), or code that draws once per "
    "process (at start-up, after restore()), takes another number of draws in a resumed run",
    "wrap every DataLoader: batches = ckpt.loader(dl).batches() (or iterate ckpt.loader(dl) "
    "inside ckpt.epochs()); draw at start-up before restore(), which puts the streams back",
)
LOCAL_COUNTER = Cause(
    "a counter in a local variable (an early-stopping patience count, a step count)",
    "a resumed run starts it over, so the runs take other decisions from it: they stop at "
    "another step, or a value computed from it differs",
    "keep it in the checkpoint: ckpt['patience'] = patience after each change, and "
    "patience = ckpt['patience'] after restore() (set ckpt['patience'] = 0 before it)",
)
BATCH_SIZE = Cause(
    "a batch size that changed",
    "the data position is counted in batches: a resumed run whose DataLoader has another "
    "batch size (one picked from free memory or a probe) continues at another sample, with "
    "epochs of another length",
    "fix the batch size, or keep the one chosen: ckpt['batch_size'] = size, and build the "
    "DataLoader from ckpt['batch_size'] after restore()",
)
ENVIRONMENT = Cause(
    "an object of the script with a random generator of its own (an environment)",
    "the object (an RL environment, a data generator) is not given to the Checkpointer: its "
    "generator starts over from its seed in a resumed run, so the resumed run sees other "
    "observations or noise; nbresume saves the global streams, and the generators it is given",
    "give its generator to the Checkpointer by name, as Checkpointer(..., env_rng=env.rng) "
    "or ckpt['env_rng'] = env.rng before restore() (or give the object itself, with a "
    "state_dict() and load_state_dict() that hold its generator's state)",
)
UNSEEDED = Cause(
    "a script that is not seeded",
    "each run starts from other random weights or another data order (the loader's seed is "
    "torch's seed where the script seeds torch, else derived from the state of Python's "
    "random), so no two runs can match, interrupted or not; on a GPU, "
    "kernels that are not deterministic do the same",
    "seed it first: torch.manual_seed(0) (and random.seed, np.random.seed where used) before "
    "the model and the DataLoader are made; on a GPU, nbresume.init(..., deterministic=True)",
)


@dataclass(frozen=True)
class Verdict:
    """A cause, and what points at it."""

    cause: Cause
    evidence: str


#: ``name = np.random.default_rng(...)``, ``torch.Generator(...)``, ``random.Random(...)``.
_GENERATOR_MADE = re.compile(
    r"^[ \t]*(?:self\.)?(\w+)\s*(?::[^=\n]+)?=\s*"
    r"((?:\w+\.)*(?:default_rng|RandomState|Generator|Random))\s*\(",
    re.MULTILINE,
)
#: An optimizer step under a condition on the step number (``if (step + 1) % accum == 0:``).
_STEP_EVERY_FEW = re.compile(
    r"^[ \t]*if\b[^\n]*%[^\n]*:\s*\n(?:[^\n]*\n){0,3}?[^\n]*\.step\(\)", re.M
)
_ACCUMULATION = re.compile(r"accum", re.IGNORECASE)
_EARLY_STOPPING = re.compile(r"patience|early[_ ]?stop", re.IGNORECASE)


def unsaved_generators(source: str, registered: int) -> list[str]:
    """The generators ``source`` makes and does not seem to give to the Checkpointer (none
    when the checkpoint holds at least as many generators as the script makes)."""
    made = [(name, call) for name, call in _GENERATOR_MADE.findall(source)]
    if len(made) <= registered:
        return []
    found = []
    for name, call in made:
        given = re.search(rf"\w+\s*=\s*{re.escape(name)}\s*[,)]", source) or re.search(
            rf"\]\s*=\s*{re.escape(name)}\b", source
        )
        if not given:
            found.append(f"{name} = {call}(...)")
    return found


#: A hyperparameter of an optimizer's ``param_groups`` (``param_groups/0/lr``).
_HYPERPARAMETER = re.compile(r"^param_groups/\d+/(\w+)$")


def likely_causes(
    comparison: Comparison,
    source: str | None,
    script: str = "the script",
    globals_differ: Sequence[tuple[str, str, str]] = (),
) -> list[Verdict]:
    """The known causes the differences, the script's globals that ended differently
    (``globals_differ``: name, kind, note) and the script's ``source`` point at, best first;
    none where nothing points at one."""
    differences = comparison.differences
    kinds = {d.kind for d in differences}
    text = source or ""
    verdicts = _observed(globals_differ, script)
    if PROGRESS in kinds:
        ended = next(d for d in differences if d.kind == PROGRESS).keys[0][1]
        hint = (
            f"; {script} has an early-stopping patience count"
            if _EARLY_STOPPING.search(text)
            else ""
        )
        evidence = f"the runs trained a different number of steps ({ended}){hint}"
        verdicts.append(Verdict(LOCAL_COUNTER, evidence))
    loader = [d for d in differences if d.kind == LOADER]
    if any(key == "seed" for d in loader for key, _ in d.keys):
        verdicts.append(
            Verdict(
                UNSEEDED,
                "the loader's seed differs (torch's seed where the script seeds torch, else "
                "derived from the state of Python's random)",
            )
        )
    elif any(key == "batch_size" for d in loader for key, _ in d.keys):
        verdicts.append(Verdict(BATCH_SIZE, "the loader's batch size differs"))
    elif loader and PROGRESS not in kinds:
        verdicts.append(
            Verdict(BATCH_SIZE, "the data position differs though both runs trained as many steps")
        )
    streams = [d.name for d in differences if d.kind == RNG]
    if streams and PROGRESS not in kinds:
        verdicts.append(
            Verdict(
                GLOBAL_STREAMS,
                f"the global {', '.join(streams)} random stream{'s' if len(streams) > 1 else ''} "
                "ended in another state: the resumed run drew from it another number of times",
            )
        )
    if VALUE in kinds and not kinds & {MODEL, OPTIMIZER, PROGRESS}:
        keys = ", ".join(d.name for d in differences if d.kind == VALUE)
        evidence = f"a value kept with ckpt[...] differs ({keys}) though the weights do not"
        verdicts.append(Verdict(LOCAL_COUNTER, evidence))
    hyperparameters = [
        (d.name, key, note)
        for d in differences
        if d.kind == OPTIMIZER
        for key, note in d.keys
        if _HYPERPARAMETER.match(key)
    ]
    if hyperparameters and not any(v.cause is LOCAL_COUNTER for v in verdicts):
        name, key, note = hyperparameters[0]
        verdicts.append(
            Verdict(
                LOCAL_COUNTER,
                f"the optimizer {name!r}'s {key} differs ({note}): the script sets it from "
                "something the checkpoint does not hold (a count of its own, a schedule "
                "not given to the Checkpointer)",
            )
        )
    if kinds & {MODEL, OPTIMIZER} and PROGRESS not in kinds:
        seen = {v.cause for v in verdicts}
        verdicts += [v for v in _weights_alone(comparison, text, script) if v.cause not in seen]
        if ENVIRONMENT in seen:  # the generator the source shows is the one observed
            verdicts = [v for v in verdicts if v.cause is not UNSAVED_GENERATOR]
    return verdicts


def _observed(globals_differ: Sequence[tuple[str, str, str]], script: str) -> list[Verdict]:
    """The causes that the script's globals, as they ended in each run, show."""
    verdicts = []
    held = [(n, k) for n, k, _ in globals_differ if k != "counter"]
    if held:
        shown = ", ".join(f"`{n}` ({k})" for n, k in held)
        owners = sorted({n.split(".", 1)[0] for n, _ in held if "." in n})
        also = f"; held by {', '.join(f'`{o}`' for o in owners)}" if owners else ""
        evidence = (
            f"the generator{'s' if len(held) > 1 else ''} {shown} of {script} ended in "
            f"another state in the resumed run{also}: no Checkpointer restores "
            f"{'them' if len(held) > 1 else 'it'}"
        )
        verdicts.append(Verdict(ENVIRONMENT if owners else UNSAVED_GENERATOR, evidence))
    counters = [(n, note) for n, k, note in globals_differ if k == "counter"]
    if counters:
        shown = ", ".join(f"`{n}` ({note})" for n, note in counters)
        evidence = f"{script}'s global{'s' if len(counters) > 1 else ''} {shown} ended differently"
        verdicts.append(Verdict(LOCAL_COUNTER, evidence))
    return verdicts


def _weights_alone(comparison: Comparison, source: str, script: str) -> list[Verdict]:
    """What the source says about weights that differ."""
    found = []
    unsaved = unsaved_generators(source, comparison.generators)
    if unsaved:
        made = "; ".join(f"`{u}`" for u in unsaved)
        found.append(
            Verdict(UNSAVED_GENERATOR, f"{script} makes {made}, and no Checkpointer was given it")
        )
    if _ACCUMULATION.search(source) or _STEP_EVERY_FEW.search(source):
        found.append(
            Verdict(
                PENDING_GRADIENTS,
                f"{script} takes an optimizer step only every few steps of the loop",
            )
        )
    return found
