"""Acceptance: two co-located tiny Llama engines with weights 3:1 under saturating load get the device (the CPU
here) 75 % / 25 % of the time; when one goes idle the other gets all of it.

Each engine steps on its own thread behind a real `LeaseClient` on a real `ArbiterService` socket, exactly as
two worker processes would. Shares are measured on lease time (what the clients report holding), not on
tokens per second, so a noisy shared machine slows both engines without moving the shares.
"""

from __future__ import annotations

import asyncio

import pytest

from partitioner.timeslice.client import LeaseClient
from partitioner.timeslice.service import ArbiterService
from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams

NUM_STREAMS = 4  # concurrent requests per engine: enough that an engine never runs out of work


async def saturate(engine: AsyncLLMEngine, tag: str, stop: asyncio.Event) -> None:
    """Keep NUM_STREAMS long requests running on `engine` until `stop`; closing a stream aborts its request."""
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def stream(slot: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            async for _ in engine.generate(f"{tag}-{slot}-{n}", [3 + slot, 17, 40, 9], params):
                if stop.is_set():
                    break

    await asyncio.gather(*(stream(s) for s in range(NUM_STREAMS)))


def busy_s(service: ArbiterService) -> dict[str, float]:
    return {s.client_id: s.busy_s for s in service.shares()}


async def measure(service: ArbiterService, window_s: float) -> dict[str, float]:
    """Each client's share of the lease time granted during the next `window_s`."""
    before = busy_s(service)
    await asyncio.sleep(window_s)
    after = busy_s(service)
    got = {k: after[k] - before.get(k, 0.0) for k in after}
    total = sum(got.values())
    assert total > 0.5 * window_s, f"the device was mostly idle: {got}"
    return {k: v / total for k, v in got.items()}


@pytest.fixture
def engines(tmp_path, tiny_loaded):
    service = ArbiterService(tmp_path / "cpu.sock", "cpu").start()
    made = {}
    for client_id, weight, seed in (("heavy/0", 3.0, 0), ("light/0", 1.0, 1)):
        gate = LeaseClient(service.socket_path, client_id, weight)
        config = EngineConfig(kv_cache_bytes=4 << 20, block_size=16, max_num_seqs=NUM_STREAMS)
        made[client_id] = (AsyncLLMEngine(LLMEngine(tiny_loaded(seed=seed), config), step_gate=gate), gate)
    yield service, {k: e for k, (e, _) in made.items()}
    for engine, gate in made.values():
        engine.shutdown()
        gate.close()
    service.close()


def test_weights_3_to_1_share_device_time_and_an_idle_share_goes_to_the_busy(engines):
    service, by_id = engines

    async def main() -> tuple[dict[str, float], dict[str, float]]:
        stop_heavy, stop_light = asyncio.Event(), asyncio.Event()
        loads = [asyncio.create_task(saturate(by_id["heavy/0"], "h", stop_heavy)),
                 asyncio.create_task(saturate(by_id["light/0"], "l", stop_light))]
        await asyncio.sleep(0.5)  # warm-up: both engines admitted their requests and are stepping
        both = await measure(service, 1.5)
        stop_light.set()
        await loads[1]
        await asyncio.sleep(0.2)  # light's aborts reach its engine thread, which goes idle
        alone = await measure(service, 1.0)
        stop_heavy.set()
        await loads[0]
        return both, alone

    both, alone = asyncio.run(main())
    print(f"shares with both busy: {both}; with light idle: {alone}")
    assert both["heavy/0"] == pytest.approx(0.75, abs=0.075), both  # within ±10 % of 75/25
    assert alone["heavy/0"] >= 0.97, alone
