"""The rank launcher: a failing rank takes the others down; a hang hits the timeout."""

from __future__ import annotations

import os
import sys
import time

import pytest

from spdkfac.bench.launch import run_ranks


def _python(code: str) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, "-c", code], dict(os.environ)


def test_a_failing_rank_kills_the_others_and_shows_its_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    began = time.monotonic()
    code = run_ranks(
        [
            _python("import time; time.sleep(60)"),
            _python("import sys; sys.stderr.write('boom on rank 1\\n'); sys.exit(3)"),
        ],
        timeout=50,
    )
    assert code == 3
    assert time.monotonic() - began < 20  # rank 0 was killed, not waited for
    err = capsys.readouterr().err
    assert "rank 1 exited with code 3" in err and "boom on rank 1" in err


def test_the_timeout_kills_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    sleeper = _python("import sys, time; sys.stderr.write('still here\\n'); time.sleep(60)")
    began = time.monotonic()
    assert run_ranks([sleeper, sleeper], timeout=2) == 1
    assert time.monotonic() - began < 15
    err = capsys.readouterr().err
    assert "timed out after 2 s" in err and err.count("still here") >= 2


def test_success_returns_zero() -> None:
    assert run_ranks([_python("pass"), _python("pass")], timeout=30) == 0
