"""The engine: a loaded model, its tokenizer, its working states and prefix cache, and
generation: one request (``generate``) or several at once (``batch``, lily/runtime/batch.py).

Working states: one per request running at the same time, kept after the request ends as
its conversation's live copy (the prefix cache chooses which one a new request takes); a
new one is made only when every one is running.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from lily.config import EngineConfig, ModelConfig
from lily.model.model import Model
from lily.ops.arch import force_arch
from lily.runtime.batch import Batch
from lily.runtime.generate import LogitsProcessor, StepOutput, Usage
from lily.runtime.memory_plan import engine_plan
from lily.runtime.prefix_cache import PrefixCache
from lily.runtime.runner import Runner
from lily.runtime.sampling import SamplingParams
from lily.runtime.state import SessionState
from lily.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PrefillCancelled(Exception):
    """The request was cancelled between prefill chunks."""


class ContextLengthError(ValueError):
    """A prompt (plus the tokens asked for) does not fit in the context window."""


class Engine:
    """Owns the weights, the forward path and the session state of the current request."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        tokenizer: Tokenizer,
        engine_cfg: EngineConfig,
        model_name: str = "lily",
    ):
        self.cfg = cfg
        self.engine_cfg = engine_cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.dtype = DTYPES[engine_cfg.dtype]
        if engine_cfg.use_kernels and not str(engine_cfg.device).startswith("cuda"):
            raise ValueError("the kernel path (use_kernels) needs a CUDA device")
        if engine_cfg.gpu_arch is not None:
            # another GPU's kernel tables and switches, before any kernel compiles (a
            # process-wide choice, like the device; see lily/ops/arch.py)
            force_arch(engine_cfg.gpu_arch)
        self.model = Model(cfg, params, self.dtype, kernels=engine_cfg.use_kernels)
        self.generation_defaults: dict = dict(tokenizer.generation_config or {})
        self.runner = Runner(self.model, engine_cfg.prefill_chunk)
        # The context window, from the free memory when engine_cfg.max_context is None
        # (lily/runtime/memory_plan.py); the weights counted as loaded and fused.
        self.memory_plan = engine_plan(
            cfg, engine_cfg, self.dtype, self.model.weights.params(), self.runner.use_graphs
        )
        self.max_context = self.memory_plan.max_context
        self.last_usage = Usage()
        self.pool: list[SessionState] = [self.new_state()]  # the working states
        self.batch = Batch(self)
        self.prefix_cache = PrefixCache(
            int(engine_cfg.prefix_cache_gb * 2**30),
            int(engine_cfg.prefix_cache_host_gb * 2**30),
            engine_cfg.device,
        )
        ids = (tokenizer.im_start_id,)
        self.boundary_ids = {i for i in ids if i is not None}

    # ---- construction
    @classmethod
    def load(
        cls, model_dir: str | Path, engine_cfg: EngineConfig | None = None, progress: bool = True
    ) -> Engine:
        from lily.weights import load_params

        engine_cfg = engine_cfg or EngineConfig()
        model_dir = Path(model_dir)
        cfg = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        params = load_params(
            model_dir,
            cfg,
            device=engine_cfg.device,
            dtype=DTYPES[engine_cfg.dtype],
            load_mtp=engine_cfg.load_mtp,
            quantize_on_load=4 if engine_cfg.quantize_on_load else None,
            progress=progress,
        )
        return cls(cfg, params, tokenizer, engine_cfg, model_name=model_dir.name)

    @classmethod
    def tiny(cls, engine_cfg: EngineConfig | None = None, root: str | Path | None = None) -> Engine:
        """The built-in tiny random model (written once to a cache folder)."""
        return cls.load(tiny_model_dir(root), engine_cfg, progress=False)

    # ---- requests
    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        return self.tokenizer.render_chat(messages, **kwargs)[1]

    def new_state(self) -> SessionState:
        return SessionState.new(self.cfg, self.engine_cfg.device, self.dtype, self.max_context)

    def check_fits(self, n_prompt: int, max_tokens: int | None) -> int:
        """Tokens that may be generated; raises ContextLengthError when the prompt is too long."""
        want = n_prompt + (max_tokens or 0)
        if n_prompt == 0:
            raise ValueError("the prompt is empty")
        if n_prompt >= self.max_context or want > self.max_context:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_context} tokens. However, "
                f"you requested {want} tokens ({n_prompt} in the messages, "
                f"{max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        return max_tokens if max_tokens is not None else self.max_context - n_prompt

    @property
    def state(self) -> SessionState:
        """The first working state (the one a lone request runs on)."""
        if not self.pool:
            self.pool.append(self.new_state())
        return self.pool[0]

    @state.setter
    def state(self, st: SessionState) -> None:
        if self.pool:
            self.discard(self.pool[0])
        self.pool.insert(0, st)

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        cancelled: Callable[[], bool] = lambda: False,
        logits_processor: LogitsProcessor | None = None,
    ) -> Iterator[StepOutput]:
        """Stream the continuation of ``prompt_ids``, the request running alone on the
        batch (lily/runtime/batch.py); see docs/CONTRACTS.md."""
        params.validate()
        max_new = self.check_fits(len(prompt_ids), params.max_tokens)
        usage = self.last_usage = Usage(prompt_tokens=len(prompt_ids))
        if max_new <= 0:
            yield StepOutput(None, "", finish_reason="length")
            return
        if len(self.batch):
            raise RuntimeError("generate runs one request alone; the batch is in use")
        seq = self.batch.add(list(prompt_ids), params, cancelled, logits_processor, usage)
        try:
            while not seq.done:
                for _, out in self.batch.step():
                    if isinstance(out, BaseException):
                        raise out
                    yield out
        finally:
            # An abandoned generator (or a fault) ends the request; a state a step left
            # half-updated is forgotten rather than resumed from later.
            self.batch.abort(seq)

    # ---- working states
    def take_state(self, prompt: list[int],
                   running: list[SessionState]) -> tuple[SessionState, int]:  # fmt: skip
        """A working state for ``prompt`` (not one of the ``running`` ones) at the best point
        the prefix cache has for it; the tokens reused."""
        idle = [st for st in self.pool if not any(st is r for r in running)]
        if not idle:
            idle = [self.new_state()]
            self.pool.append(idle[0])
        if self.engine_cfg.prefix_cache_gb > 0:
            return self.prefix_cache.take(prompt, idle, running)
        fresh = self.new_state()  # no reuse: each request from an empty state
        self.pool[self.pool.index(idle[0])] = fresh
        return fresh, 0

    def discard(self, state: SessionState) -> None:
        """Forget a working state (a fault may have left it half-updated)."""
        self.prefix_cache.forget(state)
        self.pool = [st for st in self.pool if st is not state]

    def prefill_chunk(self, state: SessionState, prompt: list[int], pos: int, end: int,
                      cuts: list[int]) -> torch.Tensor:  # fmt: skip
        """Prefill ``prompt[pos:end]`` into ``state`` (at ``pos``), saving the DeltaNet
        states at the ``cuts`` inside it (or on its end) to the prefix cache; the logits of
        its last token."""
        inner = [c for c in cuts if pos < c < end]
        logits, snaps = self.runner.prefill_snapshots(prompt[pos:end], state, inner)
        if end in cuts:  # a turn start right on a chunk boundary
            snaps[end] = state.snapshot_recurrent()
        for p, snap in sorted(snaps.items()):
            self.prefix_cache.save(p, snap, state)
        return logits

    @torch.inference_mode()
    def prefill(
        self,
        prompt: list[int],
        usage: Usage | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> torch.Tensor:
        """Bring a working state to the end of ``prompt``, reusing what it can (the state a
        lone request would take: ``state`` when no request runs).

        Returns the logits of the last prompt token. A snapshot is saved before the last
        turn start in the newly prefilled part, so the next request can resume there. Between
        chunks ``cancelled`` is checked (PrefillCancelled), so a client that leaves during
        a long prompt frees the engine within one chunk.
        """
        state, start = self.take_state(prompt, self.batch.states())
        if usage is not None:
            usage.cached_tokens = start
        state.reserve(len(prompt) + 1)  # the whole prompt and the first decode step
        reuse = self.engine_cfg.prefix_cache_gb > 0
        cuts = PrefixCache.snapshot_points(prompt, start, self.boundary_ids) if reuse else []
        chunk = max(1, self.engine_cfg.prefill_chunk)
        pos, logits = start, None
        while pos < len(prompt):
            if logits is not None and cancelled():
                raise PrefillCancelled
            end = min(pos + chunk, len(prompt))
            logits = self.prefill_chunk(state, prompt, pos, end, cuts)
            pos = end
        return logits

    def states_nbytes(self) -> int:
        """Bytes the working states hold."""
        return sum(st.nbytes() for st in self.pool)

    def idle(self) -> list[SessionState]:
        """The working states no running request holds."""
        running = self.batch.states()
        return [st for st in self.pool if not any(st is r for r in running)]

    def idle_nbytes(self) -> int:
        return sum(st.nbytes() for st in self.idle())

    def largest_idle_nbytes(self) -> int:
        return max((st.nbytes() for st in self.idle()), default=0)

    def drop_idle(self, keep: int = 0) -> None:
        """Give back the memory of idle working states but the ``keep`` most recently used:
        their conversations go to the prefix cache (within its budget), the states go."""
        cache = self.prefix_cache
        idle = sorted(self.idle(), key=lambda st: cache.lives[id(st)][1].stamp
                      if id(st) in cache.lives else 0)  # fmt: skip
        for st in idle[: max(0, len(idle) - keep)]:
            cache.release(st)
            self.discard(st)
        if str(self.engine_cfg.device).startswith("cuda"):
            torch.cuda.empty_cache()

    def reset(self) -> None:
        """Drop the idle working states and every saved one."""
        running = self.batch.states()
        self.pool = [st for st in self.pool if any(st is r for r in running)]
        cache = self.prefix_cache
        self.prefix_cache = PrefixCache(cache.budget, cache.host_budget, self.engine_cfg.device)
        for st in running:  # their conversations go on
            if id(st) in cache.lives:
                self.prefix_cache.lives[id(st)] = cache.lives[id(st)]

    def score(self, ids: list[int]) -> torch.Tensor:
        """Teacher-forced fp32 logits (T, V) on the CPU for every position, prefilled in
        chunks on a fresh state by the runner (the generation path: kernels on a GPU)."""
        return self.runner.score(ids, self.new_state())


def tiny_model_dir(root: str | Path | None = None) -> Path:
    """Where the built-in tiny model lives (under ``root``, default ~/.cache/lily)."""
    from lily.checkpoint import TINY_TEXT_CONFIG, write_random_checkpoint

    root = Path(root) if root is not None else Path.home() / ".cache" / "lily"
    d = root / "tiny-mlx4"
    marker = d / ".complete"
    if not marker.exists():
        d.mkdir(parents=True, exist_ok=True)
        write_random_checkpoint(d, TINY_TEXT_CONFIG, "mlx4", seed=0)
        marker.write_text(json.dumps({"layout": "mlx4"}))
    return d
