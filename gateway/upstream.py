"""The forwarder's one seam to its replicas: POST a body, get a reply whose body can be read whole or streamed.

`Upstream` is what `gateway.proxy.Forwarder` calls. Two implementations: `HttpxUpstream` (any URL, TLS, any
httpx transport — tests put an `httpx.MockTransport` of fake replicas behind it) and
`gateway.httpclient.KeepAliveClient` (plain http:// only; a few asyncio callbacks per request where httpx
spends most of the gateway's own time, see docs/benchmarks.md). `by_scheme` sends each URL to the one for it.

Both raise only `UpstreamError` (and its `UpstreamTimeout`) for a replica that cannot be reached, stalls or
breaks its reply, so the forwarder's failure accounting does not depend on which one is in use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import httpx

# The most a gateway holds of one reply, whichever way it comes (read whole, or a whole reply sent as progress).
MAX_REPLY_BYTES = 64 << 20


class UpstreamError(Exception):
    """The replica could not be reached, or its reply broke off or was not HTTP.

    `maybe_sent` says whether the replica may have received the request: False only where it cannot have (no
    connection was made), so that a caller that must not run a request twice knows when resending is safe.
    """

    def __init__(self, message: str, *, maybe_sent: bool = True) -> None:
        super().__init__(message)
        self.maybe_sent = maybe_sent


class UpstreamTimeout(UpstreamError):
    """Connecting, or waiting for the next bytes of the reply, took longer than allowed."""


@dataclass(frozen=True)
class Timeouts:
    connect_s: float
    read_s: float  # the longest wait for the reply's head or for any next piece of its body


class UpstreamReply(Protocol):
    """A reply whose head has arrived; its body is read with `aread` or `aiter_raw` (transfer-decoded bytes,
    as they come), and `aclose` releases it (a reply closed before its end aborts the request upstream)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...  # names in lower case

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    async def post(self, url: str, content: bytes, headers: Mapping[str, str], timeouts: Timeouts
                   ) -> UpstreamReply: ...

    async def aclose(self) -> None: ...


class HttpxUpstream:
    """`Upstream` over an `httpx.AsyncClient` (its own pool, transport and TLS)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, url: str, content: bytes, headers: Mapping[str, str], timeouts: Timeouts
                   ) -> UpstreamReply:
        timeout = httpx.Timeout(timeouts.read_s, connect=timeouts.connect_s)
        request = self.client.build_request("POST", url, content=content, headers=headers, timeout=timeout)
        try:
            return _HttpxReply(await self.client.send(request, stream=True))
        except httpx.HTTPError as err:
            raise _upstream_error(err) from err

    async def aclose(self) -> None:
        await self.client.aclose()


class _HttpxReply:
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status_code = response.status_code
        self.headers: Mapping[str, str] = response.headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.HTTPError as err:
            raise _upstream_error(err) from err

    async def aread(self) -> bytes:
        try:
            return await self.response.aread()
        except httpx.HTTPError as err:
            raise _upstream_error(err) from err

    async def aclose(self) -> None:
        await self.response.aclose()


def _upstream_error(err: httpx.HTTPError) -> UpstreamError:
    kind = UpstreamTimeout if isinstance(err, httpx.TimeoutException) else UpstreamError
    return kind(repr(err))


class ByScheme:
    """Plain http:// URLs to `plain`, every other one (https://) to `other`."""

    def __init__(self, plain: Upstream, other: Upstream) -> None:
        self.plain, self.other = plain, other

    async def post(self, url: str, content: bytes, headers: Mapping[str, str], timeouts: Timeouts
                   ) -> UpstreamReply:
        upstream = self.plain if url.startswith("http://") else self.other
        return await upstream.post(url, content, headers, timeouts)

    async def aclose(self) -> None:
        await self.plain.aclose()
        await self.other.aclose()
