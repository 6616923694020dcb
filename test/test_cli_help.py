"""`tensegrity SUBCOMMAND --help` shows every option's default (the brief: help that shows defaults and units)."""
from __future__ import annotations

import argparse

import pytest

from tensegrity_ros import cli


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_every_option_with_a_default_shows_it(name):
    parser = cli._parser_for(name)
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, "", argparse.SUPPRESS, []):
            continue
        text = formatter._expand_help(action)
        if "default" not in text.lower():
            missing.append(action.option_strings[0])
    assert not missing, f"tensegrity {name}: --help states no default for {missing}"


def test_the_default_is_the_value_that_parsing_gives(capsys):
    """The shown default is argparse's own (not a copy that could drift): --dt and --max-iter as examples."""
    for name, flag, value in (("simulate", "--dt", "0.001"), ("identify", "--max-iter", "12")):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        body = out[out.index("options:"):]
        line = body[body.index(flag + " "):][:200]
        assert f"(default: {value})" in line, line
        action = next(a for a in cli._parser_for(name)._actions if flag in a.option_strings)
        assert str(action.default) == value
