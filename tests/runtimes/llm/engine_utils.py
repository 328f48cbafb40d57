"""Drive an LLMEngine synchronously in tests and collect per-sequence results."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from runtimes.llm.attention import select_attention
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: object = None
    num_cached_tokens: int = 0
    logprobs: list = field(default_factory=list)
    num_outputs: int = 0


def run_to_completion(
    engine: LLMEngine,
    requests: Mapping[str, tuple[str | Sequence[int], SamplingParams]],
    max_steps: int = 10_000,
) -> dict[str, Collected]:
    """Submit all requests, step until done; results keyed by request id (`id#i` for n > 1 samples).

    Requests submitted earlier to the same engine are driven to completion and collected too.
    """
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, Collected] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            n = requests[out.request_id][1].n if out.request_id in requests else 1
            key = out.request_id if n == 1 else f"{out.request_id}#{out.index}"
            got = results.setdefault(key, Collected())
            got.token_ids += out.new_token_ids
            got.text += out.text
            got.num_outputs += 1
            got.num_cached_tokens = out.num_cached_tokens
            if out.logprobs:
                got.logprobs += out.logprobs
            if out.finished:
                got.finish_reason, got.stop_reason = out.finish_reason, out.stop_reason
    else:
        raise AssertionError(f"engine did not finish within {max_steps} steps")
    return results


def assert_same_outputs(expected: Mapping[str, Collected], got: Mapping[str, Collected]) -> None:
    """Every request got the same tokens, text and finish reason."""
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key].token_ids == expected[key].token_ids, key
        assert got[key].text == expected[key].text, key
        assert got[key].finish_reason == expected[key].finish_reason, key


def assert_no_leak(engine: LLMEngine) -> None:
    """Nothing left running and every KV block back in the pool."""
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.kv.block_tables


def random_prompt(seed: int, length: int) -> list[int]:
    """`length` token ids of the tiny models' byte vocabulary (3..258), drawn from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(length)]


class ReplayingGraph:
    """A CUDA graph's contract on the CPU (runtimes/llm/cuda_graphs.py's `Graph`): `capture` keeps the function, closed
    over the static buffers and the host values the capture saw; `replay` reruns exactly that and refills the captured
    output in place."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def eager_and_graphed(loaded, **config: object) -> tuple[LLMEngine, LLMEngine]:
    """Two engines over `loaded` (its attention set to the CPU kernel's, which reads only device metadata): one
    stepping eagerly, one with decode graphs captured by `ReplayingGraph`."""
    loaded.model.set_attention(select_attention("auto", torch.device("cpu")))
    engine_config = EngineConfig(**config)  # type: ignore[arg-type]
    return LLMEngine(loaded, engine_config), LLMEngine(loaded, engine_config, new_graph=ReplayingGraph)


def record_launches(engine: LLMEngine) -> list[tuple[str, int]]:
    """(request id, input position) of every row of every step the engine launches ahead, from now on."""
    rows: list[tuple[str, int]] = []
    launch = engine.runner.launch

    def record(plan, *args, **kwargs):
        rows.extend((item.request.request_id, item.start) for item in plan.scheduled)
        return launch(plan, *args, **kwargs)

    engine.runner.launch = record  # type: ignore[method-assign]
    return rows


def same_tokens(expected_engine: LLMEngine, engine: LLMEngine,
                requests: Mapping[str, tuple[str | Sequence[int], SamplingParams]]) -> dict[str, Collected]:
    """Run `requests` to completion on both engines and assert that every request got the same tokens; returns the
    second engine's results."""
    expected = run_to_completion(expected_engine, requests)
    got = run_to_completion(engine, requests)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key].token_ids == expected[key].token_ids, key
    return got
