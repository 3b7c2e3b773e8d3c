"""A conversation bigger than the prefix cache's device budget is copied out only as far as
the budget holds (never whole, only for eviction to drop it: that held a second KV cache on
the device for a moment), and still resumes correctly from what was kept."""

from __future__ import annotations

import torch

from lily.config import EngineConfig
from lily.runtime.engine import Engine
from lily.runtime.memory_plan import kv_bytes_per_token, state_bytes
from lily.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _tokens(engine: Engine, ids: list[int]) -> tuple[list[int], int]:
    steps = list(engine.generate(ids, GREEDY))
    return [s.token_id for s in steps if s.token_id is not None], engine.last_usage.cached_tokens


def test_oversized_conversation_is_kept_up_to_its_system_prompt(hf_tiny_dir):
    ecfg = EngineConfig(prefill_chunk=64, max_context=4096, prefix_cache_gb=0)
    cold = Engine.load(hf_tiny_dir, ecfg, progress=False)
    system = {"role": "system", "content": "You answer briefly. " * 12}
    a = [system, {"role": "user", "content": "tell me about rivers " * 60}]
    b = [{"role": "user", "content": "something else entirely"}]
    ids_a = cold.encode_chat(a)
    sys_end = ids_a.index(cold.tokenizer.im_start_id, 1)  # the snapshot at the system's end
    per_pos = kv_bytes_per_token(cold.cfg, torch.float32)
    states = state_bytes(cold.cfg, torch.float32)
    n_b = len(cold.encode_chat(b)) + GREEDY.max_tokens
    # Room for the system prompt's copy and conversation B (its states and two snapshots),
    # far from the whole of conversation A.
    budget = per_pos * (sys_end + n_b) + 4 * states + 4096
    assert per_pos * len(ids_a) > 2 * budget
    warm = Engine.load(hf_tiny_dir, EngineConfig(prefill_chunk=64, max_context=4096,
                                                 prefix_cache_gb=budget / 2**30),
                       progress=False)  # fmt: skip
    with torch.inference_mode():
        _tokens(warm, ids_a)
        _tokens(warm, warm.encode_chat(b))  # conversation A is stored as far as it fits
        stored = warm.prefix_cache.stored
        assert [len(e.tokens) for e in stored] == [sys_end]
        assert stored[0].nbytes() <= budget
        a2 = a + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        ids = warm.encode_chat(a2)
        got, cached = _tokens(warm, ids)
        want, _ = _tokens(cold, ids)
    assert cached == sys_end  # resumed from the kept part (it was dropped whole before)
    assert got == want
