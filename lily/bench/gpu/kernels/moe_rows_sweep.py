"""The tile sweep of kernels.moe_rows (``--variants``): which moe_decode tiles to time
beside the batched step's table (lily/model/ops.py MOE_ROWS_CONFIGS), which the compile
matrix takes, the fastest launches of several lines put together, and the fastest line as
a table entry. Plain functions of configs and measured lines (dicts with ``time_us``,
``rel_err``, ``kernels_us`` and the line's ``tile``, MoeDecodeConfig's fields); not a
script.
"""

from __future__ import annotations

import dataclasses

from lily.bench.gpu.kernels.common import against_table, than_table
from lily.ops.moe_decode_config import MoeDecodeConfig

# The sweep (--variants): tensor-core tiles, and the first launch's fields one at a time.
SWEEP_ROWS, SWEEP_WARPS = (16, 32, 64), (4, 8, 16)
ROUTER_SWEEP = ({"router_rows": 2}, {"router_rows": 8}, {"router_rows": 16},
                {"shared_rows": 4}, {"shared_rows": 16}, {"num_warps": 8})  # fmt: skip
# route_once (the router launch routes each row once) on the table's tile, then with
# down_operand (gate/up writes the down launch's operand) on it and on these tensor-core
# tiles (rows, warps): both free registers, so wider tiles may fit; and down_early (the
# down launch's tiles loaded before its wait) switched on the table's tile
ROUTE_TILES = ((16, 4), (16, 8), (32, 4), (32, 8), (64, 8))
ERR_BOUND = 2e-2  # a tile counts within the kernel tests' bound (tests/ops/test_moe_rows_ops.py)
# kernels_us keys (kernel names) of moe_decode's three launches on the tensor-core path
PARTS = {"gate_up": "gate_up_mma", "down": "down_mma", "router": "router"}


def down_tile(cfg: MoeDecodeConfig) -> tuple[int, int]:
    """(rows, warps) of the down launch on the tensor cores."""
    return cfg.mma_down_rows or cfg.mma_rows, cfg.mma_down_warps or cfg.mma_warps


def canon(cfg: MoeDecodeConfig) -> MoeDecodeConfig:
    """``cfg`` with a down tile equal to gate/up's left unset (one name for one launch)."""
    if down_tile(cfg) == (cfg.mma_rows, cfg.mma_warps):
        return dataclasses.replace(cfg, mma_down_rows=None, mma_down_warps=None)
    return cfg


def fit(cfg: MoeDecodeConfig, table: MoeDecodeConfig, bad: list[str]) -> MoeDecodeConfig | None:
    """``cfg`` where the compile matrix takes it (``bad``: its problems, each led by its
    kernel's name); where it rejects one tensor-core launch alone, ``cfg`` with that launch
    back on the table's tile (the other launch's tile is still timed); else None."""
    gate_up = [p for p in bad if p.startswith("_moe_gate_up_mma_kernel")]
    down = [p for p in bad if p.startswith("_moe_down_mma_kernel")]
    if not bad:
        return cfg
    if len(gate_up) + len(down) < len(bad) or (gate_up and down):
        return None
    if down:
        rows, warps = down_tile(table)
    else:
        rows, warps = down_tile(cfg)
        cfg = dataclasses.replace(cfg, mma_rows=table.mma_rows, mma_warps=table.mma_warps)
    return canon(dataclasses.replace(cfg, mma_down_rows=rows, mma_down_warps=warps))


def sweep_tiles(base: MoeDecodeConfig) -> list[tuple[str, MoeDecodeConfig]]:
    """(sweep, tile) of the lines to time beside ``base`` (the table's tile), in order:
    the tensor-core tiles, then the first launch's fields one at a time."""
    mma = [("mma", canon(dataclasses.replace(base, mma_rows=r, mma_warps=w, mma_down_rows=None,
                                             mma_down_warps=None)))
           for r in SWEEP_ROWS for w in SWEEP_WARPS]  # fmt: skip
    router = [("router", dataclasses.replace(base, **f)) for f in ROUTER_SWEEP]
    once = dataclasses.replace(base, route_once=True)
    hop = dataclasses.replace(once, down_operand=True)
    early = dataclasses.replace(hop, down_early=not hop.down_early)
    route = [("route", once), ("route", hop), ("route", early)]
    route += [("route", canon(dataclasses.replace(hop, mma_rows=r, mma_warps=w,
                                                  mma_down_rows=None, mma_down_warps=None)))
              for r, w in ROUTE_TILES]  # fmt: skip
    out, seen = [], {canon(base)}
    for sweep, cfg in mma + router + route:
        if cfg not in seen:
            seen.add(cfg)
            out.append((sweep, cfg))
    return out


def kernel_us(line: dict, part: str) -> float | None:
    """Device time of the kernel whose name holds ``part`` in a line's ``kernels_us``."""
    times = line.get("kernels_us") or {}
    return next((v for k, v in times.items() if part in k and isinstance(v, float | int)), None)


def usable(line: dict) -> bool:
    """A timed line within ERR_BOUND that names its tile."""
    return "time_us" in line and line["rel_err"] < ERR_BOUND and "tile" in line


def combined(base: MoeDecodeConfig, lines: list[dict]) -> MoeDecodeConfig | None:
    """The fastest gate/up tile, down tile and first launch among ``lines`` (each by its
    own kernel's time) as one tile; None without those times. route_once goes with the
    gate/up tile (it moves work from gate/up into the first launch), so the first launch
    is the fastest of the lines that route as that one does."""
    fastest = {}
    for part, name in PARTS.items():
        if part == "router" and "gate_up" in fastest:
            once = fastest["gate_up"].route_once
            pool = [r for r in lines if r.get("tile", {}).get("route_once", False) == once]
        else:
            pool = lines
        timed = [(kernel_us(r, name), r) for r in pool if usable(r)]
        timed = [(t, r) for t, r in timed if t is not None]
        if not timed:
            return None
        fastest[part] = MoeDecodeConfig(**min(timed, key=lambda p: p[0])[1]["tile"])
    gu, rt = fastest["gate_up"], fastest["router"]
    rows, warps = down_tile(fastest["down"])
    return canon(dataclasses.replace(
        base, router_rows=rt.router_rows, shared_rows=rt.shared_rows, num_warps=rt.num_warps,
        mma_rows=gu.mma_rows, mma_warps=gu.mma_warps, mma_down_rows=rows, mma_down_warps=warps,
        route_once=gu.route_once, down_operand=gu.down_operand,
        down_early=base.down_early and gu.down_operand,
    ))  # fmt: skip


def table_entry(b: int, cfg: MoeDecodeConfig) -> str:
    """``cfg`` as an entry of lily/model/ops.py's MOE_ROWS_CONFIGS (fields off the defaults)."""
    default = MoeDecodeConfig()
    fields = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
              if getattr(cfg, f.name) != getattr(default, f.name)]  # fmt: skip
    return f"{b}: MoeDecodeConfig({', '.join(fields)}),"


def best_of(b: int, lines: list[dict]) -> dict | None:
    """The fastest usable line of B's ``moe_decode rows`` lines against the table's."""
    ok = [r for r in lines if usable(r)]
    if not ok:
        return None
    table = next((r for r in lines if r["config"] == "table, pdl" and "time_us" in r), None)
    top, vs = against_table(ok, "time_us", table)
    return {"B": b, "config": top["config"], "time_us": top["time_us"], "tile": top["tile"],
            "entry": table_entry(b, MoeDecodeConfig(**top["tile"])), **vs}  # fmt: skip


def best_line(r: dict) -> str:
    """One B's fastest tile against the table's, and its MOE_ROWS_CONFIGS entry."""
    return (f"best B={r['B']}: {r['config']}, {r['time_us']:.1f} us a layer{than_table(r)}; "
            f"{r['entry']}")  # fmt: skip
