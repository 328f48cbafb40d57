"""Limits of an embedding engine. Immutable after construction.

What a model directory says about its encoder and its pooling is read in runtimes/embedding/model_config.py
(`EncoderConfig`, `PoolingConfig`), which imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EmbeddingConfig:
    """Limits of one embedding engine (one replica).

    Requests arriving within `batch_window_s` of the oldest waiting one, up to `max_batch_size` inputs, are
    encoded together, in chunks of at most `max_batch_tokens` padded tokens between which requests take turns
    (runtimes/embedding/batching.py). `max_model_len` may lower the model's own input limit (None: the model's);
    `max_request_tokens` caps one request's inputs' tokens, summed.
    """

    device: str = "auto"  # auto | cpu | cuda[:N]
    # auto: float16 on CUDA (an encoder's activations fit its range, and it keeps 3 more mantissa bits than
    # bfloat16 for the vectors), float32 on the CPU
    dtype: str = "auto"
    max_batch_size: int = 64
    # What a lone client pays in latency; under load the window has usually passed when a batch ends.
    batch_window_s: float = 0.002
    max_batch_tokens: int = 64 * 256
    max_model_len: int | None = None
    # The sum of a request's inputs' token counts (what `usage.prompt_tokens` reports; padding is the engine's
    # business and at most doubles it). 2**17 holds OpenAI's 2,048 inputs at 64 tokens each, or 512 inputs at
    # all-MiniLM's 256-token limit; a 256 x 256-token request (65,536) is served, in 4 chunks that other requests
    # interleave with. It refuses what would hold one client's answer for minutes on a CPU: 2,048 x 256 tokens
    # (524,288) is ~4 min of a 2-core CPU's encoder time. OpenAI allows 300,000 summed (its inputs run to 8,192
    # tokens); a GPU replica may raise it.
    max_request_tokens: int = 1 << 17
    min_bucket_len: int = 32  # shortest padded length of a length bucket (tokens)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.batch_window_s <= 1:
            raise ValueError(f"batch_window_s must be within [0, 1] seconds, got {self.batch_window_s}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be >= 1, got {self.max_request_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.min_bucket_len < 1:
            raise ValueError(f"min_bucket_len must be >= 1, got {self.min_bucket_len}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
