"""A pipeline in a ``with`` block closes on SIGTERM (else mp engine cores outlive the process)."""

from __future__ import annotations

import os
import signal

import pytest

from omnigen import api
from omnigen.serving.pipeline import Pipeline


def empty_pipeline(closed: list[str]) -> Pipeline:
    pipe = Pipeline(api.served_model("omnigen_tiny"), [], "inproc")
    pipe.close = lambda: closed.append("closed")  # the engines' shutdown is the e2e tests' part
    return pipe


def test_sigterm_inside_the_block_unwinds_through_close():
    closed: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info, empty_pipeline(closed):
        os.kill(os.getpid(), signal.SIGTERM)
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert closed == ["closed"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_handler_it_replaced_is_back_after_a_normal_exit():
    closed: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    with empty_pipeline(closed):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert closed == ["closed"] and signal.getsignal(signal.SIGTERM) is before
