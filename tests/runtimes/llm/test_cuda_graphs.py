"""Decode graphs (runtimes/llm/cuda_graphs.py) through a CPU stand-in for a CUDA graph.

`ReplayingGraph` keeps what a real graph keeps: the function it captured, closed over the static buffers and over the
host values the capture saw (the metadata's host tuples, the bucket's size); a replay reruns exactly that and refills
the captured output tensor. So anything the decode path took from the step's host values instead of the static
device buffers would replay the capture's values, and the tokens would differ from the eager engine's; the last test
shows that it does catch such a path. What this cannot check is CUDA itself (stream capture, the memory pool, the
pinned copies' asynchrony): `tests/gpu/check_model.py` does, on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from runtimes.llm import engine_setup
from runtimes.llm.attention import paged_attention_ref, reads_only_device_metadata, select_attention
from runtimes.llm.config import EngineConfig
from runtimes.llm.cuda_graphs import capture_sizes
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import (
    ReplayingGraph,
    eager_and_graphed,
    random_prompt,
    run_to_completion,
    same_tokens,
)

KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K+V x layers x kv heads x head_dim x fp32 bytes (TinySpec defaults)


def _requests(count: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy and seeded requests of different prompt and output lengths, so batches grow and shrink."""
    requests = {}
    for i in range(count):
        params = (SamplingParams(temperature=0.0, max_tokens=6 + (i * 5) % 23, ignore_eos=True) if i % 3 else
                  SamplingParams(temperature=0.8, top_p=0.9, seed=40 + i, max_tokens=4 + i % 11, ignore_eos=True))
        requests[f"r{i}"] = (random_prompt(i, 2 + (i * 7) % 40), params)
    return requests


@pytest.fixture
def engines(tiny_loaded):
    """(eager engine, graph engine) factory over one tiny model with the C++ CPU attention."""
    loaded = tiny_loaded(seed=3)

    def make(**overrides: object) -> tuple[LLMEngine, LLMEngine]:
        return eager_and_graphed(loaded, **{"kv_cache_bytes": 1024 * KV_PER_TOKEN, "block_size": 4,
                                            "max_num_batched_tokens": 64, "max_num_seqs": 12, **overrides})

    return make


def _count_decode_steps(engine: LLMEngine) -> list[int]:
    """A counter of the engine's steps in which every scheduled request has one new token."""
    count = [0]
    execute, launch = engine.runner.execute, engine.runner.launch

    def counting(plan, *args, **kwargs):
        count[0] += all(item.num_new_tokens == 1 for item in plan.scheduled)
        return execute(plan, *args, **kwargs)

    def counting_launch(plan, *args, **kwargs):
        count[0] += 1  # always a decode step
        return launch(plan, *args, **kwargs)

    engine.runner.execute = counting  # type: ignore[method-assign]
    engine.runner.launch = counting_launch  # type: ignore[method-assign]
    return count


def test_capture_sizes_are_vllm_like_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1000)[-1] == 256


def test_graph_decode_is_token_identical_to_eager_and_replays_every_decode_step(engines):
    eager, graphed = engines()
    assert graphed.runner.graphs is not None and graphed.runner.graphs.sizes == [1, 2, 4, 8, 12]
    assert eager.runner.graphs is None  # the CPU: no graphs unless asked for
    decode_steps = _count_decode_steps(graphed)
    requests = _requests(20)
    same_tokens(eager, graphed, requests)
    graphs = graphed.runner.graphs
    assert decode_steps[0] > 10 and graphs.replays == decode_steps[0]  # every step of one token per row
    # nothing leaked, and the pad block was never handed out
    assert graphed.kv.num_free_blocks == graphed.kv.num_blocks == eager.kv.num_blocks - 1
    assert graphs.pad_block == eager.kv.num_blocks - 1


def test_graph_decode_under_preemption_rewrites_the_rows_of_re_allocated_tables(engines):
    """A tight cache preempts requests; one that comes back gets new blocks in a new table list, which the graphs'
    kept block-table rows must not mistake for the old one."""
    eager, graphed = engines(kv_cache_bytes=30 * 4 * KV_PER_TOKEN, max_num_seqs=8)  # 30 blocks of 4 tokens
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = {f"p{i}": (random_prompt(100 + i, 10 + i), params) for i in range(8)}
    same_tokens(eager, graphed, requests)
    assert graphed.scheduler.num_preemptions > 0
    assert graphed.kv.num_free_blocks == graphed.kv.num_blocks


def test_batches_beyond_the_largest_bucket_run_eagerly(engines, monkeypatch):
    monkeypatch.setattr(engine_setup, "capture_sizes", lambda max_num_seqs: [1, 2, 4])
    eager, graphed = engines(max_num_seqs=12)  # batches of 5..12 must take the eager path
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.max_size == 4
    decode_steps = _count_decode_steps(graphed)
    requests = _requests(12)
    same_tokens(eager, graphed, requests)
    assert 0 < graphs.replays < decode_steps[0]


def test_padding_rows_write_only_the_pad_block(tiny_loaded):
    loaded = tiny_loaded(seed=3)
    config = EngineConfig(kv_cache_bytes=64 * 4 * KV_PER_TOKEN, block_size=4, max_num_seqs=8)
    loaded.model.set_attention(select_attention("auto", torch.device("cpu")))
    engine = LLMEngine(loaded, config, new_graph=ReplayingGraph)
    graphs = engine.runner.graphs
    assert graphs is not None
    before = [k.clone() for k, _ in engine.runner.kv_caches]
    # 3 rows in the bucket of 4: one padding row; real rows write block 5 (positions 20..22 of tables [5])
    hidden = graphs.run([7, 8, 9], [20, 21, 22], [[0, 1, 2, 3, 4, 5]] * 3)
    assert hidden is not None and hidden.shape[0] == 3
    for layer, (k, _) in enumerate(engine.runner.kv_caches):
        changed = {int(b) for b in (k != before[layer]).flatten(1).any(1).nonzero().flatten()}
        assert changed == {5, graphs.pad_block}, (layer, changed)


def test_only_backends_that_read_device_metadata_are_captured(tiny_loaded):
    assert reads_only_device_metadata(select_attention("cpu", torch.device("cpu")))
    assert not reads_only_device_metadata(paged_attention_ref)
    loaded = tiny_loaded(seed=3)  # the reference attention
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=256 * KV_PER_TOKEN, block_size=4, max_num_seqs=4),
                       new_graph=ReplayingGraph)
    assert engine.runner.graphs is None
    assert engine.kv.num_blocks == 64  # no pad block taken


def test_the_cpu_kernel_is_captured_only_for_the_dtypes_it_computes(tiny_loaded):
    """Other dtypes go from the CPU kernel to the reference, which reads the host copies a graph bakes in (every row
    then attends to one token): a bf16 model is not captured; the same engine in fp32 is, also over an fp16 cache."""
    config = EngineConfig(kv_cache_bytes=256 * KV_PER_TOKEN, block_size=4, max_num_seqs=4)
    loaded = tiny_loaded(seed=3)
    loaded.model.set_attention(select_attention("cpu", torch.device("cpu")))
    assert LLMEngine(loaded, config, new_graph=ReplayingGraph).runner.graphs is not None
    fp16_cache = EngineConfig(kv_cache_bytes=256 * KV_PER_TOKEN, block_size=4, max_num_seqs=4, kv_dtype="fp16")
    assert LLMEngine(loaded, fp16_cache, new_graph=ReplayingGraph).runner.graphs is not None
    loaded.model.to(torch.bfloat16)
    assert LLMEngine(loaded, config, new_graph=ReplayingGraph).runner.graphs is None


def test_the_stand_in_bakes_host_values_as_a_graph_does(tiny_loaded, monkeypatch):
    """Forced over the reference attention, which reads `seq_lens_host`, replays attend over the captured length
    (one token) and the tokens change: the stand-in would catch a decode path that reads the step's host values."""
    loaded = tiny_loaded(seed=3)
    config = EngineConfig(kv_cache_bytes=256 * KV_PER_TOKEN, block_size=4, max_num_seqs=4)
    eager = LLMEngine(loaded, config)
    monkeypatch.setattr(engine_setup, "graphs_apply", lambda model, kv_dtype: True)
    forced = LLMEngine(loaded, config, new_graph=ReplayingGraph)
    assert forced.runner.graphs is not None
    requests = {"g": (random_prompt(5, 9), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))}
    expected = run_to_completion(eager, requests)
    got = run_to_completion(forced, requests)
    assert forced.runner.graphs.replays > 0
    assert got["g"].token_ids != expected["g"].token_ids


def test_triton_decode_attention_replays_token_identical(tiny_loaded):
    """The backend the graphs capture on CUDA, run by Triton's interpreter: it too reads only device metadata."""
    from runtimes.llm.attention.triton_paged import paged_attention_triton

    loaded = tiny_loaded(seed=4)
    loaded.model.set_attention(paged_attention_triton)
    config = EngineConfig(kv_cache_bytes=128 * 4 * KV_PER_TOKEN, block_size=4, max_num_seqs=3)
    eager, graphed = LLMEngine(loaded, config), LLMEngine(loaded, config, new_graph=ReplayingGraph)
    decode_steps = _count_decode_steps(graphed)
    requests = {f"t{i}": (random_prompt(60 + i, 3 + 4 * i), SamplingParams(temperature=0.0, max_tokens=3 + 3 * i,
                                                                     ignore_eos=True)) for i in range(3)}
    same_tokens(eager, graphed, requests)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.replays == decode_steps[0] > 0


def test_eager_steps_move_their_metadata_only_through_to_device(engines, monkeypatch):
    """A prefill and decode steps, eagerly, greedy and seeded: no tensor is made on a device straight from host values
    (on CUDA that is a copy from pageable memory, which waits for the device); everything goes through
    `metadata.to_device`, a non-waiting copy from page-locked memory there."""
    from runtimes.llm.attention import metadata as metadata_module

    eager, _ = engines()
    real_tensor, moved = torch.tensor, []

    def tensor_without_device(*args, **kwargs):
        assert kwargs.get("device") is None, "a tensor made on a device from host values"
        return real_tensor(*args, **kwargs)

    real_to_device = metadata_module.to_device
    monkeypatch.setattr(torch, "tensor", tensor_without_device)
    def counted(values, dtype, device):
        moved.append(len(values))
        return real_to_device(values, dtype, device)

    monkeypatch.setattr(metadata_module, "to_device", counted)
    requests = {"g": (random_prompt(1, 9), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)),
                "s": (random_prompt(2, 5), SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True))}
    assert all(len(r.token_ids) == 4 for r in run_to_completion(eager, requests).values())
    assert moved  # the metadata went through it


def test_every_bucket_warms_up_on_one_side_stream(monkeypatch):
    """cuBLAS keeps a workspace per stream it runs on: a warm-up stream per bucket would hold one per bucket. The CUDA
    calls are stand-ins here (no GPU); what is checked is how many streams the captures create."""
    import contextlib

    from runtimes.llm import cuda_graphs

    streams: list[object] = []

    class Stream:
        def __init__(self) -> None:
            streams.append(self)

        def wait_stream(self, other: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream.__new__(Stream))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    new_graph = cuda_graphs.cuda_graph_factory()
    for size in capture_sizes(64):
        new_graph().capture(lambda size=size: torch.zeros(size))
    assert len(streams) == 1


def test_a_mixture_whose_experts_loop_is_not_captured(tmp_path):
    """A mixture's expert loop reads each expert's token count back to the host, which a graph would bake in: its
    decode steps run eagerly; with its experts stacked for the grouped GEMM (no host read-back) they are captured."""
    from runtimes.llm.attention import select_attention
    from runtimes.llm.cuda_graphs import graphs_apply
    from runtimes.llm.loader import load_model
    from runtimes.llm.model import MixtureOfExperts
    from tests.runtimes.llm.families import hf_family_model, save_family_dir

    cpu = torch.device("cpu")
    loaded = load_model(save_family_dir(hf_family_model("qwen3_moe"), tmp_path), cpu, torch.float32,
                        select_attention("cpu", cpu), progress=False)
    assert not graphs_apply(loaded.model, torch.float32)
    config = EngineConfig(kv_cache_bytes=1 << 20, block_size=4, max_num_seqs=4)
    assert LLMEngine(loaded, config, new_graph=ReplayingGraph).runner.graphs is None
    mixtures = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, MixtureOfExperts)]
    assert mixtures and all(mlp.stack_experts() for mlp in mixtures)
    assert graphs_apply(loaded.model, torch.float32)
