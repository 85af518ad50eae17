"""`harness serve --switch-interval-ms`: the server process's GIL switch interval (`ServerConfig`)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator

import pytest

from harness.server import app
from harness.server.cli import _configure_parser
from harness.server.state import ServerConfig


@pytest.fixture
def restore_switch_interval() -> Iterator[None]:
    interval = sys.getswitchinterval()
    yield
    sys.setswitchinterval(interval)


def test_the_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    _configure_parser(parser)
    assert parser.parse_args(["m", "--switch-interval-ms", "0.25"]).switch_interval_ms == 0.25
    assert parser.parse_args(["m"]).switch_interval_ms is None


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_a_zero_negative_or_nan_interval_is_refused_with_its_name(value):
    with pytest.raises(ValueError, match="switch_interval_ms must be positive"):
        ServerConfig(model="m", switch_interval_ms=value)


class _Loaded(Exception):
    pass


def interval_when_loading(monkeypatch, config: ServerConfig) -> float:
    """The switch interval `serve(config)` has set by the time it loads the model (stopped right there)."""
    seen: list[float] = []

    def load(config: ServerConfig) -> None:
        seen.append(sys.getswitchinterval())
        raise _Loaded

    monkeypatch.setattr(app.ServerState, "load", staticmethod(load))
    with pytest.raises(_Loaded):
        app.serve(config)
    return seen[0]


@pytest.mark.parametrize("interval_ms", [0.25, 2.0])
def test_serve_sets_the_interval_before_the_model_loads(monkeypatch, restore_switch_interval, interval_ms):
    config = ServerConfig(model="m", switch_interval_ms=interval_ms)
    assert interval_when_loading(monkeypatch, config) == pytest.approx(interval_ms / 1000)


def test_without_the_flag_serve_leaves_the_interval_alone(monkeypatch, restore_switch_interval):
    sys.setswitchinterval(0.007)
    assert interval_when_loading(monkeypatch, ServerConfig(model="m")) == pytest.approx(0.007)
