"""The MLX-LM peer (its CUDA build on the GPU, its CPU build here) on an MLX checkpoint.

It runs on the checkpoint directory itself (``mlx_lm.load``), so it reads the very 4-bit
bytes our engine reads; a random model is first written to disk by the parent
(``source["mlx_dir"]``). Prefill goes in chunks of ``prefill_chunk`` as mlx_lm's own
generate does, evaluating only the cache state between chunks.
"""

from __future__ import annotations

import importlib.metadata
import time

import numpy as np
import torch

from lily.bench.sweep import BenchAdapter


def _fp32(model) -> None:
    """Every float parameter to fp32 (exact for bf16 values); packed codes stay uint32."""
    import mlx.core as mx
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                          model.parameters()))  # fmt: skip


class MlxAdapter(BenchAdapter):
    name = "mlx-lm"

    def __init__(self, source: dict):
        import mlx.core as mx
        from mlx_lm import load

        path = source.get("mlx_dir") or source.get("path")
        if source["kind"] != "dir" and not source.get("mlx_dir"):
            raise ValueError("mlx-lm needs the model on disk (no mlx_dir was written)")
        self.mx = mx
        self.path = path
        self.model, _ = load(str(path))
        self.fp32 = source.get("dtype", "float32") == "float32"
        if self.fp32:
            _fp32(self.model)
        self.chunk = int(source.get("prefill_chunk", 2048))
        self.cache = None

    def _new_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)

    def _step(self, ids: list[int]):
        return self.model(self.mx.array(ids)[None], cache=self.cache)

    def prefill(self, ids: list[int]) -> int:
        mx = self.mx
        self._new_cache()
        for i in range(0, len(ids) - self.chunk, self.chunk):
            self._step(ids[i : i + self.chunk])
            mx.eval([c.state for c in self.cache])  # logits of these chunks are never built
        last = (len(ids) - 1) // self.chunk * self.chunk
        return int(mx.argmax(self._step(ids[last:])[0, -1]).item())

    def decode(self, token: int) -> int:
        return int(self.mx.argmax(self._step([token])[0, -1]).item())

    def fill_context(self, n_tokens: int) -> int:
        """The cache a prefill of ``n_tokens`` leaves, filled with small random values
        instead of computed ones: full-attention ``KVCache``s hold keys and values at that
        depth (allocated in ``step`` blocks, as ``update_and_fetch`` grows them) with
        ``offset`` set; the Gated DeltaNet ``ArraysCache``s hold a conv state and a
        recurrent state, whose shapes do not depend on the depth. Shapes and dtypes are
        those a one-token step on a fresh cache makes (the model's own layers)."""
        from mlx_lm.models.cache import ArraysCache, KVCache

        mx = self.mx
        self._new_cache()
        self._step([0])  # every entry made by its own layer: the shapes and dtypes to fill
        key = mx.random.key(n_tokens)

        def rand(shape, dtype):  # small: decode must stay finite whatever it reads
            nonlocal key
            key, k = mx.random.split(key)
            return (0.1 * mx.random.normal(shape, key=k)).astype(dtype)

        for c in self.cache:
            if type(c) is KVCache:
                (b, h, _, dk), dv = c.keys.shape, c.values.shape[3]
                depth = -(-n_tokens // c.step) * c.step  # so decode grows it as after a prefill
                c.keys = rand((b, h, depth, dk), c.keys.dtype)
                c.values = rand((b, h, depth, dv), c.values.dtype)
                c.offset = n_tokens
            elif type(c) is ArraysCache:
                c.cache = [a if a is None else rand(a.shape, a.dtype) for a in c.cache]
            else:
                raise NotImplementedError(f"fill_context: no fill for {type(c).__name__}")
            mx.eval(c.state)  # one layer's temporaries at a time
        return 0  # any valid id: the first decode input

    def _next(self, tok):
        """The greedy next token of the (1,) token array ``tok``, lazily (not evaluated)."""
        return self.mx.argmax(self.model(tok[None], cache=self.cache)[0, -1], keepdims=True)

    def decode_timed(self, token: int, n: int, deadline: float) -> tuple[int, float]:
        """mlx_lm's own generation loop (``generate_step``): the step for the next token
        is built and queued (``async_eval``) before the host waits for the current one.
        ``self.timed`` keeps the tokens the timed steps produced."""
        mx = self.mx
        y = self._next(mx.array([token]))
        mx.async_eval(y)
        nxt = self._next(y)
        mx.async_eval(nxt)
        y.item()  # untimed
        t1 = time.perf_counter()
        self.timed = []
        while len(self.timed) < n and (not self.timed or time.perf_counter() < deadline):
            y, nxt = nxt, self._next(nxt)
            mx.async_eval(nxt)
            self.timed.append(int(y.item()))
        dt = time.perf_counter() - t1
        mx.eval(nxt)  # the step queued ahead: the cache must not be left mid-update
        return len(self.timed), dt

    def score(self, ids: list[int], start: int = 0) -> torch.Tensor:
        """Teacher-forced fp32 logits of positions ``start``.. (the context before them is
        prefilled without building its logits)."""
        mx = self.mx
        self._new_cache()
        out = []
        for i in range(0, start, self.chunk):
            self._step(ids[i : min(i + self.chunk, start)])
            mx.eval([c.state for c in self.cache])
        for i in range(start, len(ids), self.chunk):
            logits = self._step(ids[i : i + self.chunk])[0].astype(mx.float32)
            out.append(torch.from_numpy(np.array(logits)))
        self.cache = None
        return torch.cat(out)

    def sync(self) -> None:
        self.mx.synchronize()

    def release(self) -> None:
        self.cache = None
        self.mx.clear_cache()

    def reset_peak(self) -> None:
        self.mx.reset_peak_memory()

    def peak_memory(self) -> int | None:
        return int(self.mx.get_peak_memory())

    def info(self) -> dict:
        versions = {}
        for pkg in ("mlx", "mlx-lm", "mlx-cuda", "mlx-cuda-13"):
            try:
                versions[pkg] = importlib.metadata.version(pkg)
            except importlib.metadata.PackageNotFoundError:
                pass
        return {
            "device": str(self.mx.default_device()),
            "dtype": "float32" if self.fp32 else "native (bf16)",
            "weights": f"mlx_lm.load({self.path})",
            **versions,
        }
