"""Stored Responses (``store: true``), kept in memory within a count and a byte bound.

A stored response is what ``GET /v1/responses/{id}`` returns, and the conversation behind it
(chat messages: the earlier turns, its input, its output) that ``previous_response_id``
continues. A continued conversation is rendered again in full, so its prompt extends the
earlier one and the engine's prefix cache resumes from the earlier turn's saved state.
Least recently used out first; nothing survives a restart.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class Stored:
    """One stored response and the conversation it ends (instructions not included: they
    do not carry over to a continuation, as in OpenAI's API)."""

    response: dict[str, Any]
    messages: tuple[dict[str, Any], ...]
    nbytes: int


class ResponseStore:
    """LRU map from response id to ``Stored``, bounded by count and by JSON size."""

    def __init__(self, max_items: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Keep ``response`` (by its id) with its conversation; evict the oldest past a bound.

        One response larger than the whole byte bound is not kept."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(
            json.dumps(messages, ensure_ascii=False)
        )
        with self._lock:
            self._drop(response["id"])
            if size > self.max_bytes:
                return
            self._items[response["id"]] = Stored(response, tuple(messages), size)
            self._bytes += size
            while len(self._items) > self.max_items or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def get(self, response_id: str) -> Stored | None:
        """The stored response (now the most recently used), or None."""
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        # NOTE: called with the lock held.
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self._bytes -= item.nbytes
        return True
