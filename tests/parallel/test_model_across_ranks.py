"""The model across ranks (DESIGN §10, "End to end"): DeepSeek checkpoints sharded over D gloo processes
on CPU give every rank one process's greedy tokens and logits (tests/support/tp_worker.py has the cases).

The checkpoints (tiny V2-Lite-style, V3-style, and V3 in DeepSeek's fp8 release layout: MoE, q LoRA,
YaRN) and one process's results are written here, once; each world size is one launch of D worker
processes running all its cases (``test_context_parallel.launch``: stopped at the first failure or the
deadline, so no process outlives the test).
"""

import pytest
import torch

from tests.parallel.test_context_parallel import launch
from tests.support import tp_worker

pytest.importorskip("transformers")
from tests.support.hf_checkpoints import make_hf_model, save_release_fp8  # noqa: E402

WORKER = "tests.support.tp_worker"
# Interleave 1 and 4 at both world sizes; V2-Lite-style and the fp8 release layout at both (the
# V3-style checkpoint saved by transformers at D = 2, through PrefillGraphs too).
CASES = {2: ["v2_i1", "v3_i4", "graphs_v3_i4", "errors", "disagreement"],
         4: ["v2_i4", "fp8_i1", "errors", "disagreement"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Checkpoints and one process's results (``tp_worker.reference``), in one directory."""
    root = tmp_path_factory.mktemp("across_ranks")
    for kind in ("v2", "v3"):
        make_hf_model(kind).save_pretrained(root / kind)
    save_release_fp8(make_hf_model("v3", seed=5), str(root / "fp8"), block=(16, 16))
    torch.save({kind: tp_worker.reference(str(root / kind)) for kind in tp_worker.KINDS}, root / "expected.pt")
    return str(root)


@pytest.fixture(scope="module")
def runs(data):
    cache = {}

    def get(world: int):
        if world not in cache:
            cache[world] = launch(world, CASES[world], timeout_s=180, worker=WORKER, env={"MLA_OPS_TP_DATA": data})
        return cache[world]

    return get


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases])
def test_every_rank(runs, world, case):
    run = runs(world)
    for rank in range(world):
        result = run.results.get((case, rank))
        assert result is not None and "error" not in result, run.report(case, rank)

