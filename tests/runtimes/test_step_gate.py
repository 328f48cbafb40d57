"""The engine loops' step gate: taken around every step, told whether another step follows at once."""

from __future__ import annotations

import asyncio

from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams


class RecordingGate:
    def __init__(self) -> None:
        self.events: list[str] = []

    def acquire(self) -> None:
        assert not self.events or self.events[-1].startswith("release"), "acquired twice"
        self.events.append("acquire")

    def release(self, more: bool) -> None:
        assert self.events[-1] == "acquire", "released without acquiring"
        self.events.append(f"release more={more}")


def test_every_llm_step_holds_the_gate_and_the_last_says_no_more(tiny_loaded):
    gate = RecordingGate()
    engine = AsyncLLMEngine(LLMEngine(tiny_loaded(), EngineConfig(kv_cache_bytes=1 << 20, block_size=4)),
                            step_gate=gate)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    async def main() -> int:
        return len([o async for o in engine.generate("r", [5, 6, 7], params)])

    try:
        assert asyncio.run(main()) == 5
    finally:
        engine.shutdown()
    # one step per token (prefill samples the first), each inside the gate; all but the last promise another
    assert gate.events == ["acquire", "release more=True"] * 4 + ["acquire", "release more=False"]
