import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

# A fresh Inductor cache per test session: a warm cache can return stale code after a lowering
# or an op body changes (the FX-graph cache keys on op names only).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mla_ops_inductor_"))

# Examples per property test that takes its count from the profile (the planner tests): "ci"
# keeps `make test` quick (six such runs, about 300 examples in all); "long" (`make test-long`,
# HYPOTHESIS_PROFILE=long) searches far wider.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=50, **_COMMON)
settings.register_profile("long", max_examples=5000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _grad_mode_kept():
    """A benchmark's ``main()`` run in-process switches gradients off for good (its process is its
    own when run from the shell): every test starts in the grad mode the session started in."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)
