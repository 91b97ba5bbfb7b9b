"""benchmarks/step_census.py on the Triton path: each kernel launch counts as one op."""

import pytest

from benchmarks import step_census


@pytest.mark.parametrize("device_plan", [False, True])
def test_no_layer_recomputes_the_step_on_the_triton_path(device_plan):
    rows = [step_census.census(batch, device_plan, fp8=device_plan, layers=2, backend="triton") for batch in (4, 16)]
    for row in rows:
        assert len(set(row["ops_per_layer"])) == 1, row["ops_per_layer"]
        assert row["step_only_ops"] == {}, "checks and step tensors belong to begin_step"
        launches = {name for name in row["ops"] if name.startswith("triton.")}
        assert {"triton._attn_fwd", "triton._absorbed_fwd", "triton._merge_attn_states_kernel"} <= launches
    if device_plan:  # the device form launches the same kernels for every batch
        assert rows[0]["ops"] == rows[1]["ops"]
