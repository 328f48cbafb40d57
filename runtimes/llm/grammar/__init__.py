"""Constrained decoding's backend: `GrammarCompiler` turns a request's `StructuredOutput` (JSON schema, any JSON
object, regex, choice, Lark or GBNF grammar) into a `CompiledGrammar` (cached), whose `matcher()` follows one output
sequence; each step the matchers fill a token bitmask (`allocate_bitmask`) and `apply_bitmask` sets the logits of
the tokens it excludes to -inf. The grammars are llguidance's (backend.py); the bitmask is plain torch (bitmask.py).
"""

from runtimes.llm.grammar.backend import CompiledGrammar, FixedMask, GrammarCompiler, GrammarMatcher
from runtimes.llm.grammar.bitmask import allocate_bitmask, apply_bitmask, bitmask_width

__all__ = ["CompiledGrammar", "FixedMask", "GrammarCompiler", "GrammarMatcher", "allocate_bitmask",
           "apply_bitmask", "bitmask_width"]
