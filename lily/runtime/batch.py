"""Continuous batching: every running request advances by one token per step.

The batch holds the running sequences (lily/runtime/sequence.py) in arrival order. One
``step``:

1. decode: every decoding sequence by one token. A sequence decoding by itself takes the
   single-sequence path (lily/runtime/generate.py: the runner's graphs and device draws,
   one step ahead of the host), so one request alone runs exactly as it always did. With
   several, a lone one first leaves that mode (a draw in flight is emitted), then one
   batched step (``Runner.decode_rows``) consumes every pending token and each row draws:
   device draws in the step itself (the runner's rows sampler, in the batched graph, read
   back in one copy), host samplers row by row from the logits. When every row draws on
   the device the batch runs one step ahead of the host, as one sequence alone does: the
   step that consumes a step's draws is launched before the host reads them
   (``Runner.launch_rows_ahead``), while the rows stay the same; any change (a row ends,
   is cancelled or joins) first reads the draws in flight (``_drain``).
2. prefill: one chunk of the oldest sequence still prefilling, at most
   ``decode_prefill_chunk`` tokens while others decode (their streams wait for it; the
   server hands out the decode's tokens before the chunk is launched); its first token
   comes at the end of its last chunk.

A fault in one request's sampling or logits processor fails that request only; a fault in
a model step fails the requests it was computing, and a state left half-updated is
discarded. Which working state a request runs on, and what it reuses, is the engine's and
the prefix cache's choice (``Engine.take_state``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lily.runtime.device_sampling import check_token
from lily.runtime.generate import leave_alone, step_alone
from lily.runtime.prefix_cache import PrefixCache
from lily.runtime.sampling import SamplingParams
from lily.runtime.sequence import LogitsProcessor, Seq, StepOutput, Usage

Output = tuple[Seq, StepOutput | Exception]


class Batch:
    """The running requests of ``engine`` and the step that advances them (see above)."""

    def __init__(self, engine):
        self.engine = engine
        self.seqs: list[Seq] = []
        self._ids: torch.Tensor | None = None  # a first token's device draw beside others
        self.inflight: tuple | None = None  # (rows, Runner.launch_rows result) not read yet

    def __len__(self) -> int:
        return len(self.seqs)

    def states(self) -> list:
        """The working states of the running requests (those that have one yet)."""
        return [s.state for s in self.seqs if s.state is not None]

    def add(self, prompt: list[int], params: SamplingParams,
            cancelled: Callable[[], bool] = lambda: False,
            processor: LogitsProcessor | None = None, usage: Usage | None = None,
            tag: object = None) -> Seq:  # fmt: skip
        """Start a request (its prefill begins at the next step); raises ValueError or
        ContextLengthError for a request that cannot run."""
        e = self.engine
        params.validate()
        max_new = e.check_fits(len(prompt), params.max_tokens)
        device = (e.runner.device_decode is not None and processor is None
                  and params.logprobs is None)  # fmt: skip
        seq = Seq(prompt, params, max_new, e.tokenizer, e.cfg.vocab_size, e.model.device,
                  cancelled=cancelled, processor=processor, usage=usage, device_draws=device,
                  tag=tag)  # fmt: skip
        self.seqs.append(seq)
        return seq

    def abort(self, seq: Seq) -> None:
        """End ``seq`` now (its caller went away between steps)."""
        if seq in self.seqs:
            seq.cancel()
            self._release(seq)

    # ---- the step
    def step(self, deliver: Callable[[list[Output]], None] | None = None) -> list[Output]:
        """Advance every running request by one token, and one prefill by a chunk; the
        outputs (an exception for a request that failed) in order.

        With ``deliver``, the decode's outputs go to it before a prefill chunk is launched,
        and only the prefill's are returned: a chunk's launches hold the host (and the GIL)
        for 30-50 ms (bench/results/concurrency_gc_ab_h100_s14.json), and the running
        streams' tokens would wait for them."""
        outs: list[Output] = []
        with torch.inference_mode():
            decoding = [s for s in self.seqs if s.decoding]
            if self.inflight is not None:  # the last batched step's draws, not read yet
                rows, sent = self.inflight
                self.inflight = None
                stop = [not s.done and s.cancelled() for s in rows]
                if rows == decoding and self._can_go_ahead(rows, stop):
                    self._ahead(rows, sent, outs)
                    decoding = []
                else:
                    self._drain(rows, sent, stop, outs)
                    decoding = [s for s in self.seqs if s.decoding]
            if len(decoding) == 1:
                self._alone(decoding[0], outs)
            elif decoding:
                self._together(decoding, outs)
            waiting = [s for s in self.seqs if not s.decoding and not s.done]
            if waiting:
                if deliver is not None and outs:
                    deliver(outs)
                    outs = []
                self._prefill(waiting[0], outs)
        return outs

    def _alone(self, s: Seq, outs: list[Output]) -> None:
        try:
            self._emitted(s, step_alone(self.engine.runner, s), outs)
        except Exception as exc:  # noqa: BLE001 - the request fails, not the batch
            self._fail(s, exc, outs)

    def _together(self, seqs: list[Seq], outs: list[Output]) -> None:
        for s in seqs:
            if s.pipe is not None:
                try:
                    out = leave_alone(s)
                except Exception as exc:  # noqa: BLE001
                    self._fail(s, exc, outs)
                    continue
                if out is not None:
                    self._emitted(s, out, outs)
        rows = [s for s in seqs if not s.done]
        if len(rows) <= 1:
            if rows:
                self._alone(rows[0], outs)
            return
        runner = self.engine.runner
        tokens, states = [s.pending for s in rows], [s.state for s in rows]
        if all(s.device_draws for s in rows):
            # Pipelined: the step's draws are read at the next step, after the step that
            # consumes them is launched (``_ahead``), as one sequence alone does.
            loads = [((id(s), len(s.generated)), s.params, s.prompt, s.generated) for s in rows]
            try:
                sent = runner.launch_rows(tokens, states, loads)
            except Exception as exc:  # noqa: BLE001 - a model fault: the rows it computed fail
                for s in rows:
                    self._fail(s, exc, outs)
                return
            for s in rows:
                s.pending = None
                s.drawn_elsewhere()
            self.inflight = (rows, sent)
            return
        try:
            if any(s.device_draws for s in rows):
                # (a sequence drawn on the device is drawn in the step itself)
                loads = [((id(s), len(s.generated)), s.params, s.prompt, s.generated)
                         if s.device_draws else None for s in rows]  # fmt: skip
                logits, ids = runner.decode_rows_drawn(tokens, states, loads)
            else:
                logits, ids = runner.decode_rows(tokens, states), None
        except Exception as exc:  # noqa: BLE001 - a model fault: the rows it computed fail
            for s in rows:
                self._fail(s, exc, outs)
            return
        live = []
        for r, s in enumerate(rows):
            s.pending = None
            if s.device_draws:
                s.drawn_elsewhere()  # (its own sampler is behind now)
            if s.cancelled():
                self._emitted(s, s.cancel(), outs)
            else:
                live.append((r, s))
        self._draw(live, logits, ids, outs)

    def _draw(self, rows: list[tuple[int, Seq]], logits: torch.Tensor, ids: list[int] | None,
              outs: list[Output]) -> None:  # fmt: skip
        """Each row's token in row order: the step's device draw accepted, or drawn on
        the host from the row's logits."""
        for r, s in rows:
            try:
                out = s.accept(check_token(ids[r])) if s.device_draws else s.emit(logits[r])
            except Exception as exc:  # noqa: BLE001
                self._fail(s, exc, outs)
                continue
            self._emitted(s, out, outs)

    # ---- pipelined batched steps (every row drawn on the device)
    @staticmethod
    def _can_go_ahead(rows: list[Seq], stop: list[bool]) -> bool:
        """The next step of the same rows may be launched before their draws are read:
        none cancelled, none at its last allowed token (no step is launched past
        max_tokens)."""
        return not any(stop) and all(not s.done and len(s.generated) + 1 < s.max_new
                                     for s in rows)  # fmt: skip

    def _ahead(self, rows: list[Seq], sent, outs: list[Output]) -> None:
        """Launch the step that consumes the draws in flight, then read and emit them. A
        stop is seen one step late (the token is consumed, as alone)."""
        runner = self.engine.runner
        try:
            nxt = runner.launch_rows_ahead([s.state for s in rows])
        except Exception as exc:  # noqa: BLE001 - a model fault: the rows it computed fail
            for s in rows:
                self._fail(s, exc, outs)
            return
        ids = runner.recv_rows(sent)
        self.inflight = (rows, nxt)
        for r, s in enumerate(rows):
            try:
                tok = check_token(ids[r])  # (-1: the step behind it fed a placeholder)
            except Exception as exc:  # noqa: BLE001
                self._fail(s, exc, outs)
                continue
            runner.consumed(s.state, tok)
            out = s.accept(tok)
            s.pending = None
            self._emitted(s, out, outs)

    def _drain(self, rows: list[Seq], sent, stop: list[bool], outs: list[Output]) -> None:
        """Read the draws in flight and emit them, left pending (not consumed); a
        cancelled row's draw is dropped."""
        ids = self.engine.runner.recv_rows(sent)
        for r, s in enumerate(rows):
            if s.done:
                continue
            if stop[r]:
                self._emitted(s, s.cancel(), outs)
                continue
            try:
                out = s.accept(check_token(ids[r]))
            except Exception as exc:  # noqa: BLE001
                self._fail(s, exc, outs)
                continue
            self._emitted(s, out, outs)

    def _draw_buffer(self, n: int, device: torch.device) -> torch.Tensor:
        if self._ids is None or self._ids.shape[0] < n or self._ids.device != device:
            self._ids = torch.zeros(max(n, 8), dtype=torch.long, device=device)
        return self._ids[:n]

    def _prefill(self, s: Seq, outs: list[Output]) -> None:
        """One chunk of ``s``'s prompt; after the last, its first token."""
        e, prompt = self.engine, s.prompt
        busy = any(x.decoding and not x.done for x in self.seqs)
        try:
            if s.at is None:
                if s.max_new <= 0:
                    s.finish_reason = "length"
                    self._emitted(s, StepOutput(None, "", finish_reason="length"), outs)
                    return
                others = [x.state for x in self.seqs if x is not s and x.state is not None]
                s.state, start = e.take_state(prompt, others)
                s.usage.cached_tokens = start
                s.state.reserve(len(prompt) + 1)  # the whole prompt and the first decode step
                if e.engine_cfg.prefix_cache_gb > 0:
                    s.cuts = PrefixCache.snapshot_points(prompt, start, e.boundary_ids)
                s.at = start
            elif s.cancelled():  # between chunks
                self._emitted(s, s.cancel(), outs)
                return
            chunk = max(1, e.engine_cfg.prefill_chunk)
            if busy:
                chunk = min(chunk, max(1, e.engine_cfg.decode_prefill_chunk))
            end = min(s.at + chunk, len(prompt))
            logits = e.prefill_chunk(s.state, prompt, s.at, end, s.cuts)
            s.at = end
        except Exception as exc:  # noqa: BLE001
            self._fail(s, exc, outs)
            return
        if end < len(prompt):
            return
        s.decoding = True
        alone = not any(x is not s and not x.done for x in self.seqs)
        try:
            if alone:
                out = step_alone(e.runner, s, logits)
            elif s.cancelled():
                out = s.cancel()
            elif s.device_draws:
                buf = self._draw_buffer(1, logits.device)
                s.draw_into(logits, buf)
                out = s.accept(check_token(int(buf[0])))
            else:
                out = s.emit(logits)
        except Exception as exc:  # noqa: BLE001
            self._fail(s, exc, outs)
            return
        self._emitted(s, out, outs)

    # ---- endings
    def _emitted(self, s: Seq, out: StepOutput, outs: list[Output]) -> None:
        outs.append((s, out))
        if s.done:
            self._release(s)

    def _fail(self, s: Seq, exc: Exception, outs: list[Output]) -> None:
        s.finish_reason = "error"
        s.pending = None
        outs.append((s, exc))
        self._release(s)

    def _release(self, s: Seq) -> None:
        """``s`` has ended: out of the batch; its state stays as the conversation's live
        copy unless a fault left it half-updated."""
        s.pipe = None
        if s in self.seqs:
            self.seqs.remove(s)
        st = s.state
        if st is not None and (st.busy or len(st.tokens) != st.length):
            self.engine.discard(st)
