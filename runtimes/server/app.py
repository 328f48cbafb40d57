"""The OpenAI-compatible HTTP face of one engine (one replica). It serves one model and never routes.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE when `stream`), GET /v1/models,
GET /health, GET /ready, GET /metrics; POST /v1/embeddings answers 400 naming the endpoints that fit
(embedding models have their own app: runtimes/server/embedding_app.py).
Every error leaves in OpenAI's shape via foundation.http.errors.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import anyio
import jinja2
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from foundation.http.disconnect import CLIENT_CLOSED_REQUEST, until_disconnect
from foundation.http.errors import APIError
from foundation.http.wire import RESUMABLE_HEADER
from policies.classify import classify
from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.detokenizer import IncrementalDetokenizer
from runtimes.llm.sampling_params import SamplingParams
from runtimes.server.generation import Choice, Generation
from runtimes.server.intake import wrong_endpoint
from runtimes.server.metrics import ServerMetrics
from runtimes.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from runtimes.server.replica import ProbeFailed
from runtimes.server.replica_app import DEFAULT_MAX_BODY_BYTES, ReplicaEndpoints, assemble_app
from runtimes.server.responses import LogprobFormatter, ResponseMeta, chat_body, completion_body
from runtimes.server.streaming import (
    Event,
    ProgressResponse,
    SSEResponse,
    chat_events,
    completion_events,
    progress_lines,
    sse_stream,
)
from runtimes.server.tool_calls import ReplyReader, ToolRequest, reply_readers, template_inputs

SHUTDOWN_SETTLE_TIMEOUT_S = 5.0
log = structlog.get_logger(__name__)


class _Server(ReplicaEndpoints):
    """State shared by the endpoints of one app: the engine, names, metrics and readiness."""

    def __init__(self, engine: AsyncLLMEngine, served_name: str, aliases: Sequence[str],
                 clock: Callable[[], float], wall_clock: Callable[[], float], max_body_bytes: int,
                 probe_timeout_s: float, tool_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        metrics = ServerMetrics(engine.engine, served_name)
        super().__init__(engine, served_name, aliases, engine.engine.model_name, engine.engine.max_model_len,
                         metrics, clock, wall_clock, max_body_bytes, probe_timeout_s)
        self.engine = engine
        self.metrics: ServerMetrics = metrics  # narrowed: the LLM endpoints record TTFT, ITL, tokens
        self.logprobs = LogprobFormatter(engine.engine.tokenizer)
        self.lane_thresholds = engine.engine.config.lane_thresholds()
        self.vocab_size = engine.engine.model_config.vocab_size  # token ids in requests are checked against it
        self.tool_parser = tool_parser  # the registry's choice (chat.tool_parser); None: from the template
        self.reasoning_parser = reasoning_parser

    async def probe(self) -> None:
        """Generate one greedy token from a known-good prompt."""
        params = SamplingParams(temperature=0.0, max_tokens=1)
        outputs = [out async for out in self.engine.generate(f"probe-{uuid.uuid4().hex}",
                                                             self.engine.engine.probe_prompt(), params)]
        num_tokens = sum(len(out.new_token_ids) for out in outputs)
        if num_tokens != 1:
            raise ProbeFailed(f"expected 1 generated token, got {num_tokens}")

    async def settle(self, timeout_s: float = SHUTDOWN_SETTLE_TIMEOUT_S) -> None:
        """Keep this event loop open until the engine has let go of every request, aborted ones included.

        The engine thread hands outputs to the loop that submitted the request; one it still delivers to
        after the loop closed is dropped (AsyncLLMEngine._deliver then aborts the request), so wait here
        and let every request end normally while someone is still listening.
        """
        with anyio.move_on_after(timeout_s) as scope:
            while self.engine.engine.has_unfinished_requests():
                await asyncio.sleep(0.005)
        if scope.cancelled_caught:
            log.warning("engine still busy at shutdown", timeout_s=timeout_s)
        await asyncio.sleep(0.02)  # an abort's last output may be between the engine's bookkeeping and delivery

    # ------------------------------------------------------------------------------------------ generation

    async def completions(self, request: Request) -> Response:
        body = await self.parse_body(request, CompletionRequest)
        params = body.to_sampling_params(self.vocab_size)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = await anyio.to_thread.run_sync(self.engine.engine.tokenizer.encode, prompt)
        lane = self._lane(request, body.priority, prompt, params)
        gen = Generation(self.engine, f"cmpl-{uuid.uuid4().hex}", prompt, params, lane, self.metrics, self.clock,
                         body.resume_token_ids, self._resumed_text(body, params))
        logprobs = self.logprobs if params.logprobs is not None else None
        # a resumed stream's logprob offsets go on from the text its first part showed
        offset = sum(len(self.logprobs.token(t)) for t in body.resume_token_ids) if logprobs is not None else 0
        return await self._respond(
            request, gen, body,
            lambda meta: completion_events(gen, meta, body.include_usage, logprobs, offset),
            lambda meta, choices: completion_body(meta, choices, gen.num_prompt_tokens, logprobs))

    async def chat_completions(self, request: Request) -> Response:
        body = await self.parse_body(request, ChatCompletionRequest)
        params = body.to_sampling_params(self.vocab_size)
        tools = body.tool_request()
        readers = self._reply_readers(tools)
        prompt = await anyio.to_thread.run_sync(self._chat_prompt, body, tools)
        lane = self._lane(request, body.priority, prompt, params)
        gen = Generation(self.engine, f"chatcmpl-{uuid.uuid4().hex}", prompt, params, lane, self.metrics, self.clock,
                         body.resume_token_ids, self._resumed_text(body, params))
        logprobs = self.logprobs if params.logprobs is not None else None
        num_top = body.top_logprobs or 0
        resumed = body.multiserve_resume is not None
        # a resumed stream's readers first read, without sending it, what the first replica's stream showed
        seen = self._streamed_text(body, params) if readers is not None and body.stream else ""
        return await self._respond(
            request, gen, body,
            lambda meta: chat_events(gen, meta, body.include_usage, logprobs, num_top, resumed, readers, seen),
            lambda meta, choices: chat_body(meta, choices, gen.num_prompt_tokens, logprobs, num_top, readers))

    def _reply_readers(self, tools: ToolRequest | None) -> Callable[[], ReplyReader] | None:
        """What reads each choice's text into content, reasoning and tool calls; None: the text is the content."""
        return reply_readers(tools, self.engine.engine.tokenizer.chat_template, self.tool_parser,
                             self.reasoning_parser)

    def _resumed_text(self, body: SamplingFields, params: SamplingParams) -> str:
        """What a whole reply that another replica began starts with: the text of the tokens it had generated (a
        stream's client has that text already: "")."""
        if body.multiserve_resume is None or body.stream:
            return ""
        if params.logprobs is not None:  # the reply would lack the first replica's logprobs
            raise APIError(400, "a continued reply cannot have logprobs", param="multiserve_resume")
        return self._streamed_text(body, params)

    def _streamed_text(self, body: SamplingFields, params: SamplingParams) -> str:
        """The text of the tokens another replica generated, which a resumed stream's first part showed its client
        (nothing when the request is not a continuation)."""
        if body.multiserve_resume is None or not body.resume_token_ids:
            return ""
        _, text = IncrementalDetokenizer.resumed(self.engine.engine.tokenizer, body.resume_token_ids,
                                                 skip_special_tokens=params.skip_special_tokens, stop=params.stop)
        return text

    def _chat_prompt(self, body: ChatCompletionRequest, tools: ToolRequest | None) -> list[int]:
        """Render the chat template and tokenize (templates write their own BOS); tools and a history that called
        them as the template takes them (runtimes/server/tool_calls.py)."""
        tokenizer = self.engine.engine.tokenizer
        if not tokenizer.chat_template:
            raise APIError(400, f"model {self.served_name!r} has no chat template; use /v1/completions",
                           param="messages")
        messages, template_tools = template_inputs(body.template_messages(), tools, tokenizer.chat_template)
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                 tools=template_tools)
        except jinja2.TemplateError as exc:  # the template's raise_exception (e.g. roles must alternate)
            raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
        return tokenizer.encode(text, add_special_tokens=False)

    def _lane(self, request: Request, priority: int | None, prompt: list[int], params: SamplingParams) -> int:
        """The scheduling lane (policies/classify.py): the body's priority, X-Priority, else by length."""
        try:
            return classify(priority, request.headers.get("x-priority"), None, len(prompt), params.max_tokens,
                            self.lane_thresholds)
        except ValueError as err:
            raise APIError(400, str(err), param="priority") from err

    async def _respond(self, request: Request, gen: Generation, body: SamplingFields,
                       events: Callable[[ResponseMeta], AsyncGenerator[Event, None]],
                       whole: Callable[[ResponseMeta, list[Choice]], dict[str, Any]]) -> Response:
        """Submit `gen` and answer with the stream of its `events` once its first output is in, or with its `whole`
        body. A refused request raises here (400, 429); a client that leaves first (while it is queued, in prefill
        or, not streamed, at any point) gets 499 and its request is aborted, not run for nobody. A continuation
        (`multiserve_resume`) keeps the first stream's id and creation time. A gateway that may continue a whole reply
        elsewhere (RESUMABLE_HEADER) gets it as progress (`ProgressResponse`)."""
        resume, stream = body.multiserve_resume, body.stream

        async def started() -> ResponseMeta:
            await gen.start()
            if resume is not None and resume.id is not None and resume.created is not None:
                return ResponseMeta(resume.id, resume.created, body.model)
            return ResponseMeta(gen.request_id, int(self.wall_clock()), body.model)

        async def collected() -> dict[str, Any]:
            meta = await started()
            return whole(meta, await gen.collect())

        resumable = request.headers.get(RESUMABLE_HEADER) == "1"
        if stream or resumable:
            meta = await until_disconnect(request, started)
            if meta is not None and stream:
                return SSEResponse(sse_stream(events(meta), gen, resumable), gen.num_prompt_tokens, resumable)
            if meta is not None:  # a whole reply, preceded by the progress a gateway needs to continue it elsewhere
                return ProgressResponse(progress_lines(gen, lambda choices: whole(meta, choices)))
        else:
            reply = await until_disconnect(request, collected)
            if reply is not None:
                return JSONResponse(reply)
        await gen.aclose()
        return Response(status_code=CLIENT_CLOSED_REQUEST)

def build_app(
    engine: AsyncLLMEngine,
    served_name: str,
    aliases: Sequence[str] = (),
    clock: Callable[[], float] = time.monotonic,
    *,
    wall_clock: Callable[[], float] = time.time,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    probe_timeout_s: float = 300.0,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> Starlette:
    """The per-replica OpenAI-compatible app for `engine`, answering to `served_name` and `aliases`.

    `clock` times latencies (TTFT, ITL, end to end); `wall_clock` stamps `created`. The lifespan runs a
    1-token startup probe; /ready is 200 once it passed. `app.state.replica` (a Readiness) holds
    readiness; set its `draining` to refuse new requests with 503. `app.state.metrics` is the replica's
    ServerMetrics (its own prometheus registry); `app.state.engine` the engine, which the caller owns and
    shuts down. `tool_parser`, `reasoning_parser`: the registry's `chat:` choices for reading replies (None: found
    from the model's chat template).
    """
    server = _Server(engine, served_name, aliases, clock, wall_clock, max_body_bytes, probe_timeout_s, tool_parser,
                     reasoning_parser)
    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", wrong_endpoint(served_name, "a generative", "/v1/chat/completions or /v1/completions"),
              methods=["POST"]),
    ]
    return assemble_app(server, routes, engine)
