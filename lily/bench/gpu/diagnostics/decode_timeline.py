"""Where a decode step's time goes inside its CUDA graph (one GPU call).

On the full-size random model on the kernels, after a prompt of each --contexts
length: the step's device time (graph replays timed with CUDA events, median), then one
replay under torch.profiler. With programmatic dependent launch the kernels overlap, so a
kernel's duration says little; what each adds to the step is its *exposed* time: how far
its end moves the latest end seen so far (kernels in start order). Reported per kernel
name and per layer kind (the kinds of lily/bench/gpu/diagnostics/kernel_profile.py), with
the copy-bandwidth floor of the step's bytes for scale.

``--variants`` runs the same measurement with model or kernel switches changed (A/B in
one process, same host and model): ``pdl_off`` (no programmatic dependent launch) and any
name given in ``--swap name=module:function@ops_name`` (a stand-in function for one the
model's ops call (lily/model/ops.py), e.g. an earlier version of a kernel's launcher kept
outside the package).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect

import torch
from torch.profiler import ProfilerActivity, profile

import lily.model.ops as ops_mod
from lily.bench.gpu.diagnostics.kernel_profile import kind_of
from lily.bench.gpu.full_model import full_params, kernel_engine, write_json
from lily.bench.measure import pseudo_text_ids, replay_ms


def timeline(graph) -> dict:
    """One replay's kernels: per name and per kind, the count, summed duration and summed
    exposed time (us), and the span from the first start to the last end."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    if not ks:
        return {"error": "no kernels recorded"}
    by_name: dict[str, list[float]] = {}
    by_kind: dict[str, list[float]] = {}
    end = ks[0][0]
    for s, e, name in ks:
        exposed = max(0.0, e - max(end, s))  # idle time before it is counted apart
        gap = max(0.0, s - end)
        end = max(end, e)
        for key, table in ((name[:60], by_name), (kind_of(name), by_kind)):
            row = table.setdefault(key, [0, 0.0, 0.0, 0.0])
            row[0] += 1
            row[1] += e - s
            row[2] += exposed
            row[3] += gap
    span = end - ks[0][0]

    def rows(table: dict) -> dict:
        out = {k: {"n": v[0], "dur_us": round(v[1], 1), "exposed_us": round(v[2], 1),
                   "idle_before_us": round(v[3], 1)}
               for k, v in table.items()}  # fmt: skip
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["exposed_us"]))

    return {"kernels": len(ks), "span_us": round(span, 1), "by_kind": rows(by_kind),
            "by_kernel": rows(by_name)}  # fmt: skip


def print_timeline(head: str, tl: dict, top: int = 10) -> None:
    """``head``, then ``timeline``'s kernel count and exposed time by kind (us), then its
    ``top`` kernels by exposed time."""
    kinds = ", ".join(f"{k} {v['exposed_us']:.0f}" for k, v in tl["by_kind"].items())
    print(f"{head}, {tl.get('kernels')} kernels; exposed: {kinds}", flush=True)
    for k, v in list(tl["by_kernel"].items())[:top]:
        print(f"    {k}: {v}", flush=True)


@contextlib.contextmanager
def variant(name: str, runner, swaps: dict):
    """Switch one thing for the duration of a measurement."""
    undo = []
    model = runner.model
    if name == "pdl_off":
        step_ops = model.step_ops
        model.step_ops = dataclasses.replace(step_ops, pdl=False)
        undo.append(lambda: setattr(model, "step_ops", step_ops))
    elif name in swaps:
        spec, attr = swaps[name].split("@")
        mod, fn = spec.split(":")
        new = getattr(importlib.import_module(mod), fn)
        old = getattr(ops_mod, attr)
        takes_pdl = "pdl" in inspect.signature(new).parameters

        def call(*a, pdl=False, _new=new, **kw):  # older launchers may not take pdl
            return _new(*a, pdl=pdl, **kw) if takes_pdl else _new(*a, **kw)

        setattr(ops_mod, attr, call)
        undo.append(lambda: setattr(ops_mod, attr, old))
    elif name != "current":
        raise SystemExit(f"unknown variant {name!r}")
    try:
        runner.graphs.clear()
        yield
    finally:
        for u in undo:
            u()
        runner.graphs.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--variants", default="current")
    ap.add_argument("--swap", action="append", default=[], help="name=module:function@attr")
    ap.add_argument("--out")
    args = ap.parse_args()
    swaps = dict(s.split("=", 1) for s in args.swap)
    params = full_params()
    ctxs = [int(c) for c in args.contexts.split(",")]
    engine = kernel_engine(params, max_context=max(ctxs) + 4096)
    runner = engine.runner
    results = []
    for ctx in ctxs:
        st = engine.new_state()
        for c in st.kv.values():
            c.ensure(ctx + 512)
        logits = runner.prefill(pseudo_text_ids(ctx, engine.cfg.vocab_size, 5), st)
        tok = int(logits.argmax())
        for name in args.variants.split(","):
            with variant(name, runner, swaps):
                for _ in range(3):  # capture, then settle
                    runner.decode(tok, st)
                graph, _ = runner._graph(st, st.length)
                ms = replay_ms(graph)
                tl = timeline(graph)
            row = {"context": ctx, "variant": name, "step_ms": round(ms, 4),
                   "tok_per_s": round(1e3 / ms, 1), **tl}  # fmt: skip
            results.append(row)
            print_timeline(f"ctx {ctx} {name}: step {ms * 1e3:.1f} us ({1e3 / ms:.1f} tok/s), "
                           f"span {tl.get('span_us')} us", tl)  # fmt: skip
    write_json(args.out, args, results=results)


if __name__ == "__main__":
    main()
