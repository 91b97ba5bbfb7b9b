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

# Under pytest-xdist (`make test` runs `-n 2`) the workers share the cores: each worker, and every
# process it starts, gets its share of intra-op threads. Two workers of two threads each on 2 cores
# spin against each other: the main suite took 297 s instead of 238-252 s, with a fifth more CPU time.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


@pytest.fixture(autouse=True)
def _grad_mode_kept():
    """A benchmark's ``main()`` run in-process switches gradients off for good (its process is its
    own when run from the shell): every test starts in the grad mode the session started in."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


@pytest.fixture(autouse=True)
def _threads_kept():
    """Likewise the intra-op thread count, which several benchmarks' ``main()`` set for good."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
