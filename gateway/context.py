"""What the gateway learns about one request as it passes the middleware and the proxy, in one typed object.

The request id (RequestIdMiddleware), the caller's API key (AuthMiddleware), and the model and replica that served
it and the prompt length that replica counted (the proxy) travel here instead of as loose keys in the ASGI scope or
headers; the access log, the rate limits and the traffic log read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.auth_keys import ApiKey
from gateway.reply_tap import ReplyTap, Send

_SCOPE_KEY = "multiserve"  # under scope["state"], where Starlette keeps per-request state


@dataclass
class RequestContext:
    request_id: str = ""
    key: ApiKey | None = None  # the caller's API key; None when the gateway has no keys configured
    key_token: str | None = None  # that key's token: its rate-limit buckets (never logged)
    model: str | None = None  # the model the request was routed to (after aliases and tenant variants)
    replica: str | None = None  # the replica that served it last
    prompt_tokens: int | None = None  # its prompt's length as that replica counted it (told with a stream's head)
    # output tokens its replicas reported generating as they went (a non-streamed reply's progress, every attempt
    # and continuation): what a reply cut short (504, 499, broken) is charged, having no usage of its own
    generated_tokens: int = 0
    payload: dict[str, Any] | None = None  # its JSON body, once parsed (`request_body.request_payload`)
    lane: int | None = None  # the lane its API key allows it (gateway/lanes.py); None: the replica classifies it
    reply_tap: ReplyTap | None = None  # what reads its reply's token counts (`tap_reply`)
    cold_start_s: float | None = None  # how long it waited for its model to start on demand (None: it did not)

    @property
    def allowed_models(self) -> frozenset[str] | None:
        """The models the caller may use; None: all."""
        return None if self.key is None else self.key.models

    @property
    def key_priority(self) -> int | None:
        """The caller's default lane (policies/classify.py), unless the request names one."""
        return None if self.key is None else self.key.default_lane

    @property
    def tenant(self) -> str | None:
        return None if self.key is None else self.key.tenant

    def tap_reply(self, send: Send) -> tuple[ReplyTap, Send]:
        """The request's one reply tap, and the `send` to pass on. The first (outermost) middleware to ask makes it
        and wraps its `send`; an inner one gets the same tap and its `send` as it is (every message passes the
        wrapper)."""
        if self.reply_tap is None:
            self.reply_tap = ReplyTap()
            return self.reply_tap, self.reply_tap.wrap(send)
        return self.reply_tap, send

    def log_fields(self) -> dict[str, Any]:
        """What the access log adds about the request's route."""
        route = (("model", self.model), ("replica", self.replica))
        fields: dict[str, Any] = {name: value for name, value in route if value}
        if self.cold_start_s is not None:
            fields["cold_start_s"] = round(self.cold_start_s, 3)
        return fields


def request_context(scope: Any) -> RequestContext:
    """The request's context, made on first use (`scope` is an ASGI scope)."""
    state = scope.setdefault("state", {})
    context = state.get(_SCOPE_KEY)
    if context is None:
        context = state[_SCOPE_KEY] = RequestContext()
    return context
