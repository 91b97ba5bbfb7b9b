"""``python -m mla_ops --help`` (mla_ops/__main__.py): a real help, not a bare usage line."""

import os
import subprocess
import sys

import pytest

from mla_ops.__main__ import COMMANDS, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_names_every_command_and_what_it_does(capsys, flag):
    with pytest.raises(SystemExit) as exit_:
        main([flag])
    out = capsys.readouterr()
    assert exit_.value.code == 0 and out.err == ""
    lines = out.out.splitlines()
    assert lines[0].startswith("usage: python -m mla_ops {demo,generate}")
    assert len(lines) > 5, "a bare usage line"
    for command in COMMANDS:  # each command on a line of its own, with a description beside it
        described = [line for line in lines if line.startswith(f"  {command} ")]
        assert described and len(described[0].split()) > 4, command
    assert "python -m mla_ops COMMAND --help" in out.out


def test_help_from_a_real_process():
    done = subprocess.run([sys.executable, "-m", "mla_ops", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0 and done.stderr == ""
    assert "commands:" in done.stdout and "  generate " in done.stdout and "  demo " in done.stdout
