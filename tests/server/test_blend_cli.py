"""`kvreuse serve --blend-*` reach the engine config; a bad value is refused naming the flag."""

from __future__ import annotations

import pytest

from kvreuse.cli import _engine_config, build_parser
from kvreuse.engine.config import EngineConfig


def _args(*flags: str):
    return build_parser().parse_args(["serve", "--model", "tiny:llama", *flags])


def test_blend_flags_default_to_the_config_and_reach_it():
    config = _engine_config(_args())
    assert (config.blend_first_tokens, config.blend_ratio) == (EngineConfig.blend_first_tokens,
                                                               EngineConfig.blend_ratio) == (0, 0.0)
    config = _engine_config(_args("--blend-first-tokens", "8", "--blend-ratio", "0.15"))
    assert (config.blend_first_tokens, config.blend_ratio) == (8, 0.15)
    assert EngineConfig.blend_last_tokens == 0 and _engine_config(_args()).blend.last_tokens == 0
    config = _engine_config(_args("--blend-last-tokens", "2", "--blend-first-tokens", "1"))
    assert (config.blend.first_tokens, config.blend.ratio, config.blend.last_tokens) == (1, 0.0, 2)


@pytest.mark.parametrize("flags, name", [(("--blend-ratio", "1.5"), "--blend-ratio"),
                                         (("--blend-first-tokens", "-1"), "--blend-first-tokens"),
                                         (("--blend-last-tokens", "-1"), "--blend-last-tokens")])
def test_a_bad_blend_flag_is_refused_naming_it(flags, name):
    with pytest.raises(ValueError, match=name):
        _engine_config(_args(*flags))
