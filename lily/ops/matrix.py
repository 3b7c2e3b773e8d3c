"""The compile matrix: kernel launches compiled for a GPU architecture without the GPU, and
the result checked against that architecture's limits (lily.ops.arch).

A launch comes from the launchers themselves: under ``record_launches`` the public ops run
on meta tensors and every ``Launched`` kernel notes its arguments instead of running.
``freeze`` turns a noted launch into a ``Launch`` that crosses processes (tensors as their
dtype and 16-byte alignment, the other integers as what Triton specializes them on), and
``check`` binds it the way Triton's own launcher does, compiles it with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` and reads the shared
memory, registers and stack frame of the cubin. ``check_all`` spreads the compiles over
worker processes: the Triton interpreter the CPU tests run under cannot compile, and a
worker imports the kernels afresh without it.

Stored results: a compile is a pure function of Triton's own cache key (Triton and its
ptxas, the kernel's source and every jit function it calls, constexprs, specialization,
options, target, the environment variables Triton hashes), so a result kept under that key
(``save_results``/``load_results``) stands for a compile of the same key; ``check_all``
compiles only the keys it is not given. Any change to a kernel, its tiles or Triton
changes the key and the config is compiled again.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import importlib
import inspect
import json
import multiprocessing
import os
import resource
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lily.ops.arch import ARCHS, Arch

# Stack frame a config may have (bytes a thread): no kernel here has local arrays, so it
# is register spills. The H200's configs have at most 48 B, the largest kept anywhere is
# 160 (sm_80's flash tile); the MoE tile this rejected spilled about 2 KB a thread.
STACK_LIMIT = 256


@dataclass(frozen=True)
class Launch:
    """One kernel launch in a form that crosses processes: the kernel (module and name),
    its positional arguments (tensors as ("tensor", dtype name, 16-byte aligned), integers
    that are not constexprs reduced to Triton's specialization: width, == 1, % 16 == 0)
    and its keyword arguments, sorted."""

    module: str
    name: str
    args: tuple
    kwargs: tuple

    def config(self) -> str:
        """The constexprs and launch options, as a failure message names them."""
        return ", ".join(f"{k}={v}" for k, v in self.kwargs)

    def __str__(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}[{self.config()}]"


@dataclass
class Result:
    """What one launch compiled to for one arch (``error``: why it did not compile)."""

    launch: Launch
    arch: str
    shared: int = 0
    regs: int = 0
    stack: int = 0
    num_warps: int = 4
    seconds: float = 0.0  # CPU time of the compile, ptxas included
    error: str | None = None
    cases: list[str] = field(default_factory=list)  # where the matrix launched it
    key: str = ""  # Triton's cache key of the compile (sha256)
    stored: bool = False  # taken from stored results, not compiled in this run


def _int_class(a: int) -> int:
    """A stand-in integer that Triton specializes exactly as ``a`` (a value of 1 becomes a
    constant, a multiple of 16 gets a divisibility hint, 32/64-bit width)."""
    if a == 1:
        return 1
    base = 0 if -(2**31) <= a < 2**31 else 2**40
    return base + (16 if a % 16 == 0 else 17)


@functools.cache
def _params(raw) -> tuple[list[str], set[str]]:
    """Parameter names of a kernel's Python function and those annotated ``tl.constexpr``."""
    params = inspect.signature(raw).parameters.values()
    return [p.name for p in params], {p.name for p in params if "constexpr" in str(p.annotation)}


def freeze(record: tuple) -> Launch:
    """A ``Launch`` from one entry of ``record_launches`` (the kernel may be interpreted or
    compiled)."""
    launched, _grid, args, kwargs = record
    raw = getattr(launched.fn, "fn", launched.fn)
    names, const = _params(raw)
    out = []
    for name, a in zip(names, args, strict=False):
        if isinstance(a, torch.Tensor):
            out.append(("tensor", str(a.dtype).removeprefix("torch."), a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or name in const or not isinstance(a, int):
            out.append(a)
        else:
            out.append(_int_class(a))
    return Launch(raw.__module__, raw.__name__, tuple(out), tuple(sorted(kwargs.items())))


def _thaw(arg):
    """A launch argument back as something Triton's binder takes (tensors on meta, at an
    address whose 16-byte alignment is the recorded one)."""
    if isinstance(arg, tuple) and len(arg) == 3 and arg[0] == "tensor":
        dtype = getattr(torch, arg[1])
        t = torch.empty(64, dtype=dtype, device="meta")
        return t if arg[2] else t[1:]
    return arg


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK and (static) SHARED of the one kernel in a cubin, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    line = next(x for x in out.splitlines() if "REG:" in x)
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return {k: int(fields[k]) for k in ("REG", "STACK", "SHARED")}


def _bind(launch: Launch, arch: Arch):
    """(ASTSource, target, options) of ``launch`` for ``arch`` as Triton's launcher would
    build them on that GPU: its binder's specialization of the arguments, the options
    parsed from the keywords."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = getattr(importlib.import_module(launch.module), launch.name).fn
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError(f"{launch.name} is not a compiled jit function (interpreter on?)")
    target = GPUTarget("cuda", arch.cc, 32)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*[_thaw(a) for a in launch.args], **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return ASTSource(fn, signature, constexprs, attrs), target, options.__dict__


def compile_launch(launch: Launch, arch: Arch):
    """Compile ``launch`` for ``arch`` (see ``_bind``)."""
    import triton

    src, target, options = _bind(launch, arch)
    return triton.compile(src, target=target, options=options)


def launch_key(launch: Launch, arch_name: str) -> str:
    """sha256 of Triton's cache key for compiling ``launch`` for the arch (what
    ``triton.compile`` computes before it looks in its cache); "" if it cannot be bound."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler import make_backend
    from triton.runtime.cache import get_cache_key

    try:
        src, target, options = _bind(launch, ARCHS[arch_name])
    except Exception:  # noqa: BLE001 -- the compile reports it
        return ""
    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, opts, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode()).hexdigest()


def check(launch: Launch, arch_name: str) -> Result:
    """Compile ``launch`` for one arch and read what it uses (never raises: a compile
    error is the result's ``error``)."""
    arch = ARCHS[arch_name]
    t0 = _cpu_seconds()
    res = Result(launch, arch_name, num_warps=dict(launch.kwargs).get("num_warps", 4))
    try:
        kernel = compile_launch(launch, arch)
        use = _resources(kernel.asm["cubin"])
        res.shared = kernel.metadata.shared
        res.regs, res.stack = use["REG"], use["STACK"]
    except Exception as e:  # noqa: BLE001 -- reported as the failure of this config
        lines = str(e).strip().splitlines() or [""]
        res.error = f"{type(e).__name__}: {lines[-1][:300]}"
    res.seconds = _cpu_seconds() - t0
    return res


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas, cuobjdump): what a
    compile costs on a shared machine, whatever else runs there."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def reg_alloc(regs: int, num_warps: int) -> int:
    """Registers a block of ``num_warps`` warps takes: per thread rounded up to 8, per warp
    to 256 (the allocation unit)."""
    per_warp = -(-(-(-regs // 8) * 8 * 32) // 256) * 256
    return per_warp * num_warps


def problems(res: Result) -> list[str]:
    """Every limit of its arch ``res`` breaks (empty: it fits)."""
    arch = ARCHS[res.arch]
    if res.error:
        return [f"does not compile ({res.error})"]
    out = []
    if res.shared > arch.smem:
        out.append(f"shared memory {res.shared} B > {arch.smem} B")
    if res.regs > arch.max_regs:
        out.append(f"{res.regs} registers a thread > {arch.max_regs}")
    alloc = reg_alloc(res.regs, res.num_warps)
    if alloc > arch.regs_per_block:
        out.append(f"{res.regs} registers x {res.num_warps} warps = {alloc} > "
                   f"{arch.regs_per_block} a block")  # fmt: skip
    if res.stack > STACK_LIMIT:
        out.append(f"stack frame (spills) {res.stack} B a thread > {STACK_LIMIT}")
    return out


def _worker_init(cache_dir: str | None) -> None:
    # Compiled kernels, not the interpreter, and (for timing) an empty cache if asked.
    os.environ.pop("TRITON_INTERPRET", None)
    # Each arch as its own GPU compiles it: warpgroup MMA on sm_90 even where a forced
    # fallback (LILY_GPU_ARCH, lily.ops.arch.force_arch) turned it off in this process.
    os.environ.pop("DISABLE_MMA_V3", None)
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    torch.set_num_threads(1)


class CompilePool:
    """Worker processes for ``check_all``, spawned (not forked) so that they import the
    kernels afresh, compiled rather than interpreted; ``cache_dir``: Triton's cache there
    (an empty one measures a cold compile). A context manager; ``restart`` replaces
    workers a crash took down."""

    def __init__(self, workers: int = 2, cache_dir: str | None = None):
        self.workers, self.cache_dir = workers, cache_dir
        self.executor = self._start()

    def _start(self) -> cf.ProcessPoolExecutor:
        ctx = multiprocessing.get_context("spawn")
        # NOTE: a spawned child imports the parent's main module before any initializer
        # runs; if that imports Triton with TRITON_INTERPRET set, its library functions are
        # interpreted for good. So the workers start now, without the variable.
        saved = os.environ.pop("TRITON_INTERPRET", None)
        try:
            pool = cf.ProcessPoolExecutor(self.workers, mp_context=ctx,
                                          initializer=_worker_init,
                                          initargs=(self.cache_dir,))  # fmt: skip
            for f in [pool.submit(os.getpid) for _ in range(self.workers)]:
                f.result()
        finally:
            if saved is not None:
                os.environ["TRITON_INTERPRET"] = saved
        return pool

    def restart(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.executor = self._start()

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc) -> None:
        self.executor.shutdown(cancel_futures=True)


def compile_pool(workers: int = 2, cache_dir: str | None = None) -> CompilePool:
    """A ``CompilePool`` of ``workers`` processes."""
    return CompilePool(workers, cache_dir)


def check_all(jobs: Iterable[tuple[Launch, str]], pool: CompilePool,
              stored: dict[str, dict] | None = None) -> list[Result]:  # fmt: skip
    """``check`` every (launch, arch name) on ``pool``; results in the order of ``jobs``.
    A job whose Triton cache key is in ``stored`` (``load_results``) takes that result
    instead of compiling.

    A compile that kills its worker (a crash in Triton's compiler, or out of memory) takes
    the pool's other jobs down with it: those are run again, and where a second batch
    breaks too, one at a time, so that only the culprit is reported (as not compiling).
    NOTE: only the launch's names and values cross; the worker imports the kernel."""
    jobs = list(jobs)
    keys = [""] * len(jobs)
    if stored:
        keys = list(pool.executor.map(launch_key, *zip(*jobs, strict=True), chunksize=8))
    results: list[Result | None] = [None] * len(jobs)
    todo = []
    for i, ((launch, arch), key) in enumerate(zip(jobs, keys, strict=True)):
        if key and key in stored:
            results[i] = from_stored(launch, arch, key, stored[key])
        else:
            todo.append(i)
    alone = False
    while todo:
        batches = [[i] for i in todo] if alone else [todo]
        broken = []
        for batch in batches:
            futures = {i: pool.executor.submit(check_keyed, *jobs[i]) for i in batch}
            crashed = []
            for i, f in futures.items():
                try:
                    results[i] = f.result()
                except cf.process.BrokenProcessPool:
                    crashed.append(i)
            if crashed:
                pool.restart()
                if alone:  # this job alone took its worker down
                    launch, arch = jobs[crashed[0]]
                    results[crashed[0]] = Result(launch, arch, error="the compiler crashed "
                                                 "(its worker process died)")  # fmt: skip
                else:
                    broken += crashed
        todo, alone = broken, True
    return results


def check_keyed(launch: Launch, arch_name: str) -> Result:
    """``check``, with the result's Triton cache key (so that it can be stored)."""
    res = check(launch, arch_name)
    res.key = launch_key(launch, arch_name)
    return res


# What a stored result keeps (with its key); the launch itself is not stored: the key
# stands for it, and the kernel and config are kept for a reader.
_STORED = ("arch", "shared", "regs", "stack", "num_warps", "error")


def from_stored(launch: Launch, arch: str, key: str, entry: dict) -> Result:
    """The Result a stored entry records for ``launch`` on ``arch``."""
    kw = {k: entry[k] for k in _STORED if k in entry}
    return Result(launch, **{**kw, "arch": arch}, key=key, stored=True)


def load_results(path: str | Path) -> dict[str, dict]:
    """Stored results by key ({} when the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return {}
    return {e["key"]: e for e in json.loads(path.read_text())["results"]}


def save_results(path: str | Path, results: Iterable[Result]) -> int:
    """Keep the results that have a key (not a crashed compile) in ``path``, one entry a
    line in key order; returns how many."""
    import triton

    rows = {}
    for r in results:
        if r.key and not (r.error or "").startswith("the compiler crashed"):
            rows[r.key] = {"key": r.key, "kernel": str(r.launch),
                           **{k: getattr(r, k) for k in _STORED}}  # fmt: skip
    body = ",\n".join(json.dumps(rows[k], sort_keys=True) for k in sorted(rows))
    Path(path).write_text(f'{{"triton": "{triton.__version__}", "results": [\n{body}\n]}}\n')
    return len(rows)


def report(results: Iterable[Result]) -> list[str]:
    """One line per result that breaks a limit: kernel, config, arch, what it breaks, and
    where the engine launches it."""
    out = []
    for r in results:
        bad = problems(r)
        if bad:
            where = "; ".join(sorted(set(r.cases))[:4]) + (" ..." if len(set(r.cases)) > 4 else "")
            out.append(f"{r.launch} on {r.arch}: {'; '.join(bad)} (launched by: {where})")
    return out
