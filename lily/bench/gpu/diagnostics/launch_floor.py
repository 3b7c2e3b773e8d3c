"""What one dependent step costs on this GPU, before any bytes are moved (one GPU call).

The decode step is ~250 launches, each reading what the one before wrote. This measures the
floor of such a chain with (almost) no work: CUDA graphs of back-to-back kernels where every
program reads 4 KB the previous kernel wrote and writes one value, per kernel in us, for
grids of 132-528 programs, launched plainly, with programmatic dependent launch (the wait
then the release, as the engine's kernels do) and with the release at the kernel's start.
Also the same chain linked by counters instead of the PDL wait (each kernel releases the
next at its start; its programs poll the previous kernel's counter), and the dependency as
a grid barrier inside one persistent kernel (an atomic counter every program adds to and
then polls): what a whole-step design would pay per dependency instead of a launch.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from lily.bench.measure import capture_graph, replay_ms

BLOCK = 1024  # fp32 values each program reads from the previous kernel's output (4 KB)


@triton.jit
def _link_kernel(p_in, p_out, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    if EARLY:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    x = tl.load(p_in + tl.arange(0, BLOCK))
    tl.store(p_out + pid, tl.sum(x, axis=0) * 0.5 + pid)


@triton.jit
def _flag_link_kernel(p_in, p_out, p_prev, p_next, target, FIRST: tl.constexpr,
                      BLOCK: tl.constexpr, ON_CPU: tl.constexpr = False):  # fmt: skip
    # The link by a counter instead of the PDL wait: the next kernel may launch at once
    # (every program releases it first); a program polls the previous kernel's counter
    # until all its programs have written, reads, writes, and counts itself in.
    if not ON_CPU:
        gdc_launch_dependents()
    if not FIRST:
        seen = tl.load(p_prev, volatile=True)
        while seen < target:
            seen = tl.load(p_prev, volatile=True)
        tl.atomic_add(p_prev, 0, sem="acquire")
    pid = tl.program_id(0)
    x = tl.load(p_in + tl.arange(0, BLOCK), cache_modifier=".cg")
    tl.store(p_out + pid, tl.sum(x, axis=0) * 0.5 + pid)
    tl.debug_barrier()
    tl.atomic_add(p_next, 1, sem="release")


@triton.jit
def _barrier_kernel(p_count, p_buf, ROUNDS: tl.constexpr, BLOCK: tl.constexpr,
                    POLL_LOAD: tl.constexpr = False):  # fmt: skip
    # Every program: read the buffer, write its value, arrive, poll until all have arrived
    # (an atomic read, or with POLL_LOAD a volatile load, then an acquiring atomic once).
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    for r in range(ROUNDS):
        x = tl.load(p_buf + (r % 2) * BLOCK + tl.arange(0, BLOCK), cache_modifier=".cg")
        tl.store(p_buf + ((r + 1) % 2) * BLOCK + pid, tl.sum(x, axis=0) * 0.5 + pid)
        tl.atomic_add(p_count, 1, sem="release")
        target = (r + 1) * n
        if POLL_LOAD:
            seen = tl.load(p_count, volatile=True)
            while seen < target:
                seen = tl.load(p_count, volatile=True)
            tl.atomic_add(p_count, 0, sem="acquire")
        else:
            seen = tl.atomic_add(p_count, 0, sem="acquire")
            while seen < target:
                seen = tl.atomic_add(p_count, 0, sem="acquire")


def graph_us(fn, n_calls: int) -> float:
    """Median device time of one call inside a captured graph of the calls ``fn`` makes."""
    return replay_ms(capture_graph(fn)[0], n=10, reps=7) * 1e3 / n_calls


def chain_rows(n_kernels: int) -> list[dict]:
    rows = []
    bufs = [torch.ones(max(BLOCK, 1024), device="cuda") for _ in range(n_kernels + 1)]
    for grid in (132, 264, 528):
        for warps in (4, 8):
            for label, pdl, early in (("plain", False, False), ("pdl", True, False),
                                      ("pdl, early release", True, True)):  # fmt: skip
                opts = {"launch_pdl": True} if pdl else {}

                def chain(grid=grid, warps=warps, pdl=pdl, early=early, opts=opts):
                    for i in range(n_kernels):
                        _link_kernel[(grid,)](bufs[i], bufs[i + 1], PDL=pdl, EARLY=early,
                                              BLOCK=BLOCK, num_warps=warps, **opts)  # fmt: skip

                us = graph_us(chain, n_kernels)
                rows.append({"what": "kernel chain", "grid": grid, "warps": warps,
                             "launch": label, "us_per_link": round(us, 3)})  # fmt: skip
                print(rows[-1], flush=True)
            counts = torch.zeros(n_kernels, dtype=torch.int32, device="cuda")

            def flags(grid=grid, warps=warps, counts=counts):
                counts.zero_()  # one fill node a replay
                for i in range(n_kernels):
                    _flag_link_kernel[(grid,)](
                        bufs[i], bufs[i + 1], counts[max(i - 1, 0)], counts[i], grid,
                        FIRST=i == 0, BLOCK=BLOCK, num_warps=warps, launch_pdl=True,
                    )  # fmt: skip

            flags()
            torch.cuda.synchronize()
            assert bool((counts == grid).all()), "a flag link did not count every program"
            us = graph_us(flags, n_kernels)
            rows.append({"what": "kernel chain", "grid": grid, "warps": warps,
                         "launch": "pdl, release at start, counter instead of the wait",
                         "us_per_link": round(us, 3)})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def barrier_rows(rounds: int) -> list[dict]:
    rows = []
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    buf = torch.ones(2 * BLOCK, device="cuda")
    for grid in (132, 264):
        for warps in (4, 8):
            for poll in (False, True):

                def one(grid=grid, warps=warps, poll=poll):
                    count.zero_()
                    _barrier_kernel[(grid,)](count, buf, ROUNDS=rounds, BLOCK=BLOCK,
                                             POLL_LOAD=poll, num_warps=warps)  # fmt: skip

                one()
                torch.cuda.synchronize()
                assert int(count.item()) == rounds * grid, "barrier rounds incomplete"
                us = graph_us(one, rounds)
                rows.append({"what": "grid barrier in one kernel", "grid": grid,
                             "warps": warps, "poll": "volatile load" if poll else "atomic",
                             "us_per_link": round(us, 3)})  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    from lily.bench.gpu.full_model import write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args()
    rows = chain_rows(args.kernels) + barrier_rows(args.kernels)
    write_json(args.out, args, results=rows)


if __name__ == "__main__":
    main()
