"""What breaks a Kaggle batch run ("Save & Run All"), found before the run is spent.

Each rule reads the notebook's cells (as Python where they parse, as text where they do not)
and reports a :class:`Finding` that names the cell, what is wrong and the fix. Errors stop
``nbresume commit``; warnings are printed. A rule's id can be passed to ``--allow`` to turn
its errors into warnings when the notebook knows better.

Rules:

- ``kernelspec``: no ``metadata.kernelspec.name``; Kaggle runs the notebook with papermill,
  which stops with "No kernel name found in notebook".
- ``syntax`` (warning): a cell that does not parse as Python is checked as text only.
- ``input``: ``input()`` or ``getpass()``; no one answers in a batch run.
- ``colab``: ``google.colab`` / ``drive.mount``; there is no Colab module on Kaggle.
- ``content-path``: a hard-coded ``/content`` path (Colab's working folder).
- ``pip-offline``: ``pip install`` with internet off (unless ``--no-index``).
- ``accelerator``, ``internet``: ``nbresume.init`` asks for a machine the commit does not ask
  Kaggle for, so the first cell would fail.
- ``first-cell`` (warning): the first code cell (after installs) does not call
  ``nbresume.init`` or ``nbresume.preflight``.
- ``no-output`` (warning): nothing suggests that anything is written to ``/kaggle/working``,
  the only folder kept as the version's output.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from nbresume.kaggle.notebook import Cell, Notebook
from nbresume.kaggle.secrets import kinds_in

Severity = Literal["error", "warn"]

RULES = (
    "kernelspec",
    "syntax",
    "input",
    "colab",
    "content-path",
    "pip-offline",
    "accelerator",
    "internet",
    "first-cell",
    "no-output",
)

_PIP_INSTALL = re.compile(r"\bpip3?(\.exe)?[\"']?\s*,?\s*[\"']?install\b")
_CONTENT_PATH = re.compile(r"(?<![\w./-])/content(?:/|\b)")
_SHELL_OR_MAGIC = re.compile(r"^\s*(!|%)")
_INIT_NAMES = {"init", "preflight"}


def cell_name(cell: Cell) -> str:
    """``cell 4 (`model.fit(...)`)``: how messages name a cell; never with its first line where
    that line holds a credential (:func:`~nbresume.kaggle.secrets.kinds_in`)."""
    first = cell.first_line
    if kinds_in(first):
        return f"cell {cell.number}"
    if len(first) > 60:
        first = first[:57] + "..."
    return f"cell {cell.number} (`{first}`)" if first else f"cell {cell.number}"


@dataclass(frozen=True)
class Finding:
    """One problem: the rule, how bad, the cell (``None``: the whole notebook), and the fix."""

    rule: str
    severity: Severity
    message: str
    fix: str
    cell: Cell | None = None

    def __str__(self) -> str:
        where = f"{cell_name(self.cell)}: " if self.cell is not None else ""
        return f"{self.severity} [{self.rule}] {where}{self.message}. Fix: {self.fix}"


@dataclass(frozen=True)
class Target:
    """What the commit asks Kaggle for: an accelerator kind and internet on or off."""

    accelerator: str = "cpu"  # "gpu", "tpu" or "cpu"
    internet: bool = True


def lint(notebook: Notebook, target: Target, allow: frozenset[str] = frozenset()) -> list[Finding]:
    """Every finding, in notebook order; errors of rules in ``allow`` become warnings."""
    found: list[Finding] = []
    if not notebook.kernel_name and not notebook.script:
        found.append(
            Finding(
                "kernelspec",
                "error",
                "the notebook has no metadata.kernelspec.name; Kaggle's papermill run stops "
                "with 'No kernel name found in notebook'",
                'open and save it in Jupyter, or add "kernelspec": {"name": "python3", '
                '"display_name": "Python 3", "language": "python"} to its metadata',
            )
        )
    if not notebook.code_cells:
        found.append(Finding("no-output", "warn", "the notebook has no code cell", "add one"))
        return _allowed(found, allow)
    names = _Names()
    for cell in notebook.code_cells:
        tree = cell.python()
        if tree is not None:
            names.learn(tree)
            names.values.learn(cell, tree)
        found += _cell_findings(cell, tree, target, names)
    found += _first_cell(notebook, names)
    found += _no_output(notebook, names)
    found.sort(key=lambda f: f.cell.number if f.cell is not None else 0)
    return _allowed(found, allow)


def _allowed(found: list[Finding], allow: frozenset[str]) -> list[Finding]:
    return [
        Finding(f.rule, "warn", f.message, f.fix, f.cell)
        if f.rule in allow and f.severity == "error"
        else f
        for f in found
    ]


class _Names:
    """How the notebook names nbresume and its first-cell functions (``import nbresume as
    nbr``, ``from nbresume import init``)."""

    def __init__(self) -> None:
        self.modules = {"nbresume"}
        self.functions: set[str] = set()
        self.init_aliases: set[str] = set()
        self.checkpointer: set[str] = {"Checkpointer"}
        self.values = _Values()

    def learn(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "nbresume":
                        self.modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.ImportFrom) and node.module == "nbresume":
                for alias in node.names:
                    if alias.name in _INIT_NAMES:
                        self.functions.add(alias.asname or alias.name)
                    if alias.name == "init":
                        self.init_aliases.add(alias.asname or alias.name)
                    elif alias.name == "Checkpointer":
                        self.checkpointer.add(alias.asname or alias.name)

    def is_init(self, call: ast.Call) -> bool:
        name = _dotted(call.func)
        module, _, function = name.rpartition(".")
        return (module in self.modules and function in _INIT_NAMES) or name in self.functions

    def is_checkpointing(self, call: ast.Call) -> bool:
        """nbresume.init (its folder is in /kaggle/working) or a Checkpointer; not preflight,
        which writes nothing."""
        name = _dotted(call.func)
        module, _, function = name.rpartition(".")
        return (
            (module in self.modules and function == "init")
            or name in self.init_aliases
            or function in self.checkpointer
            or name.endswith(".checkpointer")
        )


class _Values:
    """The constants the notebook assigns to plain names at the top level of its cells
    (``accelerator = "gpu"`` in a parameters cell), so that ``init(accelerator=accelerator)``
    reads as what it asks for."""

    def __init__(self) -> None:
        # name -> [(cell number, line, value)], in notebook order
        self._assigned: dict[str, list[tuple[int, int, object]]] = {}

    def learn(self, cell: Cell, tree: ast.Module) -> None:
        for statement in tree.body:
            value: ast.expr | None = None
            targets: list[ast.expr] = []
            if isinstance(statement, ast.Assign):
                value, targets = statement.value, list(statement.targets)
            elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
                value, targets = statement.value, [statement.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    constant = value.value if isinstance(value, ast.Constant) else _UNKNOWN
                    place = (cell.number, statement.lineno, constant)
                    self._assigned.setdefault(target.id, []).append(place)

    def resolve(self, node: ast.expr | None, cell: Cell, line: int) -> ast.expr | None:
        """``node`` itself, or for a name the constant last assigned to it before ``line`` of
        ``cell`` (``None`` when that is not a constant)."""
        if not isinstance(node, ast.Name):
            return node
        value: object = _UNKNOWN
        for number, lineno, assigned in self._assigned.get(node.id, []):
            if (number, lineno) < (cell.number, line):
                value = assigned
        if value is _UNKNOWN:
            return None
        return ast.Constant(value)  # type: ignore[arg-type]  # only constants are stored


_UNKNOWN = object()


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a name or attribute chain, ``""`` otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _calls(tree: ast.AST) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _calls_any(cell: Cell, which: Callable[[ast.Call], bool]) -> bool:
    """Whether the cell parses and makes a call that ``which`` picks."""
    tree = cell.python()
    return tree is not None and any(which(c) for c in _calls(tree))


def _strings(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def _cell_findings(
    cell: Cell, tree: ast.Module | None, target: Target, names: _Names
) -> list[Finding]:
    found: list[Finding] = []
    shell = cell.ipython_lines()
    if tree is not None:
        for call in _calls(tree):
            name = _dotted(call.func)
            if name in ("input", "getpass", "getpass.getpass"):
                found.append(
                    Finding(
                        "input",
                        "error",
                        f"{name}() waits for an answer, and no one answers in a batch run "
                        "(papermill stops with StdinNotImplementedError)",
                        "set the value in the code, or read it with "
                        "kaggle_secrets.UserSecretsClient().get_secret(...) for a secret",
                        cell,
                    )
                )
        if _uses_colab(tree):
            found.append(
                Finding(
                    "colab",
                    "error",
                    "google.colab (drive.mount) does not exist on Kaggle; the run stops here",
                    "remove the Drive mount: on Kaggle, nbresume.init() keeps checkpoints in "
                    "/kaggle/working, which is saved as the version's output",
                    cell,
                )
            )
        strings = list(_strings(tree))
    else:
        strings = [cell.source]
        if not cell.source.lstrip().startswith("%%"):
            found.append(
                Finding(
                    "syntax",
                    "warn",
                    "the cell does not parse as Python, so it was checked as plain text only",
                    "fix the syntax (the smoke run shows the error), or ignore this if it is "
                    "IPython syntax such as `files = !ls`",
                    cell,
                )
            )
    texts = strings + shell
    if any(_CONTENT_PATH.search(t) for t in texts):
        found.append(
            Finding(
                "content-path",
                "error",
                "a hard-coded /content path (Colab's folder) does not exist on Kaggle",
                "use /kaggle/working (kept as the output), /kaggle/input (attached data) or a "
                "relative path",
                cell,
            )
        )
    if not target.internet:
        installs = [t for t in texts if _PIP_INSTALL.search(t) and "--no-index" not in t]
        if tree is not None:
            installs += [
                "pip install"
                for call in _calls(tree)
                if _argv_installs(call) and not _argv_has(call, "--no-index")
            ]
        # A cell that installs from a local folder with --no-index when one is attached (the
        # wheel `nbresume commit` uploads) keeps `pip install` as the fallback for internet on.
        offline_aware = any(_PIP_INSTALL.search(t) and "--no-index" in t for t in texts)
        if installs and not offline_aware:
            found.append(
                Finding(
                    "pip-offline",
                    "error",
                    "pip install with internet off fails (Temporary failure in name resolution)",
                    "commit with --internet, or attach the wheels as a dataset and install "
                    "them with `pip install --no-index --find-links /kaggle/input/<dataset> ...`",
                    cell,
                )
            )
    if tree is not None:
        found += _init_expectations(cell, tree, target, names)
    return found


def _uses_colab(tree: ast.Module) -> bool:
    return any(
        (isinstance(n, ast.Import) and any(a.name.startswith("google.colab") for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("google.colab"))
        for n in ast.walk(tree)
    ) or any(_dotted(c.func).endswith("drive.mount") for c in _calls(tree))


def imports_colab(notebook: Notebook) -> bool:
    """Whether the notebook uses ``google.colab`` (imports it or mounts Drive)."""
    for cell in notebook.code_cells:
        tree = cell.python()
        if tree is None:
            if "google.colab" in cell.source:
                return True
        elif _uses_colab(tree):
            return True
    return False


def _argv_installs(call: ast.Call) -> bool:
    """``subprocess.run(["pip", "install", ...])`` and the like."""
    for arg in call.args:
        if isinstance(arg, (ast.List, ast.Tuple)):
            words = [e.value for e in arg.elts if isinstance(e, ast.Constant)]
            for first, second in itertools.pairwise(words):
                pip = isinstance(first, str) and first.endswith(("pip", "pip3"))
                if pip and second == "install":
                    return True
    return False


def _argv_has(call: ast.Call, flag: str) -> bool:
    return any(
        isinstance(e, ast.Constant) and e.value == flag
        for arg in call.args
        if isinstance(arg, (ast.List, ast.Tuple))
        for e in arg.elts
    )


def _init_arguments(call: ast.Call) -> dict[str, ast.expr]:
    """The ``accelerator`` and ``internet`` arguments of an init/preflight call."""
    args = {k.arg: k.value for k in call.keywords if k.arg}
    # init(name, accelerator, internet): after the name for init, first for preflight.
    positional = call.args[1:] if _dotted(call.func).endswith("init") else call.args
    for key, value in zip(("accelerator", "internet"), positional, strict=False):
        args.setdefault(key, value)
    return args


def expectations(notebook: Notebook) -> tuple[str | None, bool | None]:
    """What ``nbresume.init`` asks for: the accelerator kind (``"gpu"``, ``"tpu"``,
    ``"cpu"``) and internet, each ``None`` when not given as a constant (written in the call,
    or assigned to the name the call passes)."""
    names = _Names()
    accelerator: str | None = None
    internet: bool | None = None
    for cell in notebook.code_cells:
        tree = cell.python()
        if tree is None:
            continue
        names.learn(tree)
        names.values.learn(cell, tree)
        for call in _calls(tree):
            if not names.is_init(call):
                continue
            args = _init_arguments(call)
            accel = names.values.resolve(args.get("accelerator"), cell, call.lineno)
            net = names.values.resolve(args.get("internet"), cell, call.lineno)
            if isinstance(accel, ast.Constant) and isinstance(accel.value, str):
                accelerator = accel.value.split(":")[0].lower()
            if isinstance(net, ast.Constant) and isinstance(net.value, bool):
                internet = net.value
    return accelerator, internet


def _init_expectations(
    cell: Cell, tree: ast.Module, target: Target, names: _Names
) -> list[Finding]:
    """``nbresume.init(accelerator=..., internet=...)`` against what the commit asks for: in a
    batch run a mismatch fails the first cell."""
    found: list[Finding] = []
    for call in _calls(tree):
        if not names.is_init(call):
            continue
        args = _init_arguments(call)
        accel = names.values.resolve(args.get("accelerator"), cell, call.lineno)
        if isinstance(accel, ast.Constant) and isinstance(accel.value, str):
            wanted = accel.value.split(":")[0].lower()
            if wanted in ("gpu", "tpu") and wanted != target.accelerator:
                found.append(
                    Finding(
                        "accelerator",
                        "error",
                        f"nbresume.init asks for accelerator={accel.value!r}, but the commit "
                        f"asks Kaggle for {target.accelerator}; the first cell would fail",
                        f"commit with --accelerator {'tpu' if wanted == 'tpu' else 't4x2'}, or "
                        "change accelerator= in the first cell",
                        cell,
                    )
                )
        internet = names.values.resolve(args.get("internet"), cell, call.lineno)
        if (
            isinstance(internet, ast.Constant)
            and isinstance(internet.value, bool)
            and internet.value != target.internet
        ):
            found.append(
                Finding(
                    "internet",
                    "error",
                    f"nbresume.init asks for internet={internet.value}, but the commit turns "
                    f"internet {'on' if target.internet else 'off'}; the first cell would fail",
                    f"commit with {'--internet' if internet.value else '--no-internet'}, or "
                    "change internet= in the first cell",
                    cell,
                )
            )
    return found


def _is_setup_only(cell: Cell) -> bool:
    """A cell of shell lines, magics and comments only (``!pip install -q nbresume``)."""
    for line in cell.source.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and not _SHELL_OR_MAGIC.match(line):
            return False
    return True


def _first_cell(notebook: Notebook, names: _Names) -> list[Finding]:
    for cell in notebook.code_cells:
        if "%load_ext nbresume" in cell.source:
            return []
        if _is_setup_only(cell) or "parameters" in cell.tags:
            continue  # installs, and papermill's parameters cell, come before init by design
        if _calls_any(cell, names.is_init):
            return []
        return [
            Finding(
                "first-cell",
                "warn",
                "the first code cell does not call nbresume.init(...) (or nbresume.preflight)",
                "start with `import nbresume` and `run = nbresume.init('my-run', "
                "accelerator=..., internet=...)`: a batch run then stops at its first cell "
                "when the machine is not what the training expects, not hours later",
                cell,
            )
        ]
    return []


def _no_output(notebook: Notebook, names: _Names) -> list[Finding]:
    if "/kaggle/working" in notebook.all_source():
        return []
    for cell in notebook.code_cells:
        if _calls_any(cell, names.is_checkpointing):
            return []
    return [
        Finding(
            "no-output",
            "warn",
            "nothing in the notebook uses nbresume.init, a Checkpointer or /kaggle/working; "
            "the version's output may be empty and the trained weights lost with the session",
            "checkpoint with run.checkpointer(...) or write results under /kaggle/working",
        )
    ]
