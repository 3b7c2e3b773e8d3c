"""The full-size fidelity checks behind ``lily compare --context`` and ``--layerwise``.

Paths are models with ``lily.model.model.Model``'s interface over the same bytes: the fp32
reference (the judge), the bf16 reference, and on CUDA the kernels (bf16). Contexts of
4K-32K tokens are prefilled by the fp32 reference with the DeltaNet scanned by chunks
(fast_context.py: the same maths, seconds instead of minutes); the compared tokens always
run through each path's own code.

- ``layer_local``: from the judge's state after the context, a prefill chunk and decode
  steps with every layer fed the judge's input and state (layerwise.py);
- ``score``: teacher forcing over the positions after a context, each path end to end from
  its own state (errors compound), for ``compare.metrics``.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

from lily.bench.fast_context import fast_deltanet
from lily.bench.layerwise import LayerCheck
from lily.runtime.state import SessionState

CONTEXT_CHUNK = 4096  # prefill chunk of the contexts (the reference's attention blocks)


def upcast(params: dict, dtype: torch.dtype) -> dict:
    """The same weights with dense tensors in ``dtype`` (packed ones shared; A_log fp32)."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and not k.endswith("A_log") else v
            for k, v in params.items()}  # fmt: skip


def make_paths(cfg, params: dict, kernels: bool | None = None) -> tuple[object, dict]:
    """(judge, {name: model}) over ``params`` (dense tensors bf16): the fp32 reference
    judges the bf16 reference and, with ``kernels`` (None: on CUDA), the kernels."""
    from lily.model.model import Model

    dev = params["norm"].device
    judge = Model(cfg, upcast(params, torch.float32), torch.float32, kernels=False)
    paths = {"bf16_reference": Model(cfg, upcast(params, torch.bfloat16), torch.bfloat16,
                                     kernels=False)}  # fmt: skip
    if dev.type == "cuda" if kernels is None else kernels:
        paths["kernels"] = Model(cfg, upcast(params, torch.bfloat16), torch.bfloat16,
                                 kernels=True)  # fmt: skip
    return judge, paths


@torch.inference_mode()
def run_layers(model, state: SessionState, ids: list[int], logits: bool = False):
    """Consume ``ids`` at ``state.length`` through ``model.embed``, every ``model.layer``
    and (with ``logits``) ``model.head``: fp32 logits (T, V), else the last hidden (T, D)."""
    start = state.length
    if start + len(ids) > state.limit:
        raise ValueError(f"context of {start + len(ids)} tokens exceeds {state.limit}")
    x = model.embed(torch.tensor(ids, dtype=torch.long, device=model.device))
    for i in range(model.cfg.num_hidden_layers):
        x = model.layer(i, x, state, start)
    state.length = start + len(ids)
    state.tokens.extend(ids)
    return model.head(x) if logits else x


def prefill_context(model, state: SessionState, ids: list[int], fast: bool = True,
                    chunk: int = CONTEXT_CHUNK) -> None:  # fmt: skip
    """Consume ``ids`` (no logits), in chunks of ``chunk`` tokens; DeltaNet by chunks with
    ``fast``. The reference MoE dequantizes every expert once per chunk, so on a GPU a
    larger chunk is faster (memory grows with it)."""
    with fast_deltanet() if fast else contextlib.nullcontext():
        for i in range(0, len(ids), chunk):
            run_layers(model, state, ids[i : i + chunk])


def layer_local(judge, paths: dict, ids: list[int], context: int, chunk: int, steps: int,
                fast: bool = True) -> dict:  # fmt: skip
    """Per-layer errors of each path: a prefill chunk of ``chunk`` tokens after ``context``
    tokens, then ``steps`` decode steps (``ids`` holds context + chunk + steps tokens)."""
    need = context + chunk + steps
    if len(ids) < need:
        raise ValueError(f"need {need} token ids, got {len(ids)}")
    st = SessionState.new(judge.cfg, judge.device, torch.float32, need)
    t0 = time.perf_counter()
    prefill_context(judge, st, ids[:context], fast)
    t1 = time.perf_counter()
    check = LayerCheck(judge, paths, st)
    if chunk:
        check.run(ids[context : context + chunk], "prefill", logits=False)
    for s in range(steps):
        check.run([ids[context + chunk + s]], "decode", logits=False)
    rep = check.report()
    return {"context": context, "chunk": chunk, "decode_steps": steps,
            "context_s": t1 - t0, "check_s": time.perf_counter() - t1, **rep}  # fmt: skip


@torch.inference_mode()
def score_model(model, ids: list[int], start: int, fast: bool = True) -> torch.Tensor:
    """Teacher-forced fp32 logits (P, V) on the CPU for positions start..len(ids)-1 of a
    reference model: the context prefilled (DeltaNet by chunks with ``fast``), the scored
    positions as one forward through the model's own code."""
    st = SessionState.new(model.cfg, model.device, model.dtype, len(ids))
    prefill_context(model, st, ids[:start], fast)
    return run_layers(model, st, ids[start:], logits=True).float().cpu()


@torch.inference_mode()
def score_runner(engine, ids: list[int], start: int) -> torch.Tensor:
    """The same positions through an engine's runner (the kernel path as generation runs
    it): the context and position ``start`` prefilled, then one decode step per position."""
    runner, st = engine.runner, engine.new_state()
    out = [runner.prefill(list(ids[: start + 1]), st).float().cpu()]
    out += [runner.decode(int(t), st).float().cpu() for t in ids[start + 1 :]]
    return torch.stack(out)


def worst_layers(report: dict, n: int = 3) -> list[dict]:
    """The ``n`` layers with the largest ``rel_delta`` in a path's summary."""
    return sorted(report["layers"], key=lambda r: -r["rel_delta"])[:n]


def layer_table(out: dict) -> str:
    """Per context, phase, path and layer kind: the errors and the worst layer's."""
    rows = ["context  phase    path            kind       rel_out   rel_delta  max_delta"]
    for r in out["contexts"]:
        for phase in ("prefill", "decode"):
            for name, rep in r.get(phase, {}).items():
                for kind, k in rep["kinds"].items():
                    rows.append(f"{r['context']:>7}  {phase:<7}  {name:<14}  {kind:<9}  "
                                f"{k['rel_out']:.2e}  {k['rel_delta']:.2e}   "
                                f"{k['max_rel_delta']:.2e}")  # fmt: skip
    return "\n".join(rows)


# ---- `lily compare` plumbing: our engine, the reference, the layer-local run


def parse_contexts(text: str) -> list[int]:
    """``"0,4K,32K"`` -> [0, 4096, 32768] (K = 1024)."""
    from lily.bench.driver import parse_lengths

    return parse_lengths(str(text), "--context", least=0) or [0]


class Ours:
    """Our engine as ``lily compare`` scores it: the reference path by one forward over the
    positions, the kernel runner by prefill and teacher-forced decode steps."""

    def __init__(self, engine, name: str, fast: bool):
        self.engine, self.name, self.fast = engine, name, fast
        self.device = str(engine.model.device)

    def reference_runner(self) -> bool:
        return not self.engine.model.kernels

    def score(self, ids: list[int], start: int) -> torch.Tensor:
        if self.reference_runner():
            return score_model(self.engine.model, ids, start, self.fast)
        return score_runner(self.engine, ids, start)

    def info(self) -> dict:
        e = self.engine.engine_cfg
        return {"device": self.device, "dtype": e.dtype, "use_kernels": e.use_kernels,
                "runner": type(self.engine.runner).__name__, "prefill_chunk": e.prefill_chunk,
                "scored_by": "reference forward" if self.reference_runner()
                else "runner prefill + decode steps"}  # fmt: skip


def _params(args, ecfg, dtype: torch.dtype):
    """(cfg, canonical params, text config, name) of --random or --model."""
    from lily.bench.random_model import model_config, random_params, text_config
    from lily.config import ModelConfig

    if args.random and args.model:
        raise ValueError("give either --model or --random, not both")
    if args.random:
        from lily.bench.conditioned import DEFAULT

        cfg = model_config(args.random)
        recipe = None if args.init == "plain" else DEFAULT
        params = random_params(cfg, ecfg.device, seed=args.seed, recipe=recipe, dtype=dtype)
        return cfg, params, text_config(args.random), f"random {args.random} ({args.init})"
    from lily.runtime.engine import tiny_model_dir
    from lily.weights import load_params

    model = args.model or str(tiny_model_dir())
    cfg = ModelConfig.from_dir(model)
    params = load_params(model, cfg, device=ecfg.device, dtype=dtype, progress=False)
    return cfg, params, dict(cfg.raw.get("text_config", cfg.raw)), model


def load_ours(args) -> Ours:
    """Our engine over --random or --model, configured by the engine options."""
    from lily.bench.source import engine_from_params
    from lily.engine_args import engine_config
    from lily.runtime.engine import DTYPES, Engine

    ecfg = engine_config(args)
    if args.random:
        cfg, params, _, name = _params(args, ecfg, DTYPES[ecfg.dtype])
        return Ours(engine_from_params(cfg, params, ecfg, name=name), name, not args.token_loop)
    if not args.model:
        from lily.runtime.engine import tiny_model_dir

        args.model = str(tiny_model_dir())
        print(f"lily compare: no --model given: using the built-in tiny model {args.model}",
              file=sys.stderr)  # fmt: skip
    return Ours(Engine.load(args.model, ecfg, progress=False), args.model, not args.token_loop)


class _Scorer:
    """A reference: ``score(ids, start)`` and ``info()``."""

    def __init__(self, score, info: dict, keep=None):
        self.score, self._info, self._keep = score, info, keep

    def info(self) -> dict:
        return self._info


def load_reference(args, ours: Ours) -> _Scorer:
    """The --reference engine on the same bytes as ``ours``."""
    from lily.bench import peers
    from lily.model.model import Model

    eng = ours.engine
    if args.reference == "lily":
        dt = getattr(torch, args.reference_dtype or "float32")
        ref = Model(eng.cfg, upcast(eng.model.params(), dt), dt, kernels=False)
        return _Scorer(lambda ids, n: score_model(ref, ids, n, ours.fast),
                       {"path": "plain-PyTorch reference", "dtype": str(dt)[6:],
                        "device": ours.device})  # fmt: skip
    peers.check_available(args.reference, load=True)
    dtype = args.reference_dtype or eng.engine_cfg.dtype
    keep = None
    path = args.model
    if args.random:
        if args.reference != "mlx-lm":
            raise ValueError(
                f"--random works with --reference lily or mlx-lm, not {args.reference}"
            )
        path, keep = _write_random(args, eng)
    source = {"kind": "dir", "path": str(path), "dtype": dtype, "device": ours.device,
              "prefill_chunk": eng.engine_cfg.prefill_chunk}  # fmt: skip
    adapter = peers.load_adapter(args.reference, source)
    if args.reference == "mlx-lm":
        return _Scorer(adapter.score, adapter.info(), keep)
    return _Scorer(lambda ids, n: adapter.score(ids)[n:], adapter.info())


def _write_random(args, engine):
    """Our random weights as an MLX checkpoint (the very bytes), for MLX-LM."""
    import tempfile

    from lily.bench.random_model import save_mlx_checkpoint, text_config

    keep = None
    if args.disk_dir:
        out = args.disk_dir
    else:
        keep = tempfile.TemporaryDirectory(prefix="lily-compare-")
        out = keep.name
    params = upcast(engine.model.params(), torch.bfloat16)
    save_mlx_checkpoint(params, engine.cfg, text_config(args.random), out)
    return out, keep


def run_layerwise(args, contexts: list[int]) -> dict:
    """``lily compare --layerwise``: ``layer_local`` after each context."""
    from lily.bench.measure import env_info, pseudo_text_ids
    from lily.engine_args import engine_config

    if args.chunk < 0 or args.decode_steps < 0 or args.chunk + args.decode_steps < 1:
        raise ValueError("--chunk and --decode-steps must be >= 0, and not both 0")
    ecfg = engine_config(args)
    cfg, params, _, name = _params(args, ecfg, torch.bfloat16)
    judge, paths = make_paths(cfg, params, kernels=ecfg.use_kernels)
    n = max(contexts) + args.chunk + args.decode_steps
    if n > cfg.max_position_embeddings:
        raise ValueError(f"{n} tokens exceed the model's context of {cfg.max_position_embeddings}")
    ids = pseudo_text_ids(n, cfg.vocab_size, seed=args.seed)
    runs = [layer_local(judge, paths, ids, c, args.chunk, args.decode_steps, not args.token_loop)
            for c in contexts]  # fmt: skip
    return {"schema": "lily.compare.layerwise/1", "model": name,
            "judge": "fp32 reference", "paths": {k: {"dtype": str(m.dtype)[6:],
                                                     "kernels": bool(m.kernels)}
                                                 for k, m in paths.items()},
            "contexts": runs, "env": env_info(ecfg.device)}  # fmt: skip
