"""Priority lanes end to end: `multiserve serve` with two copies of one tiny model, one scheduled `fcfs` and one
`multilevel`, driven through the official openai client, measured in one run.

Under a saturating background of long low-priority requests, an interactive request's time to first token
stays close to its idle TTFT with `multilevel` and blows up with `fcfs`. A burst beyond the queue limit gets
429s with Retry-After; every accepted request finishes in full; every KV block is free afterwards.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_pool.launcher import free_port
from tests.e2e.conftest import Gateway, replica_get, running_gateway
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

MODEL = """\
  - name: lanes-{scheduling}
    type: completion
    source: {{path: {model}}}
    device: cpu
    engine: {{block_size: 16, kv_cache_gib: 0.02, max_model_len: 512, max_num_seqs: 4, max_num_batched_tokens: 64}}
    policy: {{scheduling: {scheduling}, max_queue_len: 24}}
"""
NUM_BACKGROUND = 12  # three waves of max_num_seqs=4 long requests
NUM_INTERACTIVE = 10
# long enough that a wave of them outlasts an idle TTFT many times over (at 150 tokens, after decode got faster,
# fcfs blew up by only ~10x in one CI run)
BACKGROUND_TOKENS = 200  # with a 300-token prompt, within the tiny model's 512 positions
BACKGROUND = {"max_tokens": BACKGROUND_TOKENS, "temperature": 0.0,
              "extra_body": {"priority": 2, "ignore_eos": True}}
INTERACTIVE = {"max_tokens": 4, "temperature": 0.0, "extra_body": {"priority": 0, "ignore_eos": True}}
# a prompt that takes a few prefill steps, so an interactive TTFT measures scheduling, not loopback jitter: with 24
# tokens an idle TTFT was ~6 ms and one OS hiccup of ~15 ms put multilevel's p99 (the worst of ten) over its bar
INTERACTIVE_PROMPT_TOKENS = 200


@pytest.fixture(scope="module")
def lanes_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("lanes")
    model = write_gguf(hf_model(TinySpec(max_position_embeddings=512), seed=3), root / "tiny.gguf")
    port = free_port()
    registry = f"gateway: {{host: 127.0.0.1, port: {port}}}\nmodels:\n" + "".join(
        MODEL.format(scheduling=s, model=model) for s in ("fcfs", "multilevel"))
    # One thread per worker: a model this small gains nothing from more, and two workers plus the test on two
    # shared cores must not spin OpenMP threads against each other.
    with running_gateway(root, registry, port, model, extra_env={"OMP_NUM_THREADS": "1"}) as gw:
        yield gw


def _prompt(seed: int, length: int) -> list[int]:
    return [3 + (seed * 31 + i * 7) % 250 for i in range(length)]


async def _ttft_s(client: openai.AsyncOpenAI, model: str, seed: int) -> float:
    start = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=_prompt(seed, INTERACTIVE_PROMPT_TOKENS),
                                             stream=True, **INTERACTIVE)
    first: float | None = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
    assert first is not None
    return first


async def _background(client: openai.AsyncOpenAI, model: str, seed: int) -> int | str:
    """The completion tokens of a finished request, or the error code of a refused one."""
    try:
        done = await client.completions.create(model=model, prompt=_prompt(seed, 300), **BACKGROUND)
    except openai.RateLimitError as err:
        return f"429 retry-after={err.response.headers.get('retry-after')}"
    assert done.choices[0].finish_reason == "length"
    return done.usage.completion_tokens


async def _scenario(gateway: Gateway, model: str) -> tuple[list[float], list[float], list[int | str]]:
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        await _ttft_s(client, model, 999)  # warm-up: the first request through a fresh worker is slower
        idle = [await _ttft_s(client, model, seed) for seed in range(NUM_INTERACTIVE)]
        background = [asyncio.create_task(_background(client, model, 100 + i)) for i in range(NUM_BACKGROUND)]
        await _saturated(gateway, model)
        loaded = []
        for seed in range(NUM_INTERACTIVE):
            loaded.append(asyncio.create_task(_ttft_s(client, model, 50 + seed)))
            await asyncio.sleep(0.05)
        return idle, list(await asyncio.gather(*loaded)), list(await asyncio.gather(*background))


async def _saturated(gateway: Gateway, model: str) -> None:
    """Until the replica's batch is full and the rest of the background waits behind it. (A fixed head start
    was too long on a quick machine: the background was half done when the interactive requests came, and fcfs
    blew up by only 8x in one clean-clone CI run.)"""
    deadline = time.monotonic() + 60
    while True:
        gauges = await asyncio.to_thread(_replica_gauges, gateway, model)
        if (gauges["multiserve_num_requests_running"] >= 4
                and gauges["multiserve_num_requests_waiting"] >= NUM_BACKGROUND - 4):
            return
        assert time.monotonic() < deadline, gauges
        await asyncio.sleep(0.005)


def _replica_gauges(gateway: Gateway, model: str) -> dict[str, float]:
    replicas = httpx.get(f"{gateway.url}/health/models", timeout=10).json()["models"][model]["replicas"]
    text = replica_get(replicas[0], "/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in ("multiserve_kv_blocks_used", "multiserve_num_requests_running",
                          "multiserve_num_requests_waiting")}


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


# One OS hiccup of ~30 ms on a 15 ms idle TTFT put the worst of ten interactive requests at 4.3x in one clean-clone
# CI run (1.7-2.5x here), so multilevel's figure is the median of three runs, as benchmarks take medians of repeats.
MULTILEVEL_RUNS = 3


def test_multilevel_keeps_interactive_ttft_under_background_saturation(lanes_gateway, record_property):
    runs = [("fcfs", 0)] + [("multilevel", i) for i in range(MULTILEVEL_RUNS)]
    blowups: dict[str, list[float]] = {"fcfs": [], "multilevel": []}
    seen = {}
    for scheduling, run in runs:
        idle, loaded, background = asyncio.run(_scenario(lanes_gateway, f"lanes-{scheduling}"))
        idle_ttft_s = statistics.median(idle)
        blowups[scheduling].append(_p99(loaded) / idle_ttft_s)
        seen[f"{scheduling}/{run}"] = ([round(t * 1000, 1) for t in sorted(idle)],
                                       [round(t * 1000, 1) for t in sorted(loaded)])
        record_property(f"{scheduling}_{run}_ttft_idle_p50_ms", round(idle_ttft_s * 1000, 2))
        record_property(f"{scheduling}_{run}_ttft_loaded_p99_ms", round(_p99(loaded) * 1000, 2))
        assert background == [BACKGROUND_TOKENS] * NUM_BACKGROUND, background  # nothing accepted was lost or cut short
        gauges = _replica_gauges(lanes_gateway, f"lanes-{scheduling}")
        assert gauges == {"multiserve_kv_blocks_used": 0.0, "multiserve_num_requests_running": 0.0,
                          "multiserve_num_requests_waiting": 0.0}
    fcfs, multilevel = blowups["fcfs"][0], statistics.median(blowups["multilevel"])
    print(f"interactive TTFT p99 / idle p50: fcfs {fcfs:.1f}x, multilevel {multilevel:.2f}x "
          f"(median of {', '.join(f'{b:.2f}' for b in blowups['multilevel'])})")
    # the idle and loaded TTFTs (ms) of every run, so a failure shows whether one request or all of them were slow
    assert multilevel <= 3.0, (blowups, seen)
    # fcfs queues the interactive requests behind whole waves of long background requests
    assert fcfs > 3 * multilevel and fcfs > 10, (blowups, seen)


def test_a_burst_over_the_queue_limit_gets_429s_and_the_accepted_ones_finish(lanes_gateway):
    async def burst() -> list[int | str]:
        async with openai.AsyncOpenAI(base_url=f"{lanes_gateway.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return list(await asyncio.gather(*[_background(client, "lanes-multilevel", i) for i in range(40)]))

    outcomes = asyncio.run(burst())
    refused = [o for o in outcomes if isinstance(o, str)]
    accepted = [o for o in outcomes if not isinstance(o, str)]
    # at most 24 wait (plus up to 4 that had started by the time the rest arrived); the others are refused at
    # once, each with a Retry-After, and every accepted one finishes in full
    assert 40 - 28 <= len(refused) <= 40 - 24, outcomes
    assert all(o.startswith("429 retry-after=") and o[-1].isdigit() for o in refused)
    assert accepted == [BACKGROUND_TOKENS] * len(accepted)
    assert _replica_gauges(lanes_gateway, "lanes-multilevel")["multiserve_kv_blocks_used"] == 0.0
