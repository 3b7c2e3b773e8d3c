"""GPU benchmark and diagnostic scripts, run by name: ``lily bench --run NAME [-- ARGS]``
(or ``python -m lily.bench.gpu.NAME``); ``lily bench --run list`` lists them.

- ``kernels.*``: each kernel family checked against the reference and timed at the
  model's shapes, its floors, tile sweeps (``--run kernels`` runs and merges the two main
  ones, lily.bench.kernels).
- ``e2e.*``: end-to-end prefill and decode, multi-turn prefix reuse.
- ``diagnostics.*``: where time goes (profiles, timelines, host time, launch floors, GEMV
  traces, the persistent step's protocol floor) and hunts (non-finite values, races
  between runs).

What they share: ``full_model`` (the full-size random model and a kernel engine over it,
the JSON output), ``op_hooks`` (hooks on the model's ops) and ``persistent_stream`` (the
persistent step's protocol kernel); the kernel scripts also ``kernels/common`` (shapes,
sweeps, timing helpers). A module of a group without an ``if __name__ == "__main__":``
block is a part of a script (``kernels.common``, ``kernels.moe_linear``, ...), not listed.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

GROUPS = ("kernels", "e2e", "diagnostics")


def scripts() -> dict[str, str]:
    """Every runnable script: name (``group.module``) -> the first line of its docstring."""
    out = {}
    here = Path(__file__).parent
    for group in GROUPS:
        for path in sorted((here / group).glob("*.py")):
            tree = ast.parse(path.read_text())
            if path.stem != "__init__" and _runnable(tree):
                doc = ast.get_docstring(tree) or ""
                out[f"{group}.{path.stem}"] = doc.strip().splitlines()[0] if doc else ""
    return out


def _runnable(tree: ast.Module) -> bool:
    """Whether a module is a script: it has a top-level ``if __name__ == "__main__":``."""
    return any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        for node in tree.body
    )


def run(name: str, argv: list[str]) -> int:
    """Run script ``name`` with ``argv`` as its command line, in this process; ``list``
    prints the scripts, ``kernels`` runs the kernel benchmarks and merges their tables."""
    if name == "list":
        for n, doc in scripts().items():
            print(f"{n:28} {doc}")
        return 0
    if name == "kernels":
        from lily.bench import kernels

        return kernels.main(argv)
    if name not in scripts():
        raise ValueError(f"--run: no GPU script {name!r} (lily bench --run list names them)")
    module = f"{__name__}.{name}"
    saved = sys.argv
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # a script's own exit status; sys.exit("why") says why
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0
