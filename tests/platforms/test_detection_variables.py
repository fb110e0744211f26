"""The detectors read the environment; the tests clear exactly what they read.

Every test that needs a neutral machine removes :data:`DETECTION_VARIABLES` from its
environment. A variable that a detector reads but that list lacks would let the host's own
environment (a CI runner over SSH, a Slurm allocation) change what those tests see.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbresume
from nbresume.platforms.base import DETECTION_VARIABLES

SOURCE = Path(nbresume.__file__).parent

#: Read by nbresume, but not about the machine it is on.
NOT_DETECTION = {
    "CUDA_VISIBLE_DEVICES",  # the tests set it explicitly ("" = no GPU)
    "NO_COLOR",  # the terminal's colour switch
    "TMPDIR",  # where scratch space is, not which platform
    "COLAB_STANDIN_ROOT",  # the smoke run's Drive stand-in
    "RANK",  # which process of a torch.distributed job this is
    "CUBLAS_WORKSPACE_CONFIG",  # a setting deterministic=True makes, not a fact of the machine
    "KAGGLE_USERNAME",  # the kaggle client's credentials
    "KAGGLE_CONFIG_DIR",
    "HF_ENDPOINT",  # which Hugging Face Hub a bucket URL reaches
}


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for element in node.elts for s in _strings(element)}
    return set()


def environment_reads(tree: ast.AST) -> set[str]:
    """Names read from ``os.environ`` in a module: literal keys, and the string elements of
    tuples that are looped over (``for v in ("A", "B")``), named ``*_VARIABLES``, or a
    platform's ``detected_by``."""
    names: set[str] = set()
    keys: list[ast.expr] = []  # every expression used as a key to read the environment
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if (func.attr == "get" and _is_environ(func.value)) or func.attr == "getenv":
                keys.append(node.args[0])
        elif (
            isinstance(node, ast.Subscript)
            and _is_environ(node.value)
            and isinstance(node.ctx, ast.Load)
        ):
            keys.append(node.slice)
    loop_variables = {key.id for key in keys if isinstance(key, ast.Name)}
    for key in keys:
        names |= _strings(key)
    for node in ast.walk(tree):
        if isinstance(node, ast.comprehension | ast.For):
            if isinstance(node.target, ast.Name) and node.target.id in loop_variables:
                names |= _strings(node.iter)
        elif isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if any(t.endswith("_VARIABLES") or t == "detected_by" for t in targets):
                names |= _strings(node.value)
    return names


def test_every_variable_a_detector_reads_is_listed() -> None:
    read: dict[str, str] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        for name in environment_reads(ast.parse(path.read_text(), filename=str(path))):
            read.setdefault(name, str(path.relative_to(SOURCE)))
    about_the_machine = {
        name: where
        for name, where in read.items()
        if name.isupper() and not name.startswith("NBRESUME_") and name not in NOT_DETECTION
    }
    missing = {n: w for n, w in about_the_machine.items() if n not in DETECTION_VARIABLES}
    assert not missing, f"add to DETECTION_VARIABLES in platforms/base.py: {missing}"
    # The scan itself sees the detectors (it would pass vacuously if it found nothing).
    assert {"COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE", "SSH_CONNECTION"} <= set(read)


def test_the_scan_sees_each_way_of_reading_the_environment() -> None:
    module = ast.parse(
        "import os\n"
        "A_VARIABLES = ('ONE', 'TWO')\n"
        "os.environ.get('THREE')\n"
        "os.environ['FOUR']\n"
        "os.getenv('FIVE')\n"
        "any(os.environ.get(v) for v in ('SIX', 'SEVEN'))\n"
        "class P:\n"
        "    detected_by = ('EIGHT',)\n"
    )
    expected = {"ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT"}
    assert environment_reads(module) == expected
