"""The persistent decode step's plan: its phases (bytes, dependencies), their split into
per-SM chunk lists, and the step time the design predicts (docs/notes/persistent_decode.md).

A decode step is a chain of dependent phases (a layer's input projections, its mixer, the
output projection, router and shared expert, the routed experts' gate/up, their down; then
lm_head and the draw). Every phase streams bytes that do not depend on the step (weights,
last step's recurrent state, the KV cache before this token: ``fixed_bytes``, requestable
at any time) and, for the MoE's expert phases, bytes whose addresses are known only once
the router phase is complete (``routed_bytes``: k experts' rows). A phase's arithmetic
needs the output of the phase before it (``after``).

Pure Python (no torch): the task list of the GPU kernel and the CPU tests share it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lily.config import ModelConfig

ALIGN = 16  # bytes: a bulk copy's size and addresses are multiples of 16
ACT_BYTES = 2  # bf16 KV cache and activations


@dataclass(frozen=True, slots=True)
class Phase:
    """One dependent stage of the step.

    ``fixed_bytes``: bytes read that the step does not change (requestable ahead);
    ``routed_bytes``: bytes of ``slots`` experts chosen by this step's router, ``per_slot``
    each, requestable once phase ``fetch_after`` is complete (-1: none);
    ``write_bytes``: bytes written besides the activation (recurrent state, KV row);
    ``after``: the phase whose output this one reads (-1: the step's input)."""

    name: str
    layer: int
    kind: str
    fixed_bytes: int
    after: int
    routed_bytes: int = 0
    slots: int = 0
    fetch_after: int = -1
    write_bytes: int = 0

    @property
    def per_slot(self) -> int:
        return self.routed_bytes // self.slots if self.slots else 0

    @property
    def read_bytes(self) -> int:
        return self.fixed_bytes + self.routed_bytes


def packed_bytes(n: int, k: int, bits: int = 4, group: int = 64) -> int:
    """Bytes of an (n, k) MLX-packed weight: the words and a bf16 scale and bias a group."""
    if k % group or (k * bits) % 32:
        raise ValueError(f"packed_bytes: K = {k} is not whole groups of {group} and words")
    return n * k * bits // 8 + n * (k // group) * 2 * 2


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _bits(cfg: ModelConfig, path: str) -> tuple[int, int]:
    q = cfg.quant_for(path)
    if q is None:
        raise ValueError(f"decode_phases: {path} is not quantized (the plan is for packed weights)")
    return q.bits, q.group_size


def decode_phases(cfg: ModelConfig, context: int) -> list[Phase]:
    """The phases of one decode step at ``context`` tokens of KV, in dependency order, with
    the model's exact byte counts (MLX packing as the config gives it), each region rounded
    up to whole ALIGN-byte copies."""
    if context < 1:
        raise ValueError(f"decode_phases: context must be >= 1, got {context}")
    d, e_inter, s_inter = (
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    )
    k = cfg.num_experts_per_tok
    phases: list[Phase] = []

    def add(ph: Phase) -> int:
        # Copies move whole 16-byte units: a region is padded to them (the full model's
        # regions are whole units already).
        per = _up(ph.per_slot)
        phases.append(dataclasses.replace(ph, fixed_bytes=_up(ph.fixed_bytes),
                                          routed_bytes=per * ph.slots))  # fmt: skip
        return len(phases) - 1

    last = -1
    for i in range(cfg.num_hidden_layers):
        pre = f"language_model.model.layers.{i}."
        if i in cfg.attn_layers:
            bits, g = _bits(cfg, pre + "self_attn.q_proj")
            rows = (
                cfg.num_attention_heads * cfg.head_dim * 2
                + 2 * cfg.num_key_value_heads * cfg.head_dim
            )
            kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * ACT_BYTES
            p_in = add(
                Phase(f"L{i}.qkv", i, "attn_in", packed_bytes(rows, d, bits, g) + 2 * d, last)
            )
            kv = context * kv_row + 4 * cfg.head_dim  # the cache and the q/k norm weights
            p_mix = add(Phase(f"L{i}.attention", i, "attention", kv, p_in, write_bytes=kv_row))
            o_in = cfg.num_attention_heads * cfg.head_dim
        else:
            bits, g = _bits(cfg, pre + "linear_attn.in_proj_qkv")
            hv = cfg.linear_num_value_heads
            rows = cfg.conv_dim + cfg.value_dim + 2 * hv
            state = hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
            conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * ACT_BYTES
            params = cfg.conv_dim * cfg.linear_conv_kernel_dim * ACT_BYTES + 8 * hv + 2 * 128
            p_in = add(
                Phase(f"L{i}.in_proj", i, "dn_in", packed_bytes(rows, d, bits, g) + 2 * d, last)
            )
            p_mix = add(Phase(f"L{i}.deltanet", i, "deltanet", state + conv + params, p_in,
                              write_bytes=state + conv))  # fmt: skip
            o_in = cfg.value_dim
        p_out = add(Phase(f"L{i}.out_proj", i, "out_proj", packed_bytes(d, o_in, bits, g), p_mix))
        rb, rg = _bits(cfg, pre + "mlp.gate")
        sb, sg = _bits(cfg, pre + "mlp.shared_expert_gate")
        eb, eg = _bits(cfg, pre + "mlp.switch_mlp.gate_proj")
        router = packed_bytes(cfg.num_experts, d, rb, rg) + packed_bytes(1, d, sb, sg)
        shared_gu = 2 * packed_bytes(s_inter, d, eb, eg)
        p_r = add(Phase(f"L{i}.router", i, "router", router + shared_gu + 2 * d, p_out))
        gu = 2 * packed_bytes(e_inter, d, eb, eg)
        p_gu = add(Phase(f"L{i}.experts_gate_up", i, "experts_gate_up", 0, p_r,
                         routed_bytes=k * gu, slots=k, fetch_after=p_r))  # fmt: skip
        down = packed_bytes(d, e_inter, eb, eg)
        last = add(Phase(f"L{i}.experts_down", i, "experts_down", packed_bytes(d, s_inter, eb, eg),
                         p_gu, routed_bytes=k * down, slots=k, fetch_after=p_r))  # fmt: skip
    hb, hg = _bits(cfg, "language_model.lm_head")
    p_h = add(
        Phase("lm_head", -1, "lm_head", packed_bytes(cfg.vocab_size, d, hb, hg) + 2 * d, last)
    )
    add(Phase("draw", -1, "draw", 0, p_h))
    return phases


@dataclass(frozen=True, slots=True)
class Chunk:
    """One bulk copy of a block: ``nbytes`` at ``offset`` of phase ``phase``'s fixed bytes,
    or (``slot`` >= 0) at ``offset`` of the expert chosen for that slot."""

    phase: int
    offset: int
    nbytes: int
    slot: int = -1


def _even_split(total: int, n: int) -> list[tuple[int, int]]:
    # n contiguous [start, end) slices of ALIGN-byte units, sizes differing by one unit.
    units = total // ALIGN
    if units * ALIGN != total:
        raise ValueError(f"split: {total} bytes is not a multiple of {ALIGN}")
    q, r = divmod(units, n)
    out, start = [], 0
    for b in range(n):
        end = start + (q + (b < r)) * ALIGN
        out.append((start, end))
        start = end
    return out


def _cut(phase: int, start: int, end: int, chunk: int, slot: int = -1) -> list[Chunk]:
    return [Chunk(phase, o, min(chunk, end - o), slot) for o in range(start, end, chunk)]


def split_chunks(phases: list[Phase], blocks: int, chunk: int) -> list[list[Chunk]]:
    """Per block (one an SM), its chunks in phase order: every phase's fixed bytes and its
    routed bytes (the slots' experts as one run of ``slots * per_slot`` bytes) cut into
    ``blocks`` even slices, each cut into copies of at most ``chunk`` bytes (a copy never
    spans two experts). Every byte of every phase is in exactly one chunk."""
    if blocks < 1 or chunk < ALIGN or chunk % ALIGN:
        raise ValueError(f"split_chunks: blocks {blocks} >= 1, chunk {chunk} a multiple of {ALIGN}")
    out: list[list[Chunk]] = [[] for _ in range(blocks)]
    for p, ph in enumerate(phases):
        for b, (s, e) in enumerate(_even_split(ph.fixed_bytes, blocks)):
            out[b] += _cut(p, s, e, chunk)
        if not ph.routed_bytes:
            continue
        per = ph.per_slot
        if per * ph.slots != ph.routed_bytes or per % ALIGN:
            raise ValueError(
                f"split_chunks: {ph.name}: routed bytes not {ph.slots} aligned experts"
            )
        for b, (s, e) in enumerate(_even_split(ph.routed_bytes, blocks)):
            while s < e:  # the slice, cut at expert boundaries
                j = s // per
                stop = min(e, (j + 1) * per)
                out[b] += _cut(p, s - j * per, stop - j * per, chunk, slot=j)
                s = stop
    return out


# ---------------------------------------------------------------- the predicted step time


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the prediction assumes of the GPU (H200 defaults: the measured copy rate, the
    ninth session's grid barrier; docs/notes/persistent_decode.md says where each is from).

    ``bw``: bytes/s a stream of bulk copies reaches; ``link``: seconds from a phase's last
    arrival to the waiters' release, the activation read included; ``latency``: a DRAM
    round trip (a routed copy is requested once its routing is known); ``buffer``: bytes
    of shared memory all SMs hold ahead (what may stream before it is consumed);
    ``work``: seconds of arithmetic per byte an SM consumes after its wait (the whole GPU's
    rate: per-SM seconds per byte / SMs); ``tail``: seconds after the arithmetic (store,
    release) before the arrival counts."""

    bw: float = 4.0e12
    link: float = 1.3e-6
    latency: float = 0.8e-6
    buffer: float = 132 * 192e3
    work: float = 0.1e-12
    tail: float = 0.2e-6


def predict_step(phases: list[Phase], hw: Hardware = Hardware()) -> dict:
    """The step time of the design, by a simple event model, in seconds.

    Memory is one FIFO of requests in phase order (fixed bytes, then routed bytes once
    their routing is known), each served at ``bw`` after it is issued. A phase's fixed
    bytes are issued once the bytes ahead of them that are not yet consumed fit in
    ``buffer`` (shared memory is the only place they wait); its routed bytes once
    ``fetch_after`` is done plus the link. A phase is done when its input is ready (its
    ``after`` phase done plus the link), its bytes have arrived, and its arithmetic on
    the bytes (``work``) and the tail have run; bytes beyond the buffer stream during the
    phase, overlapped with its arithmetic. Returns the step time and per-phase kinds'
    shares (time a phase adds to the chain, and how much of it is waiting on the link)."""
    done: list[float] = []
    stream_end = 0.0  # when the memory FIFO is free
    consumed: list[tuple[float, float]] = []  # (phase done, bytes issued up to its end)
    issued = 0.0
    by_kind: dict[str, dict[str, float]] = {}
    for ph in phases:
        ready = (done[ph.after] if ph.after >= 0 else 0.0) + hw.link
        # The first buffer-full of the fixed bytes waits for room: what was issued before
        # and is not yet consumed must fit beside it (a phase larger than the buffer
        # streams the rest while it is consumed).
        need = issued + min(ph.fixed_bytes, hw.buffer) - hw.buffer
        t_room = 0.0  # when the phases holding the bytes ahead of ``need`` are consumed
        if need > 0:
            t_room = next(t for t, upto in consumed if upto >= need)
        start = max(stream_end, t_room)
        stream_end = start + ph.fixed_bytes / hw.bw
        arrive = stream_end + hw.latency if ph.fixed_bytes else 0.0
        if ph.routed_bytes:
            r_start = max(stream_end, done[ph.fetch_after] + hw.link)
            stream_end = r_start + ph.routed_bytes / hw.bw
            arrive = max(arrive, stream_end + hw.latency)
        issued += ph.read_bytes
        work = ph.read_bytes * hw.work
        if ph.read_bytes > hw.buffer:  # streams under its own arithmetic
            begin = ready
            end = max(ready + work, arrive)
        else:
            begin = max(ready, arrive)
            end = begin + work
        end += hw.tail + ph.write_bytes / hw.bw
        prev = done[-1] if done else 0.0
        done.append(end)
        consumed.append((end, issued))
        k = by_kind.setdefault(ph.kind, {"n": 0, "added_us": 0.0, "wait_us": 0.0})
        k["n"] += 1
        k["added_us"] += (end - prev) * 1e6
        k["wait_us"] += max(0.0, begin - prev) * 1e6
    total = done[-1] if done else 0.0
    moved = sum(ph.read_bytes + ph.write_bytes for ph in phases)
    for k in by_kind.values():
        k["added_us"], k["wait_us"] = round(k["added_us"], 2), round(k["wait_us"], 2)
    return {"step_s": total, "bytes": moved, "stream_s": moved / hw.bw,
            "phases": len(phases), "by_kind": by_kind}  # fmt: skip
