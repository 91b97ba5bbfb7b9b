"""benchmarks/step_census.py: what every decoder layer dispatches, and what of it depends only on the step."""

import pytest

from benchmarks import step_census

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("device_plan", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_no_layer_recomputes_the_step(device_plan, fp8):
    rows = [step_census.census(batch, device_plan, fp8) for batch in (4, 32)]
    for row in rows:
        assert len(set(row["ops_per_layer"])) == 1, row["ops_per_layer"]  # every layer dispatches the same
        # rotary, k_scale, the token map, the plan's fit and the slots' check: once per step (begin_step)
        assert row["step_only_ops"] == {} and row["step_only_per_layer"] == [0] * row["layers"]
        assert row["ops"]["mla_ops.write_latent_cache"] == 1
    if device_plan:  # the device form's launches do not depend on the batch
        assert rows[0]["ops_per_layer"] == rows[1]["ops_per_layer"]


def test_main_writes_the_report(tmp_path):
    out = tmp_path / "census.json"
    rows = step_census.main(["--batches", "2", "--json", str(out)])
    assert len(rows) == 4 and out.read_text().startswith("{")


@pytest.mark.parametrize("device_plan", [False, True])
def test_a_sparse_step_runs_the_suffix_attention_over_its_dense_routed_tokens_only(device_plan):
    """Issue 39 item 4: the sparse attention attends a sparse request's own new keys and overwrites its rows,
    so every layer's suffix attention attends the dense-routed tokens only. On the sparse path (masked_mha_ratio
    0): the masked-MHA route, eager CPU only, gathers each request's rows per layer (its step-only ops, counted
    in the census's default run)."""
    row = step_census.census(32, device_plan, fp8=False, layers=2, dsa=True, masked_mha_ratio=0)
    assert 0 < row["dense_routed_tokens"] < row["tokens"]
    assert row["suffix_tokens_per_layer"] == [row["dense_routed_tokens"]] * 2
    assert len(set(row["ops_per_layer"])) == 1
    # the top-k rows' check reads the step's token map, made once (begin_step), not per layer
    assert row["step_only_ops"] == {} and row["step_only_per_layer"] == [0] * 2
