"""Tokenizer for the LLM runtime: built from GGUF metadata or a Hugging Face directory, plus chat templates.

The GGUF path rebuilds the tokenizer the way transformers does (`integrations/gguf/gguf_tokenizer_mapping.py`)
so token ids match the reference. Chat templates render with the same Jinja environment transformers uses,
so prompts match `apply_chat_template(..., tokenize=False)` byte for byte.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, SupportsInt

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from foundation.request_errors import InvalidRequestError

__all__ = ["Tokenizer"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types (gguf.TokenType)

# Split regexes for the GGUF `tokenizer.ggml.pre` types whose merges were learned with a non-GPT-2 split
# (a subset of transformers' GGUF_PRE_TOKENIZER_SPLITS). Every other type, "smollm" included, gets plain
# ByteLevel with the GPT-2 regex, as in transformers. (llama.cpp also splits digits one by one for
# "smollm", but SmolLM2's vocabulary has no multi-digit token, so the ids are the same.)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx"), _LLAMA3_SPLIT)
_PRE_SPLITS.update(dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT))


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level vocabularies are spelled in."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by some HF templates to mark assistant text).

    transformers uses it to build an assistant-token mask; we only need the templates to parse, so the body
    renders unchanged.
    """

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API declares this as a plain class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile `source` in transformers' chat-template environment (cached: templates are big)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # transformers replaces jinja's tojson, which HTML-escapes, so tool schemas reach the model verbatim.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _validated_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and contents, and return copies ready for the template.

    Like transformers, keys whose value is None are dropped (templates test for a key, not for None). A
    list of text parts is joined with newlines, as vLLM does for string-content templates, because most
    text-only templates concatenate `message['content']` as a string.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of message objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                is_text = isinstance(part, Mapping) and part.get("type") == "text"
                if not (is_text and isinstance(part.get("text"), str)):
                    raise InvalidRequestError(
                        f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': str}}",
                        param=f"messages[{i}].content[{j}]",
                    )
            content = "\n".join(part["text"] for part in content)
        elif not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            # Only an assistant turn that calls tools may come without content (OpenAI sends null there).
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts",
                                      param=f"messages[{i}].content")
        out.append({k: v for k, v in {**message, "content": content}.items() if v is not None})
    return out


def _meta_list(fields: Mapping[str, object], key: str) -> list[Any]:
    value = fields.get(key)
    return list(value) if isinstance(value, Iterable) and not isinstance(value, str) else []


def _meta_id(fields: Mapping[str, object], name: str) -> int | None:
    value = fields.get(f"tokenizer.ggml.{name}_token_id")
    return int(value) if isinstance(value, (int, SupportsInt)) else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken dict."""
    return value.get("content") if isinstance(value, Mapping) else value


def _eos_ids(path: str) -> list[int]:
    """`eos_token_id` of a generation_config.json / config.json: absent, one id or a list."""
    value = _read_json(path).get("eos_token_id")
    return [] if value is None else [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.PostProcessor:
    """The post-processor transformers' `update_post_processor` builds for add_bos_token/add_eos_token."""
    single = f"{bos[0] + ':0 ' if bos else ''}$A:0{' ' + eos[0] + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos[0] + ':1' if bos else ''} $B:1{' ' + eos[0] + ':1' if eos else ''}"
    specials = [t for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token ids and chat template the runtime needs."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wrap `backend`, whose post-processor already adds BOS/EOS if the model wants them."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))  # ordered, no duplicates
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template

    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, object]) -> Tokenizer:
        """Build from GGUF metadata, `{key: field.contents()}`; only `tokenizer.*` keys are read.

        Supports `tokenizer.ggml.model == "gpt2"` (byte-level BPE), which covers the GPT-2, Llama 3,
        Qwen and SmolLM families.
        """
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') works")
        tokens = [str(t) for t in _meta_list(fields, "tokenizer.ggml.tokens")]
        token_types = [int(t) for t in _meta_list(fields, "tokenizer.ggml.token_type")]
        spelling = _byte_alphabet()
        alphabet = set(spelling.values())
        # Some converters store a token raw (e.g. " " or "é"); the BPE model needs it in the byte alphabet.
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)
        }
        merges: list[tuple[str, str]] = []
        for merge in _meta_list(fields, "tokenizer.ggml.merges"):
            left, _, right = str(merge).partition(" ")  # byte-level tokens never contain a raw space
            merges.append((left, right))
        bpe = models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="")
        backend = BackendTokenizer(bpe)
        split = _PRE_SPLITS.get(str(fields.get("tokenizer.ggml.pre")))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        backend.decoder = decoders.ByteLevel()

        bos, eos, unk, pad, eot, eom = (
            _meta_id(fields, k) for k in ("bos", "eos", "unknown", "padding", "eot", "eom"))
        # CONTROL tokens and the named bos/eos/unk/pad are special: matched whole, skipped on decode. One not
        # spelled in the byte alphabet is a converter mislabel (adding it would mint a new id), so it is
        # skipped, as in transformers. USER_DEFINED tokens (e.g. <think>) are matched whole but kept on
        # decode, as in transformers and llama.cpp.
        special = {i for i, ty in enumerate(token_types) if ty == _CONTROL} | {bos, eos, unk, pad}
        backend.add_special_tokens([
            AddedToken(tokens[i], normalized=False, special=True)
            for i in sorted(i for i in special if i is not None) if set(tokens[i]) <= alphabet
        ])
        backend.add_tokens([
            AddedToken(tokens[i], normalized=False, special=False)
            for i, ty in enumerate(token_types) if ty == _USER_DEFINED and tokens[i] in vocab
        ])
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _bos_eos_processor(
            (tokens[bos], bos) if add_bos and bos is not None else None,
            (tokens[eos], eos) if add_eos and eos is not None else None,
        )
        template = fields.get("tokenizer.chat_template")
        # End-of-turn / end-of-message ids are declared by the file too, and llama.cpp stops on them.
        eos_ids = [i for i in (eos, eot, eom) if i is not None]
        return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids, unk_token_id=unk, pad_token_id=pad,
                   chat_template=str(template) if template is not None else None)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Read the tokenizer from a GGUF file (only its metadata; tensors stay memory-mapped, untouched)."""
        from runtimes.llm.gguf_file import GGUFFile

        metadata = GGUFFile(os.fspath(path)).metadata
        return cls.from_gguf_metadata({name: value for name, value in metadata.items()
                                       if name.startswith("tokenizer.")})

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face model directory: tokenizer.json plus tokenizer_config.json,
        chat_template.jinja, generation_config.json and config.json when present."""
        root = os.fspath(path)
        backend = BackendTokenizer.from_file(os.path.join(root, "tokenizer.json"))
        cfg = _read_json(os.path.join(root, "tokenizer_config.json"))

        def token_id(name: str) -> int | None:
            content = _token_content(cfg.get(name))
            return backend.token_to_id(content) if content is not None else None

        bos, eos = token_id("bos_token"), token_id("eos_token")
        # transformers rebuilds the post-processor only when the config sets a flag; otherwise
        # tokenizer.json's own (e.g. Llama 3's BOS template) stands.
        if "add_bos_token" in cfg or "add_eos_token" in cfg or backend.post_processor is None:
            bos_tok, eos_tok = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
            backend.post_processor = _bos_eos_processor(
                (bos_tok, bos) if cfg.get("add_bos_token") and bos_tok and bos is not None else None,
                (eos_tok, eos) if cfg.get("add_eos_token") and eos_tok and eos is not None else None,
            )
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = os.path.join(root, "chat_template.jinja")
        if os.path.isfile(jinja_path):  # newer repos keep the template in its own file; it takes precedence
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        eos_ids = [*([eos] if eos is not None else []),
                   *_eos_ids(os.path.join(root, "generation_config.json")),
                   *_eos_ids(os.path.join(root, "config.json"))]
        return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids, unk_token_id=token_id("unk_token"),
                   pad_token_id=token_id("pad_token"), chat_template=template)

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence id (the first of `eos_token_ids`)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of every special added token plus bos/eos/unk/pad."""
        named = [self.bos_token_id, *self.eos_token_ids, self.unk_token_id, self.pad_token_id]
        added = [i for i, t in self.backend.get_added_tokens_decoder().items() if t.special]
        return sorted({i for i in (*named, *added) if i is not None})

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry for `token_id` (byte-level spelling), or None if out of range."""
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole.

        `add_special_tokens` adds BOS/EOS only where the model asks for it (GGUF add_bos_token, or
        tokenizer.json's post-processor).
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 at the end becomes U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the model's chat template as transformers does; the result is encoded with
        `add_special_tokens=False` since templates write their own BOS.

        Raises InvalidRequestError (a ValueError) naming the bad message index and field, and ValueError
        when the model has no chat template. `kwargs` become template variables (e.g. `enable_thinking`).
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain-text prompt instead")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise InvalidRequestError("tools must be a list of JSON-schema objects", param="tools")
        chat = _validated_messages(messages)
        named = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id,
                 "unk_token": self.unk_token_id, "pad_token": self.pad_token_id}
        # Decoded rather than looked up, so a byte-level vocabulary's spelling (Ġ...) never leaks in.
        special = {k: self.decode([i], skip_special_tokens=False) for k, i in named.items() if i is not None}
        return _compile_chat_template(self.chat_template).render(
            messages=chat, tools=list(tools) if tools is not None else None, documents=None,
            add_generation_prompt=add_generation_prompt, **{**special, **kwargs},
        )
