"""The logits-processor seam (runtimes/llm/logits_processors.py): processors edit only the rows that want them, in
one batched call each, in their order, and a row some processor wants never takes a fast path that skips them (the
all-greedy argmax, a step launched ahead)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.logits_processors import BUILTIN_PROCESSORS, SamplingRow
from runtimes.llm.sampler import Sampler
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import (
    ReplayingGraph,
    eager_and_graphed,
    random_prompt,
    record_launches,
    run_to_completion,
)
from tests.runtimes.llm.test_cuda_graphs import KV_PER_TOKEN


class Ban:
    """Bans `token` for rows whose request has `tag` in its stop strings (a stand-in for a per-request grammar), and
    records each call's rows."""

    def __init__(self, token: int, tag: str = "<<ban>>") -> None:
        self.token = token
        self.tag = tag
        self.calls: list[list[int]] = []

    def wants(self, row: SamplingRow) -> bool:
        return self.tag in row.params.stop

    def apply(self, logits: torch.Tensor, rows: Sequence[int], batch: Sequence[SamplingRow]) -> None:
        self.calls.append(list(rows))
        logits[list(rows), self.token] = float("-inf")


def _row(**params: object) -> SamplingRow:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    return SamplingRow(p, [1, 2], [], p.seed)


def test_a_processor_edits_only_the_rows_that_want_it_in_one_call() -> None:
    logits = torch.zeros(4, 10)
    logits[:, 7] = 5.0  # every row's argmax
    ban = Ban(7)
    rows = [_row(temperature=0.0), _row(temperature=0.0, stop=["<<ban>>"]), _row(temperature=0.0),
            _row(temperature=0.0, stop=["<<ban>>"])]
    out = Sampler(processors=(*BUILTIN_PROCESSORS, ban))(logits, rows)
    assert ban.calls == [[1, 3]]
    assert out.token_ids[0] == out.token_ids[2] == 7 and 7 not in (out.token_ids[1], out.token_ids[3])


def test_no_call_when_no_row_wants_it_and_the_greedy_fast_path_stays() -> None:
    ban = Ban(7)
    sampler = Sampler(processors=(*BUILTIN_PROCESSORS, ban))
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, [_row(temperature=0.0)] * 3)
    assert ban.calls == [] and out.token_ids == logits.argmax(-1).tolist()


def test_processors_run_in_their_order_after_the_built_ins() -> None:
    order: list[str] = []

    class Mark:
        def __init__(self, name: str) -> None:
            self.name = name

        def wants(self, row: SamplingRow) -> bool:
            return True

        def apply(self, logits: torch.Tensor, rows: Sequence[int], batch: Sequence[SamplingRow]) -> None:
            # the bias (a built-in) is already in: token 3 was raised by 100
            assert logits[0, 3] >= 100.0
            order.append(self.name)

    sampler = Sampler(processors=(*BUILTIN_PROCESSORS, Mark("first"), Mark("second")))
    sampler(torch.zeros(1, 10), [_row(temperature=0.0, logit_bias={3: 100.0})])
    assert order == ["first", "second"]


def test_on_device_is_false_for_a_row_a_processor_wants() -> None:
    sampler = Sampler(processors=(*BUILTIN_PROCESSORS, Ban(7)))
    assert sampler.on_device(_row())
    assert not sampler.on_device(_row(stop=["<<ban>>"]))
    assert not sampler.on_device(_row(logprobs=1))
    assert not Sampler().on_device(_row(presence_penalty=0.5))
    assert not Sampler().on_device(SamplingRow(SamplingParams(min_tokens=2), [1], [5], None))
    assert Sampler().on_device(SamplingRow(SamplingParams(min_tokens=2), [1], [5, 6], None))


def test_the_engine_applies_its_processors_and_never_runs_their_rows_ahead(tiny_loaded) -> None:
    """Through the engine, with decode steps launched ahead where they can be: a request the processor wants never
    produces the banned token and is never in a launched step; the others run ahead as before, their tokens those
    of an engine without the processor (alone, once the constrained one has finished)."""
    loaded = tiny_loaded(seed=5)
    config = {"kv_cache_bytes": 1024 * KV_PER_TOKEN, "block_size": 4, "max_num_seqs": 8}
    plain, _ = eager_and_graphed(loaded, **config)
    free_tokens = run_to_completion(plain, {"free": (random_prompt(1, 6), SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))})["free"].token_ids
    banned = free_tokens[3]  # the unconstrained request's 4th token

    ban = Ban(banned)
    engine = LLMEngine(loaded, EngineConfig(**config), new_graph=ReplayingGraph,  # type: ignore[arg-type]
                       logits_processors=[ban])
    launched = record_launches(engine)
    got = run_to_completion(engine, {
        "free": (random_prompt(1, 6), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
        "banned": (random_prompt(1, 6), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                       stop=["<<ban>>"])),
    })
    assert got["free"].token_ids == free_tokens
    first = free_tokens.index(banned)  # up to there the ban changes nothing
    assert banned not in got["banned"].token_ids and got["banned"].token_ids[:first] == free_tokens[:first]
    assert ban.calls and all(len(rows) == 1 for rows in ban.calls)
    assert launched and all(request_id == "free" for request_id, _ in launched)
