"""The GPU path: Triton kernels for every layer, decode steps replayed from CUDA graphs.

Same maths and state as the reference runner (lily/model); what changes is how it runs:
packed weights feed fused-dequant GEMV/GEMM kernels, routing stays on the GPU, and a
decode step is one graph replay. Graphs are captured per context bucket (powers of two)
so attention's grid fits the context and long contexts take the split-KV kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lily.config import ModelConfig
from lily.model.linear import embedding
from lily.model.norm import rms_norm
from lily.ops.attention_decode import attention_decode
from lily.ops.attention_prefill import attention_prefill
from lily.ops.deltanet_decode import DeltaNetDecodeWorkspace, deltanet_decode
from lily.ops.deltanet_prefill import deltanet_prefill
from lily.ops.norm_rope import rope_inv_freq
from lily.ops.qgemm import qgemm
from lily.ops.qgemv import qgemv
from lily.quant import QuantWeight, Weight
from lily.runtime.generate import Runner

# Rows at or below this run through the GEMV kernel (it handles up to 8 rows).
_GEMV_ROWS = 8
_MIN_BUCKET = 4096


def linear(x: torch.Tensor, w: Weight, residual: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """``residual + x @ w.T`` with the packed kernels (dense weights go to cuBLAS)."""
    if isinstance(w, QuantWeight):
        rows = 1 if x.dim() == 1 else x.shape[0]
        if rows <= _GEMV_ROWS:
            return qgemv(x, w, residual=residual, out_dtype=out_dtype)
        y = qgemm(x, w, out_dtype=out_dtype)
    else:
        y = F.linear(x, w.to(x.dtype))
        if out_dtype is not None:
            y = y.to(out_dtype)
    return y if residual is None else y + residual


def moe(p: dict, pre: str, h: torch.Tensor, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``x + moe(h)`` for h, x (T, D), with routing on the GPU."""
    args = (
        p[pre + "router"], p[pre + "gate_proj"], p[pre + "up_proj"], p[pre + "down_proj"],
        p[pre + "shared_gate_proj"], p[pre + "shared_up_proj"], p[pre + "shared_down_proj"],
        p[pre + "shared_expert_gate"],
    )  # fmt: skip
    if h.shape[0] == 1:
        from lily.ops.moe_decode import moe_decode

        return moe_decode(h[0], *args, top_k=cfg.num_experts_per_tok, residual=x[0])[None]
    from lily.ops.moe_prefill import moe_prefill

    return moe_prefill(h, *args, top_k=cfg.num_experts_per_tok, residual=x)


class GpuRunner(Runner):
    """Kernel forward over the model's parameters and the engine's session state."""

    def __init__(self, model, chunk: int, use_graphs: bool = True):
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.p = model.params
        self.chunk = max(1, chunk)
        self.dev = model.device
        cfg = self.cfg
        self.inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, self.dev)
        self.ws = DeltaNetDecodeWorkspace.new(
            cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
            self.dev,
        )  # fmt: skip
        self.use_graphs = use_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.tok = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=self.dev)

    # ---- one forward over T tokens (T = 1 is the decode step)
    def _forward(self, ids: torch.Tensor, state, start: int | torch.Tensor, max_len: int
                 ) -> torch.Tensor:  # fmt: skip
        cfg, p = self.cfg, self.p
        eps = cfg.rms_norm_eps
        t_len = ids.shape[0]
        x = embedding(ids, p["embed_tokens"], self.model.dtype)
        for i, kind in enumerate(cfg.layer_types):
            pre = f"layers.{i}."
            h = rms_norm(x, p[pre + "input_norm"], eps)
            if kind == "linear_attention":
                d, st = pre + "dn.", state.deltanet[i]
                qkv = linear(h, p[d + "in_proj_qkv"])
                z = linear(h, p[d + "in_proj_z"])
                b = linear(h, p[d + "in_proj_b"])
                a = linear(h, p[d + "in_proj_a"])
                args = (p[d + "conv1d"], st.conv, p[d + "A_log"], p[d + "dt_bias"],
                        p[d + "norm"], st.recurrent, eps)  # fmt: skip
                if t_len == 1:
                    o = deltanet_decode(qkv[0], z[0], b[0], a[0], *args, workspace=self.ws)[None]
                else:
                    o = deltanet_prefill(qkv, z, b, a, *args)
                x = linear(o, p[d + "out_proj"], residual=x)
            else:
                at, kv = pre + "attn.", state.kv[i]
                qg = linear(h, p[at + "q_proj"])
                k = linear(h, p[at + "k_proj"])
                v = linear(h, p[at + "v_proj"])
                norms = (p[at + "q_norm"], p[at + "k_norm"], kv.k, kv.v)
                if t_len == 1:
                    o = attention_decode(qg[0], k[0], v[0], *norms, start, self.inv_freq, eps,
                                         max_len=max_len)[None]  # fmt: skip
                else:
                    o = attention_prefill(qg, k, v, *norms, start, self.inv_freq, eps)
                x = linear(o, p[at + "o_proj"], residual=x)
            h = rms_norm(x, p[pre + "post_norm"], eps)
            x = moe(p, pre + "moe.", h, x, cfg)
        h = rms_norm(x[-1:], p["norm"], eps)
        return linear(h, p["lm_head"], out_dtype=torch.float32)[0]

    # ---- Runner
    def prefill(self, ids: list[int], state) -> torch.Tensor:
        logits = None
        with torch.inference_mode():
            for i in range(0, len(ids), self.chunk):
                part = ids[i : i + self.chunk]
                start = state.length
                for c in state.kv.values():
                    c.ensure(start + len(part))
                state.busy = True
                t = torch.tensor(part, dtype=torch.long, device=self.dev)
                logits = self._forward(t, state, start, start + len(part))
                state.length = start + len(part)
                state.tokens.extend(part)
                state.busy = False
        assert logits is not None, "prefill needs at least one token"
        return logits

    def decode(self, token_id: int, state) -> torch.Tensor:
        start = state.length
        for c in state.kv.values():
            c.ensure(start + 1)
        state.busy = True
        with torch.inference_mode():
            if not self.use_graphs:
                self.pos.fill_(start)
                t = torch.tensor([token_id], dtype=torch.long, device=self.dev)
                out = self._forward(t, state, self.pos, self._bucket(start, state))
            else:
                graph, static_out = self._graph(state, start)
                self.tok.fill_(token_id)
                self.pos.fill_(start)
                graph.replay()
                # NOTE: the graph writes the same buffer every step; hand out a copy so a
                # caller may keep logits across steps (1 MB, about a microsecond).
                out = static_out.clone()
        state.length = start + 1
        state.tokens.append(token_id)
        state.busy = False
        return out

    def _bucket(self, start: int, state) -> int:
        cap = min(c.capacity for c in state.kv.values()) if state.kv else start + 1
        b = _MIN_BUCKET
        while b < start + 1:
            b *= 2
        return min(b, cap)

    def _graph(self, state, start: int):
        """The captured step for this state's buffers and context bucket."""
        bucket = self._bucket(start, state)
        ptrs = tuple(c.k.data_ptr() for c in state.kv.values())
        ptrs += tuple(c.v.data_ptr() for c in state.kv.values())
        ptrs += tuple(s.recurrent.data_ptr() for s in state.deltanet.values())
        ptrs += tuple(s.conv.data_ptr() for s in state.deltanet.values())
        key = (bucket, ptrs)
        if key not in self.graphs:
            if len(self.graphs) > 16:  # buffers moved (new state): old graphs are dead
                self.graphs.clear()
            # Warm up outside the graph (compiles kernels, allocator pools) on scratch
            # copies, so the real state is untouched.
            snap = state.snapshot_recurrent()
            self.pos.fill_(start)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._forward(self.tok, state, self.pos, bucket)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._forward(self.tok, state, self.pos, bucket)
            state.restore(snap, state.length)
            self.graphs[key] = (graph, out)
        return self.graphs[key]
