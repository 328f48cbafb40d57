"""Which lane a request runs in: interactive (0), normal (1) or background (2).

In order: the request's own `priority` field (vLLM convention: lower is more urgent; values are
clamped to the lanes) or an `X-Priority` header (a lane name or number), then the API key's default,
then its length: short prompts with short answers are interactive, very long prompts background.

What an API key lets its requests ask for (`key_lane`) is decided at the gateway, which sends the replica the lane
it allowed: a replica trusts its gateway.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.multilevel import BACKGROUND, INTERACTIVE, LANES, NORMAL


@dataclass(frozen=True)
class LaneThresholds:
    interactive_max_prompt_tokens: int = 512
    interactive_max_tokens: int = 256
    background_min_prompt_tokens: int = 4096

    def __post_init__(self) -> None:
        for name in ("interactive_max_prompt_tokens", "interactive_max_tokens", "background_min_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.interactive_max_prompt_tokens >= self.background_min_prompt_tokens:
            raise ValueError(f"interactive_max_prompt_tokens ({self.interactive_max_prompt_tokens}) must be below "
                             f"background_min_prompt_tokens ({self.background_min_prompt_tokens})")


def parse_lane(value: str | int) -> int:
    """A lane from a number (clamped) or a name; ValueError naming the accepted values otherwise."""
    if isinstance(value, int):
        return min(max(value, INTERACTIVE), BACKGROUND)
    text = value.strip().lower()
    if text in LANES:
        return LANES.index(text)
    try:
        return parse_lane(int(text))
    except ValueError:
        raise ValueError(f"priority must be a number or one of {', '.join(LANES)}; got {value!r}") from None


class LaneNotAllowed(ValueError):
    """A request asked for a lane its API key does not list."""

    def __init__(self, lane: int, allowed: frozenset[int]) -> None:
        super().__init__(f"the {LANES[lane]} lane is not one of this API key's lanes: {lane_names(allowed)}")
        self.lane, self.allowed = lane, allowed


def lane_names(lanes: frozenset[int]) -> str:
    """The lanes, most urgent first, by name: "normal, background"."""
    return ", ".join(LANES[lane] for lane in sorted(lanes))


def key_lane(asked: int | None, ceiling: int | None, allowed: frozenset[int] | None) -> int | None:
    """The lane of a request on an API key, from the lane it asked for (`asked`; None: it named none) and its key's
    `priority` (`ceiling`) and `lanes` (`allowed`); None: the key sets neither and the request named no lane, so its
    length decides (`classify`).

    - `allowed` set: the asked lane if it is listed, else LaneNotAllowed; a request that names none gets `ceiling`
      if set (it is then one of `allowed`), else the least urgent allowed lane.
    - only `ceiling` set: the asked lane, or the ceiling if the asked one is more urgent (clamped, as vLLM clamps a
      priority out of range); a request that names none gets the ceiling.
    """
    if allowed is not None:
        if asked is None:
            return ceiling if ceiling is not None else max(allowed)
        if asked not in allowed:
            raise LaneNotAllowed(asked, allowed)
        return asked
    if asked is None or ceiling is None:
        return ceiling if asked is None else asked
    return max(asked, ceiling)


def classify(
    priority: int | None,
    header: str | None,
    key_default: int | str | None,
    num_prompt_tokens: int,
    max_tokens: int | None,
    thresholds: LaneThresholds | None = None,
) -> int:
    if priority is not None:
        return parse_lane(priority)
    if header:
        return parse_lane(header)
    if key_default is not None:
        return parse_lane(key_default)
    limits = thresholds or LaneThresholds()
    if num_prompt_tokens >= limits.background_min_prompt_tokens:
        return BACKGROUND
    short_answer = max_tokens is not None and max_tokens <= limits.interactive_max_tokens
    if num_prompt_tokens <= limits.interactive_max_prompt_tokens and short_answer:
        return INTERACTIVE
    return NORMAL
