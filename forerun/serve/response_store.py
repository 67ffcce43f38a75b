"""The Responses API's stored responses, in this server's memory: a response asked with `store`
(OpenAI's default) is kept with the conversation that led to it, so a later request names it as
`previous_response_id` instead of sending the conversation again, and `GET /v1/responses/{id}`
reads it back (`DELETE` forgets it).

The store is bounded: at most MAX_RESPONSES responses and MAX_CHARS characters of them and their
conversations together (as JSON), the oldest forgotten first (a request naming a forgotten one gets
OpenAI's 400 `previous_response_not_found`, which says so). A response that failed is kept to be
read back, not continued; one whose client left mid-stream is not kept. Nothing is written to
disk: a restart forgets every response, as vLLM's in-memory store does. With replicas, the one
ingress keeps them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1024
MAX_CHARS = 64 << 20  # of the stored conversations' JSON


@dataclass
class Stored:
    response: dict  # the Responses object as it was answered
    messages: list[dict]  # chat's messages of the conversation, its answer last (instructions left out)
    chars: int


class ResponseStore:
    """Stored responses by id, oldest forgotten first past the bounds; safe across threads."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, response: dict, messages: list[dict]) -> None:
        """Keep `response` (ValueError, and nothing kept, where JSON cannot hold it: as its answer fails)."""
        text = json.dumps([response, messages], ensure_ascii=False, allow_nan=False)
        chars = len(text)
        with self._lock:
            self._drop(response["id"])
            self._kept[response["id"]] = Stored(response, messages, chars)
            self._chars += chars
            while len(self._kept) > self.max_responses or (self._chars > self.max_chars and len(self._kept) > 1):
                self._drop(next(iter(self._kept)))

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        stored = self._kept.pop(response_id, None)
        if stored is not None:
            self._chars -= stored.chars
        return stored is not None
