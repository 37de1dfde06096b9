"""Smoke tests of the command line: the demo runs on tiny sizes and prints its table and explain()."""

from __future__ import annotations

import pytest

from attnopt.__main__ import main


def test_demo_prints_before_after_table_and_explain(capsys):
    rc = main(["demo", "--seq-len", "32", "--layers", "2", "--heads", "2", "--embd", "32",
               "--repeats", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "attention sites found" in out and "rewritten" in out
    assert "max abs difference" in out and "peak tensor memory" in out
    assert "2 of 2 attention site(s) rewritten" in out  # explain() of the optimized model


def test_unknown_command_exits_with_usage(capsys):
    with pytest.raises(SystemExit):
        main(["fly"])
    assert "invalid choice" in capsys.readouterr().err
