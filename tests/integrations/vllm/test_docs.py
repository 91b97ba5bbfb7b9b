"""docs/vllm.md's opening script runs as written (``make test-vllm``; skipped without vLLM): the page's first
```python block, saved under the name its first line gives and run with the command that line gives, on the
tiny checkpoint (with a character-level tokenizer, so its text prompts tokenize): two ranks on the CPU, prefix
caching and chunked prefill on, the plugin enabled.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm.engine import write_tokenizer  # noqa: E402
from tests.integrations.vllm.harness import ROOT, rewrite_config  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "vllm.md")
BLOCK = re.compile(r"^```python\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)


def opening_script() -> str:
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    found = BLOCK.search(text)
    assert found and found.start() < text.index("\n## "), "docs/vllm.md must open with its script"
    return found.group(1)


def test_the_opening_script_runs_as_written(checkpoint, tmp_path):
    script = opening_script()
    # "# serve.py: MLA_OPS_VLLM=1 python serve.py /path/to/model   (...)": the file name, then the command.
    name, command = re.match(r"# (\S+\.py): (.*?python \S+\.py \S+)", script.splitlines()[0]).groups()
    words = shlex.split(command)
    env_words = [w for w in words[: words.index("python")] if "=" in w]
    assert env_words == ["MLA_OPS_VLLM=1"] and words[words.index("python") + 1] == name
    (tmp_path / name).write_text(script)
    model = rewrite_config(checkpoint[0], str(tmp_path / "model"))
    write_tokenizer(model)
    env = dict(os.environ, **dict(w.split("=", 1) for w in env_words), VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run([sys.executable, name, model], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "(Worker_TP0" in log and "MLA prefills on mla-ops" in log, log[-4000:]  # on two ranks, the plugin on
    waves = re.findall(r"^wave (\d): (\d+) cached tokens, then '", done.stdout, re.MULTILINE)
    assert [w for w, _ in waves] == ["1"] * 3 + ["2"] * 3, done.stdout
    cached = [int(c) for _, c in waves]
    assert cached[0] == 0 and all(c >= 16 for c in cached[3:]), cached  # wave 2: the shared prefix from the cache
