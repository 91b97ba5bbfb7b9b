"""Benchmark reports that survive a kill: the JSON is rewritten after every configuration.

A GPU session is short and may end at any moment (a step's time limit, the machine handed
back), so a benchmark never keeps results only in memory: ``Report.add`` appends a row and
rewrites the file through a temporary file and ``os.replace``, so the file on disk is always a
whole JSON document, ``"complete": false`` until ``Report.finish``. Scripts that write their
result once, at the end, write it with ``write_json_atomic``.

Dry runs (``--dry-run``: CPU, tiny sizes, every code path of the GPU run but no GPU result) are
marked ``"dry_run": true`` and never write under ``benchmarks/results/``, where results go.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Sequence

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def dumps(obj: dict, one_line: Sequence[str] = ()) -> str:
    """``obj`` as indented JSON text, except the top-level entries named in ``one_line`` (lists or
    dicts): one compact line per item, so long per-step series stay small and greppable."""
    marks = {key: f"\x00{key}\x00" for key in one_line if key in obj}
    text = json.dumps({k: marks.get(k, v) for k, v in obj.items()}, indent=1)
    for key, mark in marks.items():
        value = obj[key]
        if isinstance(value, dict):
            items = [f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in value.items()]
            body = "{\n" + ",\n".join(items) + "\n }"
        else:
            body = "[\n" + ",\n".join(json.dumps(v, separators=(",", ":")) for v in value) + "\n]"
        text = text.replace(json.dumps(mark), body)
    return text + "\n"


def write_json_atomic(path: str | os.PathLike, obj: dict, one_line: Sequence[str] = ()) -> None:
    """Write ``obj`` as JSON to ``path`` (``dumps``): readers see the old file or the new one, never
    half of one. The folder is made if missing."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    text = dumps(obj, one_line)  # before the temporary file: a value JSON cannot hold leaves nothing behind
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is read by whoever fetches it
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def under_results_dir(path: str) -> bool:
    results = os.path.realpath(RESULTS_DIR)
    return os.path.commonpath([os.path.realpath(path), results]) == results


def output_path(path: str | None, dry_run: bool, name: str) -> str | None:
    """Where a report goes: ``path`` as given; for a dry run, a new temporary folder when ``path``
    is None, and never a path under ``benchmarks/results/`` (SystemExit)."""
    if not dry_run:
        return path
    if path is None:
        return os.path.join(tempfile.mkdtemp(prefix="mla_ops_dry_run_"), name)
    if under_results_dir(path):
        raise SystemExit(f"--dry-run writes no result under {RESULTS_DIR}: got {path}")
    return path


def machine(device: torch.device) -> dict:
    """The header fields every GPU benchmark report starts with: the device's name and torch's version."""
    return dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__)


class Report:
    """One benchmark's JSON report: a header, rows added one at a time, a closing summary."""

    def __init__(self, path: str | None, header: dict, dry_run: bool):
        self.path = path
        self.data = dict(header, dry_run=dry_run, complete=False, results=[])
        self.flush()

    @property
    def results(self) -> list:
        return self.data["results"]

    def add(self, row: dict) -> None:
        self.data["results"].append(row)
        self.flush()

    def finish(self, **summary) -> dict:
        self.data.update(summary, complete=True)
        self.flush()
        return self.data

    def flush(self) -> None:
        if self.path:
            write_json_atomic(self.path, self.data)
