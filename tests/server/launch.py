"""Run ``lily serve`` with test hooks around the real engine.

    python tests/server/launch.py [--step-delay S] [--prefill-delay S] [--fault-seed N]
                                  [--load-delay S] [--prefix-cache-mb MB] serve ...

``--step-delay`` sleeps after every step of the engine's batch (so cancellation and
queueing can be observed on a fast tiny model); ``--prefill-delay`` sleeps when a request
starts, like a long prefill (which, as in the engine, does not look at cancellation); a
request with ``seed == --fault-seed`` fails with an engine error after two tokens;
``--load-delay`` holds the model load so /health is seen loading; ``--prefix-cache-mb``
bounds the engine's prefix cache (the CLI has no flag for it), so memory can be measured
under load.
"""

import argparse
import dataclasses
import sys
import time

from lily.cli import build_parser
from lily.engine_args import engine_config, load_engine
from lily.server.serve_cli import run_server


class HookedBatch:
    """The engine's batch, slowed down per step and faulting on demand."""

    def __init__(self, batch, delay: float, prefill_delay: float, fault_seed: int | None):
        self._batch = batch
        self._delay = delay
        self._prefill_delay = prefill_delay
        self._fault_seed = fault_seed
        self._emitted: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self._batch, name)

    def __len__(self) -> int:
        return len(self._batch)

    def add(self, prompt, params, cancelled=lambda: False, processor=None, usage=None, tag=None):
        time.sleep(self._prefill_delay)
        return self._batch.add(prompt, params, cancelled, processor, usage, tag)

    def step(self, deliver=None):  # (every output returned, the injected faults applied)
        out, failed = [], set()
        for seq, step in self._batch.step():
            if id(seq) in failed:
                continue
            n = self._emitted.get(id(seq), 0)
            self._emitted[id(seq)] = n + 1
            if self._fault_seed is not None and seq.params.seed == self._fault_seed and n == 2:
                self._batch.abort(seq)
                failed.add(id(seq))
                step = RuntimeError("injected engine fault")
            if step is not None and (isinstance(step, Exception) or step.finish_reason):
                self._emitted.pop(id(seq), None)
            out.append((seq, step))
        time.sleep(self._delay)
        return out


class HookedEngine:
    """The real engine with its batch hooked (``HookedBatch``)."""

    def __init__(self, engine, delay: float, prefill_delay: float, fault_seed: int | None):
        self._engine = engine
        self.batch = HookedBatch(engine.batch, delay, prefill_delay, fault_seed)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def main() -> None:
    hooks = argparse.ArgumentParser(add_help=False)
    hooks.add_argument("--step-delay", type=float, default=0.0)
    hooks.add_argument("--prefill-delay", type=float, default=0.0)
    hooks.add_argument("--fault-seed", type=int, default=None)
    hooks.add_argument("--load-delay", type=float, default=0.0)
    hooks.add_argument("--prefix-cache-mb", type=float, default=None)
    h, rest = hooks.parse_known_args()
    args = build_parser().parse_args(rest)

    def load():
        time.sleep(h.load_delay)
        if h.prefix_cache_mb is None:
            engine = load_engine(args)
        else:
            from lily.runtime.engine import Engine

            gb = h.prefix_cache_mb / 1024
            ecfg = dataclasses.replace(engine_config(args), prefix_cache_gb=gb)
            engine = Engine.load(args.model, ecfg, progress=False)
        return HookedEngine(engine, h.step_delay, h.prefill_delay, h.fault_seed)

    sys.exit(run_server(args, load_engine=load))


if __name__ == "__main__":
    main()
