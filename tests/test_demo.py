"""``make demo``'s compiled part, run as the demo runs it: its step closes over plain ints (``max_chunks``,
``workspace_size``, ``block_size``) and is compiled whole with ``dynamic=True``."""

import torch

from mla_ops import demo


def test_the_demo_compiled_step_runs_to_the_end_in_one_graph(capsys):
    with torch.no_grad():
        rows = demo.compiled_demo()
    assert len(rows) == 4 and "compiled in" in capsys.readouterr().out
    for context_lens, graphs, error in rows:
        assert graphs == 1, context_lens  # one graph serves every batch of the bucket
        assert error < 1e-5, (context_lens, error)
