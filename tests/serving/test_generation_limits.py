"""``Generator`` at its limits (mla_ops/serving/generation.py):

* a ``max_new_tokens`` (or a fixed ``num_blocks``) whose cache would pass the device's memory or the block
  table's int32 ids is refused by name before anything changes, at once (not after growing the bookkeeping
  to billions of blocks); the next call works;
* an allocation that fails anyway leaves the Generator as it was: ``cache_usage`` matches the cache tensor,
  and the next call gives the right tokens;
* a call that may reach a position past ``max_position_embeddings`` runs, with one warning naming the limit.

The calls that ask for absurd caches run in a child process under an address-space limit (``RLIMIT_AS``), so
that a regression fails there (a MemoryError or RuntimeError) instead of filling the machine's memory.
"""

import dataclasses
import json
import subprocess
import sys
import warnings

import pytest
import torch

import mla_ops
from tests.support.batches import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [[1, 2, 3]]

# Runs each case in one process, under 1 GiB more address space than it has after the first call; prints
# one JSON line per case: the error (type and message) or None, the cache usage before and after, whether
# the cache tensor still matches the usage, and whether the next call gave the first call's tokens.
CHILD = """
import json, resource, sys, torch
sys.path.insert(0, ROOT)
import mla_ops
from mla_ops._env import available_memory
from tests.support.batches import tiny_model

torch.set_num_threads(1)
model = tiny_model()
one_block = sum(t.numel() * t.element_size() for t in model.allocate_kv_caches(1, 16).tensors)
generator = mla_ops.Generator(model)
expected = generator.generate([[1, 2, 3]], 4)
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30 if hard == resource.RLIM_INFINITY else min(vm + 2**30, hard), hard))
CASES = {
    "past the memory": lambda: generator.generate([[1, 2, 3]], 2 * available_memory(torch.device("cpu")) //
                                                  one_block * 16, eos_token_id=5),
    "past int32 block ids": lambda: generator.generate([[1, 2, 3]], 10**12, eos_token_id=5),
    "an allocation that fails": lambda: generator.generate([[1, 2, 3]], 3 * 2**30 // one_block * 16),
    "num_blocks past int32 block ids": lambda: mla_ops.Generator(model, num_blocks=10**12),
    "num_blocks past the memory": lambda: mla_ops.Generator(model, num_blocks=2**30),
}
for name, call in CASES.items():
    before = tuple(generator.cache_usage)
    try:
        call()
        error = None
    except Exception as e:
        error = [type(e).__name__, str(e)]
    after = tuple(generator.cache_usage)
    fits = generator.cache_usage.total == generator.kv_caches.tensors[0].shape[0]
    try:
        next_call = generator.generate([[1, 2, 3]], 4) == expected
    except Exception as e:
        next_call = repr(e)
    print(json.dumps(dict(case=name, error=error, before=before, after=after, fits=fits, next_call=next_call)),
          flush=True)
"""


@pytest.fixture(scope="module")
def outcomes():
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_AS and /proc: Linux")
    root = __file__.rsplit("/tests/", 1)[0]
    try:  # about 10 s; a call that hangs (as growing the bookkeeping to 6e10 blocks did) ends the child
        result = subprocess.run([sys.executable, "-c", f"ROOT = {root!r}\n" + CHILD], capture_output=True,
                                text=True, timeout=180)
        stdout, output = result.stdout, result.stdout + result.stderr
    except subprocess.TimeoutExpired as e:
        stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        output = stdout + "\n(the child timed out)"
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {line["case"]: line for line in lines}, output


def outcome(outcomes, case):
    by_case, output = outcomes
    assert case in by_case, output
    return by_case[case]


@pytest.mark.parametrize("case, words", [
    ("past the memory", r"max_new_tokens=\d+ with these prompts needs a cache of \d+ blocks of 16 rows "
                        r"\(.* GiB\), more than the .* GiB available on cpu"),
    ("past int32 block ids", r"max_new_tokens=1000000000000 with these prompts needs a cache of 62500000001 blocks, "
                             r"past the int32 block ids"),
])
def test_a_max_new_tokens_the_cache_cannot_hold_is_refused_before_anything_changes(outcomes, case, words):
    got = outcome(outcomes, case)
    assert got["error"] is not None and got["error"][0] == "ValueError", got
    assert __import__("re").search(words, got["error"][1]), got["error"][1]
    assert got["after"] == got["before"] and got["fits"] and got["next_call"] is True, got


def test_a_failed_allocation_leaves_the_generator_usable(outcomes):
    """A cache of about 3 GiB under 1 GiB of address space: torch's allocation fails, after the checks."""
    got = outcome(outcomes, "an allocation that fails")
    assert got["error"] is not None and got["error"][0] == "RuntimeError", got
    assert got["after"] == got["before"] and got["fits"] and got["next_call"] is True, got


@pytest.mark.parametrize("case, words", [
    ("num_blocks past int32 block ids", "num_blocks=1000000000000 needs a cache of 1000000000000 blocks, past the "
                                        "int32 block ids"),
    ("num_blocks past the memory", "num_blocks=1073741824 needs a cache of 1073741824 blocks of 16 rows"),
])
def test_a_num_blocks_past_the_memory_is_refused_at_once(outcomes, case, words):
    got = outcome(outcomes, case)
    assert got["error"] == ["ValueError", got["error"][1]] and words in got["error"][1], got


def test_generating_past_max_position_embeddings_warns_once():
    model = tiny_model()
    expected = mla_ops.Generator(model).generate(PROMPT, 4)
    short = mla_ops.MLAForCausalLM(dataclasses.replace(model.config, max_position_embeddings=5))
    short.load_state_dict(model.state_dict())
    generator = mla_ops.Generator(short.eval())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generator.generate(PROMPT, 3)  # positions 0..4: the last new token is never fed back
    with pytest.warns(UserWarning, match=r"to position 5, past the model's max_position_embeddings=5") as record:
        assert generator.generate(PROMPT, 4) == expected  # it runs
    assert len([w for w in record if "max_position_embeddings" in str(w.message)]) == 1
