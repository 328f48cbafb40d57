"""Lane classification: explicit priority, header, key default, then length."""

from __future__ import annotations

import pytest

from policies.classify import LaneThresholds, classify, parse_lane
from policies.multilevel import BACKGROUND, INTERACTIVE, NORMAL

LIMITS = LaneThresholds(interactive_max_prompt_tokens=100, interactive_max_tokens=50, background_min_prompt_tokens=1000)


@pytest.mark.parametrize(("priority", "header", "key_default", "prompt", "max_tokens", "lane"), [
    (0, "background", 2, 5000, 9999, INTERACTIVE),  # the body's field wins over everything
    (-5, None, None, 10, 10, INTERACTIVE),  # clamped to the lanes
    (7, None, None, 10, 10, BACKGROUND),
    (None, "background", INTERACTIVE, 10, 10, BACKGROUND),  # then the header
    (None, "1", None, 10, 10, NORMAL),
    (None, None, BACKGROUND, 10, 10, BACKGROUND),  # then the API key's default
    (None, None, None, 10, 50, INTERACTIVE),  # then length: short prompt, short answer
    (None, None, None, 10, 51, NORMAL),
    (None, None, None, 10, None, NORMAL),  # "up to the context" is not a short answer
    (None, None, None, 101, 10, NORMAL),
    (None, None, None, 1000, 10, BACKGROUND),  # very long prompts run in the background lane
])
def test_classify(priority, header, key_default, prompt, max_tokens, lane):
    assert classify(priority, header, key_default, prompt, max_tokens, LIMITS) == lane


def test_bad_header_names_the_accepted_values():
    with pytest.raises(ValueError, match="interactive, normal, background"):
        parse_lane("urgent!")
    assert parse_lane(" Interactive ") == INTERACTIVE
