"""Lane classification: explicit priority, header, key default, then length; and what an API key allows."""

from __future__ import annotations

import pytest

from policies.classify import LaneNotAllowed, LaneThresholds, classify, key_lane, parse_lane
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


NORMAL_UP = frozenset({NORMAL, BACKGROUND})


@pytest.mark.parametrize(("asked", "ceiling", "allowed", "lane"), [
    (None, None, None, None),  # a key that sets nothing: the length decides
    (INTERACTIVE, None, None, INTERACTIVE),
    (None, BACKGROUND, None, BACKGROUND),  # the key's priority is the default...
    (INTERACTIVE, BACKGROUND, None, BACKGROUND),  # ...and the most urgent its requests get
    (NORMAL, BACKGROUND, None, BACKGROUND),
    (BACKGROUND, NORMAL, None, BACKGROUND),  # a less urgent lane is theirs to ask for
    (NORMAL, NORMAL, None, NORMAL),
    (None, None, NORMAL_UP, BACKGROUND),  # lanes without a priority: the least urgent listed by default
    (None, NORMAL, NORMAL_UP, NORMAL),  # with one: the priority
    (NORMAL, None, NORMAL_UP, NORMAL),
    (INTERACTIVE, BACKGROUND, frozenset({INTERACTIVE, BACKGROUND}), INTERACTIVE),  # listed: not clamped
])
def test_key_lane(asked, ceiling, allowed, lane):
    assert key_lane(asked, ceiling, allowed) == lane


def test_key_lane_refuses_an_unlisted_lane_naming_the_allowed_ones():
    message = "the interactive lane is not one of this API key's lanes: normal, background"
    with pytest.raises(LaneNotAllowed, match=message) as err:
        key_lane(INTERACTIVE, NORMAL, NORMAL_UP)
    assert (err.value.lane, err.value.allowed) == (INTERACTIVE, NORMAL_UP)
    with pytest.raises(LaneNotAllowed, match="the background lane"):
        key_lane(BACKGROUND, None, frozenset({INTERACTIVE}))  # less urgent, but not listed either
