"""The `ats` field in vLLM's streamed responses (`middleware.ATSMiddleware`): each server-sent event rewritten as it
comes, each choice decided on the chunk that finishes it, as `ats serve`'s stream places its decision.

vLLM streams a chat or completion as `data: {chunk}` events, one choice per chunk, the chunk that sets a choice's
`finish_reason` carrying its last tokens, then `data: [DONE]`; errors come as `data: {"error": ...}`, usage as a
chunk with no choices. Nothing is held back but a partial event.
"""

from __future__ import annotations

import json

from .abstain import answer_entries, finished_fields


class StreamDecisions:
    """The `ats` field of a stream's choices: each choice's logprobs entries gathered over its chunks, decided on the
    chunk that finishes it (`edit`, called with every chunk in order).

    Args:
        decider: the `AnswerDecider`.
        strip_logprobs: remove the logprobs from every chunk (the client did not ask for them).
        fields: the request's word on the certified format, added to each decision.
        monitor: counts each decision (`ats.serving.monitor.DecisionMonitor`), or None.
    """

    def __init__(self, decider, strip_logprobs: bool, fields: dict, monitor=None) -> None:
        self.decider, self.strip, self.fields, self.monitor = decider, strip_logprobs, fields, monitor
        self.tokens: dict[int, list] = {}

    def edit(self, chunk: dict) -> dict:
        """One chunk with its finished choices decided (and logprobs removed when nobody asked for them)."""
        for choice in chunk.get("choices") or []:
            tokens = self.tokens.setdefault(choice.get("index", 0), [])
            if choice.get("logprobs") is not None:
                tokens += answer_entries(choice["logprobs"])
            if choice.get("finish_reason") is not None:
                choice["ats"] = {**self.decider.decide_tokens(tokens, choice["finish_reason"]),
                                 **finished_fields(self.fields, choice["finish_reason"])}
                if self.monitor is not None:
                    self.monitor.record(choice["ats"])
            if self.strip:
                choice["logprobs"] = None
        return chunk


class StreamRewriter:
    """An ASGI `send` that rewrites each server-sent event of a 200 `text/event-stream` response whose data is a
    JSON object with `edit`, as the events come (a partial event waits for its end); anything else passes through."""

    def __init__(self, send, edit) -> None:
        self.send, self.edit = send, edit
        self.streaming = False
        self.buffer = b""

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            self.streaming = (message["status"] == 200
                              and headers.get(b"content-type", b"").startswith(b"text/event-stream"))
        elif message["type"] == "http.response.body" and self.streaming:
            *events, self.buffer = (self.buffer + message.get("body", b"")).split(b"\n\n")
            body = b"".join(self._event(e) + b"\n\n" for e in events)
            if not message.get("more_body", False) and self.buffer:  # a last event without its blank line
                body, self.buffer = body + self._event(self.buffer), b""
            await self.send({**message, "body": body})
            return
        await self.send(message)

    def _event(self, event: bytes) -> bytes:
        """One event with its JSON data edited (a `data: [DONE]`, an error or a comment as it comes)."""
        if not event.startswith(b"data: "):
            return event
        try:
            data = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(data, dict) or "choices" not in data:
            return event
        return b"data: " + json.dumps(self.edit(data)).encode()
