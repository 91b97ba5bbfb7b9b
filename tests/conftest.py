import os
import tempfile

# A fresh Inductor cache per test session: a warm cache can return stale code after a lowering
# or an op body changes (the FX-graph cache keys on op names only).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mla_ops_inductor_"))
