"""Every benchmark's command line (``parallel_lib.bench.parse_config``): ``--quick`` picks the smoke run,
an option given replaces the configuration's field of the same name, an option left out changes nothing,
and a bad value is refused naming its flag."""

from dataclasses import dataclass

import pytest

from parallel_lib.bench import REPEATS, parse_config


@dataclass(frozen=True)
class Config:
    world_size: int = 2
    repeats: int = 9
    processes: bool = True


QUICK = Config(repeats=1)
OPTIONS = [("--world-size", {"type": int}), REPEATS,
           ("--no-processes", {"action": "store_false", "dest": "processes", "default": None})]


def parse(*argv):
    return parse_config(list(argv), "demo", "A demo benchmark.\n\nMore.", QUICK, Config, "a smoke run", OPTIONS)[0]


def test_quick_picks_the_smoke_run_and_options_replace_their_fields():
    assert parse() == Config()
    assert parse("--quick") == Config(repeats=1)
    assert parse("--quick", "--world-size", "4") == Config(world_size=4, repeats=1)
    assert parse("--repeats", "3", "--no-processes") == Config(repeats=3, processes=False)


def test_a_bad_value_names_its_flag(capsys):
    with pytest.raises(SystemExit):
        parse("--repeats", "0")
    assert "argument --repeats: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--world-size", "two")
    assert "--world-size" in capsys.readouterr().err
