"""The persistent decode step's protocol floor on the real byte volume (one GPU call).

One block per SM streams every phase of a decode step (lily/ops/step_plan.py: each
layer's projections, mixer state or KV, router and shared expert, 8 experts chosen from
the previous phase's output, lm_head) through a shared-memory ring fed by bulk copies,
with a dependency counter in global memory between phases
(lily/bench/gpu/persistent_stream.py). Variants, per context: counters with the copies
running ahead across phases (the design), counters with a phase's copies issued only once
its input is complete, no waits at all (the loader's own rate), each with a checksum or
with the GEMVs' dequantizing tensor-core arithmetic (the first loop and the tighter ones:
``--sass`` counts their instructions, on any machine with NVRTC); the phases' dependencies
alone (no bytes: the cost of one link); the same bytes in one plain copy. Checked exactly
against the host (every byte read once, every wait held); a traced run gives the timeline
by phase kind (waiting and working) and the design's prediction is set beside it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import subprocess
import tempfile

import torch

from lily.bench.gpu import persistent_stream as ps
from lily.bench.gpu.kernels.common import cuobjdump
from lily.bench.measure import capture_graph, replay_ms
from lily.checkpoint import complete_text_config, make_config
from lily.config import ModelConfig
from lily.ops import cuda_rtc
from lily.ops.step_plan import Hardware, Phase, decode_phases, predict_step

VARIANTS = (  # (label, mode, mma loop: persistent_stream.MMA_LOOPS)
    ("counters, prefetch", 1, 0),
    ("counters, prefetch, mma", 1, 1),
    ("counters, copies after the wait", 2, 0),
    ("no waits", 0, 0),
    ("no waits, mma", 0, 1),
    ("counters, prefetch, mma2", 1, 2),
    ("no waits, mma2", 0, 2),
    ("counters, prefetch, mma3", 1, 3),
    ("no waits, mma3", 0, 3),
)


def full_config() -> ModelConfig:
    """The full model's config with the MLX 4-bit layout's quantization (8-bit routers)."""
    return ModelConfig.from_dict(make_config(complete_text_config({}), "mlx4", torch.bfloat16))


def links_only(phases: list[Phase]) -> list[Phase]:
    """The same phases and dependencies with no bytes."""
    return [dataclasses.replace(p, fixed_bytes=0, routed_bytes=0, slots=0, fetch_after=-1,
                                write_bytes=0) for p in phases]  # fmt: skip


def check(r: ps.Runner, launches: int = 3) -> str:
    """Launch ``launches`` steps and compare their final values with the host's."""
    for _ in range(launches):
        r.launch()
    torch.cuda.synchronize()
    got = r.results()
    want = [ps.expected_final(r.st, e) for e in range(1, len(got) + 1)]
    if r.aborted:
        return "FAILED: a wait timed out"
    if len(got) != launches:
        return f"FAILED: {len(got)} steps completed of {launches}"
    return "ok" if got == want else f"FAILED: {got} != {want}"


def step_us(r: ps.Runner, replays: int) -> float:
    graph, _ = capture_graph(r.launch)
    return replay_ms(graph, n=replays, reps=5) * 1e3


def timeline(r: ps.Runner) -> dict:
    """One traced step: per phase kind, the phases' count, the time they add to the step
    (last block's end to last block's end), and the mean per block of waiting for the
    input counter and of working after it."""
    r.buffers["trace"].zero_()
    r.launch()
    torch.cuda.synchronize()
    st = r.st
    tr = r.buffers["trace"].view(st.blocks, len(st.phases), 3)
    tr = (tr - tr[:, 0, 0].min()).double()  # ns from the first stamp (exact in a double)
    t0 = 0.0
    ends = tr[:, :, 2].max(0).values
    wait = (tr[:, :, 1] - tr[:, :, 0]).mean(0)
    work = (tr[:, :, 2] - tr[:, :, 1]).mean(0)
    kinds: dict[str, dict] = {}
    prev = t0
    for p, ph in enumerate(st.phases):
        k = kinds.setdefault(ph.kind, {"n": 0, "added_us": 0.0, "wait_us": 0.0, "work_us": 0.0})
        k["n"] += 1
        k["added_us"] += float(ends[p] - prev) / 1e3
        k["wait_us"] += float(wait[p]) / 1e3
        k["work_us"] += float(work[p]) / 1e3
        prev = ends[p]
    for k in kinds.values():
        for f in ("added_us", "wait_us", "work_us"):
            k[f] = round(k[f], 1)
    return {"span_us": round(float(ends[-1] - t0) / 1e3, 1), "by_kind": kinds}


def copy_row(st: ps.Stream, replays: int) -> dict:
    """The step's read bytes in one plain device copy (read and written once)."""
    n = st.read_bytes
    src = st.arena[:n].view(torch.int32)  # 4-byte elements: the copy's vector loads
    dst = torch.empty_like(src)
    graph, _ = capture_graph(lambda: dst.copy_(src))
    us = replay_ms(graph, n=max(2, replays // 4), reps=5) * 1e3
    return {"what": "plain copy of the step's bytes", "us": round(us, 1),
            "copy_GBps": round(2 * n / us / 1e3, 1)}  # fmt: skip


def context_rows(cfg: ModelConfig, ctx: int, args, sms: int) -> list[dict]:
    phases = decode_phases(cfg, ctx)
    st = ps.build(phases, sms, args.chunk, cfg.num_experts)
    gb = st.read_bytes / 1e9
    base = {"context": ctx, "phases": len(phases), "read_GB": round(gb, 4), "blocks": sms,
            "chunk": args.chunk, "stages": args.stages, "warps": args.warps}  # fmt: skip
    rows = [{**base, **copy_row(st, args.replays)}]
    print(rows[-1], flush=True)
    ceiling = rows[-1]["copy_GBps"]
    kw = {"stages": args.stages, "warps": args.warps}
    measured = {}
    for label, mode, mma in VARIANTS if not args.quick else VARIANTS[:2] + VARIANTS[3:4]:
        try:
            r = ps.runner(st, mode, mma=mma, **kw)
        except cuda_rtc.CudaRtcError as e:  # report it and go on with the other rows
            rows.append({**base, "what": label, "error": str(e)[:2000]})
            print(rows[-1], flush=True)
            continue
        row = {**base, "what": label, "registers": r.kernel.registers,
               "spill_bytes": r.kernel.spill_bytes}  # fmt: skip
        row["check"] = check(r) if mode else "not checked (no waits)"
        us = step_us(r, args.replays)
        measured[label] = us
        rate = gb * 1e6 / us  # GB/s
        row.update(us=round(us, 1), GBps=round(rate, 1), of_copy=round(rate / ceiling, 3),
                   tok_per_s=round(1e6 / us, 1))  # fmt: skip
        if mode == 1:
            row["timeline"] = timeline(ps.runner(st, mode, mma=mma, trace=True, **kw))
        rows.append(row)
        print(rows[-1], flush=True)
    # The links alone, and the prediction with the measured rate and link.
    st0 = ps.build(links_only(phases), sms, args.chunk, cfg.num_experts)
    predictions = [("prediction, design defaults", Hardware())]
    if measured:  # the kernel compiled
        r = ps.runner(st0, 1, **kw)
        link = {**base, "what": "links only (no bytes)", "check": check(r)}
        us = step_us(r, args.replays)
        link.update(us=round(us, 1), us_per_link=round(us / len(phases), 3))
        rows.append(link)
        print(rows[-1], flush=True)
        if "no waits" in measured:
            bw = st.read_bytes / (measured["no waits"] * 1e-6)
            hw = Hardware(bw=bw, link=link["us_per_link"] * 1e-6, work=0.0)
            predictions.append(("prediction, measured rate and link, no arithmetic", hw))
    for label, hw in predictions:
        p = predict_step(phases, hw)
        rows.append({**base, "what": label, "us": round(p["step_s"] * 1e6, 1),
                     "bw_GBps": round(hw.bw / 1e9, 1), "link_us": hw.link * 1e6,
                     "by_kind": p["by_kind"]})  # fmt: skip
        print(rows[-1], flush=True)
    del st, st0
    torch.cuda.empty_cache()
    return rows


def sass_loops(mma: int, chunk: int = 16384, warps: int = 8, stages: int = 12) -> list[dict]:
    """The consumer's MMA loop in SASS for sm_90a (compiled here, no GPU): each basic block
    holding an HMMA, with its instruction count, opcodes (suffixes dropped), predicated
    instructions and the instructions per 16-byte uint4 a lane (4 HMMAs each)."""
    opts = ps.options(chunk, stages=stages, warps=warps, mma=mma)
    cubin = cuda_rtc.compile_cubin(ps.SOURCE, "sm_90a", opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    targets = {int(a, 16) for a in re.findall(r"BRA(?:\.\S+)?\s+(?:\S+,\s*)?0x([0-9a-f]+)", text)}
    blocks, cur = [], []
    for a, t in ins:  # basic blocks: cut at branch targets and after branches
        if a in targets and cur:
            blocks.append(cur)
            cur = []
        cur.append(t.strip())
        if re.search(r"\b(BRA|EXIT|RET)\b", t):
            blocks.append(cur)
            cur = []
    out = []
    for b in blocks + [cur]:
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                  for t in b)  # fmt: skip
        if ops["HMMA"]:
            out.append({"instructions": len(b), "per_uint4": round(4 * len(b) / ops["HMMA"], 1),
                        "predicated": sum(t.startswith("@") for t in b),
                        "ops": dict(ops)})  # fmt: skip
    return out


def print_sass(args) -> None:
    """``--sass``: every MMA loop's blocks (the first, then the tighter ones)."""
    for mma in sorted(ps.MMA_LOOPS)[1:]:
        print(f"MMA={mma} ({ps.MMA_LOOPS[mma]}):")
        for b in sass_loops(mma, args.chunk, args.warps, args.stages):
            print("  ", b)


def main() -> None:
    from lily.bench.gpu.full_model import write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,131072", help="KV lengths, comma-separated")
    ap.add_argument("--chunk", type=int, default=16384, help="bytes a bulk copy (multiple of 16)")
    ap.add_argument("--stages", type=int, default=12, help="ring slots (stages x chunk <= 220 KB)")
    ap.add_argument("--warps", type=int, default=8, help="consumer warps a block (>= 1)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays a timing")
    ap.add_argument("--quick", action="store_true", help="the design's variants and no waits only")
    ap.add_argument("--out", help="JSON results path")
    ap.add_argument("--sass", action="store_true", help="print the MMA loops' SASS counts only")
    args = ap.parse_args()
    if args.stages * args.chunk > 220 * 1024 or args.chunk % 16 or args.warps < 1:
        ap.error("--stages x --chunk must fit 220 KB, --chunk a multiple of 16, --warps >= 1")
    if args.sass:
        return print_sass(args)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = full_config()
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        rows += context_rows(cfg, ctx, args, sms)
    write_json(args.out, args, results=rows)


if __name__ == "__main__":
    main()
