"""``moe_decode``'s tiles and forms (lily/ops/moe_decode.py): rows and warps a program of
each launch, and the batched step's routing and loading forms, checked as they are made.
Plain Python, so tables and tools can name a config without the kernels."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeDecodeConfig:
    """Rows per program of each launch and warps per program (whole K per program).

    router_rows: router rows (E / router_rows programs, plus one for the shared gate);
    shared_rows: shared-expert gate/up rows (I_s / shared_rows programs, same launch);
    gate_up_rows: routed gate/up rows (k * I / gate_up_rows programs);
    down_rows: output rows of the down launch (D / down_rows programs);
    mma: routed gate/up and down on the tensor cores (qgemv_mma's tile) where the experts
    are 4-bit with 16-byte rows, with mma_rows rows a program (16, 32 or 64) on mma_warps
    warps (they split K), the down launch with mma_down_rows on mma_down_warps (None: the
    same; its grid is D / rows against gate/up's k * I / rows); else the FMA kernels.
    route_once (tensor-core path, bf16 x): the router launch's last router program of each
    row takes the row's top-k, and its shared-gate program (else that last program) writes
    x' as a prepared operand, so the gate/up programs read their expert and x' instead of
    each sorting the E logits and norming and permuting x (``moe_decode_parts.route_once``);
    the ticket it takes sits on the chain.
    down_operand (with route_once): the gate/up programs write h times its routing weight,
    rounded to bf16 (as moe_prefill stores it), as the down launch's operand in the codes'
    K order, so the down programs load it where each built it from fp32 h in three bf16
    terms.
    down_early (with down_operand): the down programs load their experts' tiles before
    their PDL wait. The router launch wrote the expert ids two launches back, so they are
    there once the gate/up launch lets down start, and down's first programs stream their
    weights in the gate/up launch's last wave instead of after it.
    """

    router_rows: int = 4
    shared_rows: int = 8
    gate_up_rows: int = 8
    down_rows: int = 8
    num_warps: int = 4
    down_warps: int = 4
    mma: bool = True
    mma_rows: int = 16
    mma_warps: int = 8
    mma_down_rows: int | None = None
    mma_down_warps: int | None = None
    route_once: bool = False
    down_operand: bool = False
    down_early: bool = False

    def __post_init__(self) -> None:
        for name in ("router_rows", "shared_rows", "gate_up_rows", "down_rows", "num_warps",
                     "down_warps", "mma_warps", "mma_down_warps"):  # fmt: skip
            v = getattr(self, name)
            if v is not None and (v < 1 or v & (v - 1)):
                raise ValueError(f"MoeDecodeConfig.{name} must be a power of two, got {v}")
        if self.router_rows < 2:
            raise ValueError("MoeDecodeConfig.router_rows must be >= 2")
        for name, v in (("mma_rows", self.mma_rows), ("mma_down_rows", self.mma_down_rows)):
            if v not in (16, 32, 64) and not (v is None and name == "mma_down_rows"):
                raise ValueError(f"MoeDecodeConfig.{name} must be 16, 32 or 64, got {v}")
        if self.down_operand and not self.route_once:
            raise ValueError("MoeDecodeConfig.down_operand needs route_once (the routing "
                             "weights before the gate/up launch)")  # fmt: skip
        if self.down_early and not self.down_operand:
            raise ValueError("MoeDecodeConfig.down_early needs down_operand (the expert ids "
                             "from the router launch, two launches before down)")  # fmt: skip
