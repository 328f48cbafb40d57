"""The engine's intake: a request turned into validated sequences, ready to queue.

The prompt is tokenized; every limit is checked, the error naming the field and the limit (InvalidRequestError,
ContextLengthError); `n > 1` fans out into samples (seeds `seed + index`); a resumed request's tokens become its
first outputs; a structured output's grammar gives each sample a matcher (past the resumed tokens). Nothing changes
state here: a request that fails leaves nothing behind.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from foundation.request_errors import ContextLengthError, InvalidRequestError
from runtimes.llm.detokenizer import IncrementalDetokenizer
from runtimes.llm.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher
from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.model_config import ModelConfig
from runtimes.llm.request import Request
from runtimes.llm.sampling_params import SamplingParams, StructuredOutput, check_token_ids
from runtimes.llm.sequences import SequenceState
from runtimes.llm.tokenizer import Tokenizer


class InputProcessor:
    """`kv`: the cache a sequence must fit in whole; `namespace`: the prefix cache's namespace for this model's
    blocks (None: prefix caching off)."""

    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, max_model_len: int, kv: KVCacheManager,
                 namespace: str | None, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.kv = kv
        self.namespace = namespace
        self.model_name = model_name
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()

    def process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, priority: int,
                arrival: float, resume_token_ids: Sequence[int] = (), grammar: CompiledGrammar | None = None
                ) -> list[SequenceState]:
        """The request's sequences, validated; raises InvalidRequestError naming the field and limit.

        `resume_token_ids` continues a request another replica started (n = 1 only): the tokens it had generated
        count as this request's first outputs (for max_tokens, min_tokens, penalties, stop strings and the seeded
        noise's positions), are computed like a prompt, and are not output again; generation picks up after them.
        Greedy and seeded requests so produce what the undisturbed run would have.

        `grammar`: `params.structured` compiled ahead (`compile_grammar`, off the engine's thread); compiled here
        when not given."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self._validate(prompt_ids, params)
        resumed = self._validate_resume(list(resume_token_ids), params, max_tokens)
        if params.structured is not None and grammar is None:
            grammar = self.compile_grammar(params.structured)
        sequences = self.sequences(request_id, prompt_ids, params, max_tokens, priority, arrival, resumed)
        if grammar is not None:
            for seq in sequences:
                seq.request.grammar = _matcher_after(grammar, resumed)
        return sequences

    def compile_grammar(self, spec: StructuredOutput) -> CompiledGrammar:
        """A structured output's grammar, compiled (cached; thread-safe: an async caller compiles in a worker thread);
        raises InvalidRequestError naming the request field when it cannot be compiled."""
        with self._compiler_lock:
            if self._compiler is None:  # built on first use: reading the vocabulary takes a while
                self._compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                 self.model_config.eos_token_ids)
        return self._compiler.compile(spec)

    def sequences(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                  priority: int, arrival: float, resumed: Sequence[int] = ()) -> list[SequenceState]:
        """A request's `n` sequences, every one built before any is queued."""
        namespace = self.namespace
        if namespace is None and params.n > 1:
            namespace = f"{self.model_name}/group/{request_id}"  # siblings still share the prompt's blocks
        sequences = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = None if params.seed is None else params.seed + index
            request = Request(child_id, prompt_ids, params, max_tokens, arrival, priority,
                              self.model_config.eos_token_ids, namespace, seed, resumed)
            # the text the resumed tokens made was sent already: only the detokenizer's state is wanted
            detok, _ = IncrementalDetokenizer.resumed(self.tokenizer, resumed,
                                                      skip_special_tokens=params.skip_special_tokens, stop=params.stop)
            if detok.finished:
                raise InvalidRequestError(f"the resumed tokens already end in the stop string {detok.stopped_by!r}",
                                          param="resume.token_ids")
            sequences.append(SequenceState(request, request_id, index, detok))
        return sequences

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens (its own, or what the context leaves)."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        check_token_ids(prompt_ids, vocab, "prompt")
        params.check_vocab(vocab)
        limit = self.max_model_len
        num_prompt = len(prompt_ids)
        if num_prompt >= limit:
            raise ContextLengthError(
                f"the prompt has {num_prompt} tokens; this model's maximum context length is {limit} tokens "
                "including at least one generated token", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens, but {num_prompt + max_tokens} were "
                f"requested ({num_prompt} in the prompt, {max_tokens} in max_tokens)", param="max_tokens")
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this "
                                      "request may generate", param="min_tokens")
        # with a window on every layer a request holds only its window's blocks and a step's (kv.blocks_at_most)
        if self.kv.blocks_at_most(num_prompt + max_tokens) > self.kv.num_blocks:
            capacity = self.kv.num_blocks * self.kv.block_size
            raise InvalidRequestError(
                f"prompt plus max_tokens is {num_prompt + max_tokens} tokens but the KV cache holds at most "
                f"{capacity} tokens ({self.kv.num_blocks} blocks of {self.kv.block_size})", param="max_tokens")
        return max_tokens

    def _validate_resume(self, resumed: list[int], params: SamplingParams, max_tokens: int) -> list[int]:
        if not resumed:
            return resumed
        param = "resume.token_ids"
        if params.n != 1:
            raise InvalidRequestError(f"a resumed request must have n = 1, got n = {params.n}", param=param)
        check_token_ids(resumed, self.model_config.vocab_size, param)
        if len(resumed) >= max_tokens:
            raise InvalidRequestError(f"{len(resumed)} tokens already generated leave nothing of max_tokens="
                                      f"{max_tokens} to resume", param=param)
        return resumed


def _matcher_after(grammar: CompiledGrammar, resumed: Sequence[int]) -> GrammarMatcher:
    """A matcher at the start of the output, advanced past a resumed request's tokens (its grammar state rebuilt)."""
    matcher = grammar.matcher()
    for at, token in enumerate(resumed):
        if not matcher.accept(token):
            raise InvalidRequestError(f"resume.token_ids: token {token} at position {at} is not allowed by the "
                                      "request's structured output", param="resume.token_ids")
    return matcher
