"""The batch-column baseline, the scheduler model and the trace replay (benchmarks/), on small
hand-checked inputs."""

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks._lib.trace import DEFAULT_TRACE, REPO_ROOT, load_trace, simulate
from benchmarks.batch_column import batch_column_chunks, batch_column_schedule

pytestmark = pytest.mark.bench


# --- batch column --------------------------------------------------------------------------------


def test_batch_column_pr_headline_case():
    # vLLM PR #50613: one long request among 31 short ones; 65536 // 32 = 2048 rows per request
    # per chunk, ceil(60000 / 2048) = 30 chunks.
    context_lens = [60000] + [16] * 31
    assert batch_column_chunks(context_lens, 65536) == 30
    starts, seq_lens = batch_column_schedule(context_lens, 65536)
    assert starts.shape == seq_lens.shape == (30, 32)
    assert seq_lens[:, 0].tolist() == [2048] * 29 + [60000 - 29 * 2048]
    assert seq_lens[0, 1:].tolist() == [16] * 31 and not seq_lens[1:, 1:].any()


def test_batch_column_small_case_by_hand():
    # Two requests with context share W=4 -> 2 rows each per chunk; ceil(5 / 2) = 3 chunks.
    starts, seq_lens = batch_column_schedule([5, 0, 3], 4)
    assert starts.tolist() == [[0, 0, 0], [2, 0, 2], [4, 0, 3]]
    assert seq_lens.tolist() == [[2, 0, 2], [2, 0, 1], [1, 0, 0]]
    assert batch_column_chunks([5, 0, 3], 4) == 3


@pytest.mark.parametrize(
    "context_lens, workspace_size, split_alignment, expected",
    [
        ([0, 0], 4, 1, 0),  # no context, no chunks
        ([], 4, 1, 0),
        ([7], 7, 1, 1),
        ([8], 7, 1, 2),
        ([1000, 1000, 1000], 4096, 64, 1),  # 4096 // 3 = 1365 -> 1344
        ([5000, 10], 4096, 512, 3),  # 2048 rows per request per chunk
        ([5000, 10], 4096, 1000, 3),  # 2048 -> 2000
    ],
)
def test_batch_column_chunk_counts(context_lens, workspace_size, split_alignment, expected):
    assert batch_column_chunks(context_lens, workspace_size, split_alignment) == expected
    starts, seq_lens = batch_column_schedule(context_lens, workspace_size, split_alignment)
    assert seq_lens.shape == (expected, len(context_lens))


def test_batch_column_schedule_tiles_every_context():
    rng = np.random.default_rng(0)
    for _ in range(50):
        context_lens = rng.integers(0, 3000, size=rng.integers(1, 20)) * rng.integers(0, 2, size=1)
        workspace_size = int(rng.integers(64, 8192))
        starts, seq_lens = batch_column_schedule(context_lens, workspace_size)
        assert (seq_lens.sum(axis=0) == context_lens).all()
        assert (seq_lens.sum(axis=1) <= workspace_size).all()
        assert (starts[1:] == starts[:-1] + seq_lens[:-1]).all()  # contiguous, in order
        assert (starts + seq_lens <= context_lens).all()


@pytest.mark.parametrize(
    "context_lens, workspace_size",
    [([6000] + [16] * 15, 1024), ([60000] + [16] * 31, 65536), ([5, 0, 3], 4), ([0, 7], 7), ([0, 0], 8), ([9] * 9, 8)],
)
def test_demo_batch_column_count_equals_the_baseline(context_lens, workspace_size):
    # The demo computes the old schedule's count itself (the library never imports benchmarks/).
    from mla_ops.demo import batch_column_count

    try:
        _, seq_lens = batch_column_schedule(context_lens, workspace_size)
    except ValueError:  # fewer rows than requests with context
        assert batch_column_count(context_lens, workspace_size) == (None, None)
        return
    count, use = batch_column_count(context_lens, workspace_size)
    if seq_lens.shape[0] == 0:
        assert count is None
        return
    assert count == seq_lens.shape[0]
    assert use == pytest.approx(seq_lens.sum() / (count * workspace_size))


def test_batch_column_rejects_a_workspace_too_small_for_the_batch():
    with pytest.raises(ValueError, match="workspace_size"):
        batch_column_chunks([10] * 5, 4)  # 4 // 5 == 0
    with pytest.raises(ValueError, match="workspace_size"):
        batch_column_chunks([10, 10], 1024, split_alignment=1000)  # 512 rounds down to 0
    with pytest.raises(ValueError, match="context_lens"):
        batch_column_chunks([3, -1], 1024)
    with pytest.raises(ValueError, match="split_alignment"):
        batch_column_chunks([3], 1024, split_alignment=0)


# --- scheduler simulation ------------------------------------------------------------------------


def _write_trace(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _toy_trace(tmp_path):
    return _write_trace(
        tmp_path / "toy.jsonl",
        [
            {"timestamp": 0, "input_length": 1200, "output_length": 2, "hash_ids": [1, 2, 3]},
            {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 4]},
            {"timestamp": 10000, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 5]},
            {"timestamp": 20000, "input_length": 1024, "output_length": 0, "hash_ids": [1, 2]},
            # Same ids behind a different prefix: not a cache hit (chains, not single ids).
            {"timestamp": 30000, "input_length": 1100, "output_length": 0, "hash_ids": [9, 2, 6]},
        ],
    )


def test_simulated_scheduler_by_hand(tmp_path):
    steps = list(simulate(load_trace(_toy_trace(tmp_path)), token_budget=1000, max_running=8))
    got = [(s.t_ms, s.context_lens, s.query_lens, s.num_decodes) for s in steps]
    assert got == [
        # r0 takes the whole budget; r1 must wait (no budget left).
        (0.0, [0], [1000], 0),
        # r0 finishes (chunked prefill); r1 reuses block 0 that r0 completed in step 0.
        (50.0, [1000, 512], [200, 588], 0),
        # Idle until t=10000 (two decode steps in between are not prefill steps); both of the
        # shared blocks are cached now.
        (10000.0, [1024], [76], 0),
        # Fully cached 2-block prompt: the last block is recomputed, never the whole prompt cached.
        (20000.0, [512], [512], 0),
        (30000.0, [0], [1000], 0),
        (30050.0, [1000], [100], 0),
    ]


def test_simulated_scheduler_max_running_and_decodes(tmp_path):
    steps = list(simulate(load_trace(_toy_trace(tmp_path), limit=2), token_budget=1000, max_running=1))
    got = [(s.t_ms, s.context_lens, s.query_lens, s.num_decodes) for s in steps]
    # r1 is admitted only after r0 has decoded its 2 tokens (steps at 100 and 150 ms) and left;
    # by then r0's first two blocks are cached.
    assert got == [(0.0, [0], [1000], 0), (50.0, [1000], [200], 0), (200.0, [1024], [76], 0)]


# --- replay end to end ---------------------------------------------------------------------------


def _check_replay_json(result, workspace_sizes):
    policies = ("batch_column", "whole_requests", "packed", "vllm_upstream")
    assert result["chunks_by_workspace_order"] == list(policies)
    for key in ("trace", "workspace_size", "token_budget", "max_running", "totals", "by_workspace", "routing",
                "steps"):
        assert key in result, key
    assert "planner_us_median" not in result  # planner time is planner_bench's
    assert result["workspace_size"] == workspace_sizes[0]
    assert set(result["by_workspace"]) == {str(w) for w in workspace_sizes}
    assert result["steps"]
    for w in workspace_sizes:
        entry = result["by_workspace"][str(w)]
        assert set(entry["totals"]) == set(policies)
        assert set(entry["steps_needing_multiple_chunks"]) == set(policies)
        for i, p in enumerate(policies):
            assert entry["totals"][p] == sum(s["chunks_by_workspace"][str(w)][i] for s in result["steps"])
    assert result["totals"] == result["by_workspace"][str(workspace_sizes[0])]["totals"]
    for step in result["steps"]:
        assert len(step["context_lens"]) == len(step["query_lens"]) >= 1
        assert min(step["query_lens"]) >= 1
        assert step["chunks"] == dict(zip(policies, step["chunks_by_workspace"][str(workspace_sizes[0])]))
        for w in workspace_sizes:
            bc, wr, pk, up = step["chunks_by_workspace"][str(w)]
            # With split_alignment 1, packed reaches the lower bound: it is never worse.
            assert pk == -(-sum(step["context_lens"]) // w)
            assert pk <= wr and pk <= bc
            # vLLM upstream's tail split: between packed and vLLM PR #50613 (= whole_requests).
            assert pk <= up <= wr


def test_replay_cli_on_a_synthetic_trace(tmp_path):
    from benchmarks.trace_replay import main

    rng = np.random.default_rng(1)
    records, next_id = [], 0
    for i in range(60):  # conversations that grow: later turns extend earlier prompts
        if i % 3 and records:
            base = records[int(rng.integers(len(records)))]
            ids = list(base["hash_ids"])
        else:
            ids = []
        extra = int(rng.integers(1, 12))
        ids += list(range(next_id, next_id + extra))
        next_id += extra
        records.append({"timestamp": 30 * i, "input_length": 512 * len(ids) - int(rng.integers(0, 500)),
                        "output_length": int(rng.integers(0, 20)), "hash_ids": ids})
    trace = _write_trace(tmp_path / "synthetic.jsonl", records)
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    main(["--trace", str(trace), "--json", str(out), "--plot", str(png), "--no-progress",
          "--token-budget", "2048", "--workspace-sizes", "4096,1024,256"])
    result = json.loads(out.read_text())
    _check_replay_json(result, [4096, 1024, 256])
    assert result["num_requests"] == 60
    assert sum(sum(s["context_lens"]) > 0 for s in result["steps"]) > 10  # cache hits happened
    assert png.stat().st_size > 10_000


def test_replay_cli_on_the_real_trace_prefix(tmp_path):
    # The Mooncake trace ships in the repository (benchmarks/traces/) and is the default.
    assert DEFAULT_TRACE.is_relative_to(REPO_ROOT) and DEFAULT_TRACE.stat().st_size > 1_000_000
    out = tmp_path / "out.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.trace_replay", "--json", str(out), "--limit", "200", "--no-progress"],
        check=True, cwd=REPO_ROOT, capture_output=True,
    )
    result = json.loads(out.read_text())
    _check_replay_json(result, [65536, 16384, 4096])
    assert result["num_requests"] == 200 and result["trace"] == "benchmarks/traces/mooncake_conversation_trace.jsonl"
