"""The documentation's examples run as written: every ```python block of README.md, in order, in
one shared namespace (a block may use what an earlier one defined), and likewise for
docs/integration.md, docs/api.md and docs/dsa.md. A block that raises, or whose assertion fails, fails the test with the
page's own line in the traceback, so an example cannot drift from the code.

The README's compiled example compiles a two-layer model with Inductor: the slow part, up to a
minute on two cores. The pages call ``mla_ops.enable()``, which stays on (it is idempotent, as
for the compile tests); the global RNG and Dynamo's caches are restored or reset around each page.
"""

from __future__ import annotations

import os
import re
import traceback

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "docs/integration.md", "docs/api.md", "docs/dsa.md"]
# Pages whose python blocks are not run here, and why (a new page must be run or listed with its reason).
NOT_RUN = {
    "docs/compile-and-graphs.md": "its examples load a checkpoint directory (path = ...)",
    "docs/context-parallel.md": "its examples run under torchrun (an initialized process group)",
    "docs/design.md": "the design reference: signature blocks (SyntaxError as Python)",
    "docs/models.md": "its examples load a checkpoint directory",
    "docs/vllm.md": "its script starts vLLM on two ranks: tests/integrations/vllm/test_docs.py runs it (make test-vllm)",
}
BLOCK = re.compile(r"^```python\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)


def python_blocks(page: str) -> list[tuple[int, str]]:
    """``(first line, source)`` of each ```python block of ``page``, in order."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def run_block(page: str, line: int, source: str, namespace: dict) -> str | None:
    """Run one block in ``namespace``; the traceback if it raised, else None. The source is padded
    to its line, so the traceback names the page's file and line."""
    code = compile("\n" * (line - 1) + source, os.path.join(ROOT, page), "exec")
    try:
        exec(code, namespace)
    except Exception:
        return traceback.format_exc()
    return None


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no ```python block"
    namespace = {"__name__": "__main__"}
    torch._dynamo.reset()  # the compiled example starts from a clean slate
    try:
        with torch.random.fork_rng():  # the pages seed the global RNG; other tests keep theirs
            for line, source in blocks:
                failure = run_block(page, line, source, namespace)
                if failure is not None:
                    pytest.fail(f"the python block at {page}:{line} raised:\n{failure}", pytrace=False)
    finally:
        torch._dynamo.reset()  # and leaves none of its compiled code behind


def test_every_block_is_found():
    """The parser sees every fenced python block: none is skipped by a formatting slip."""
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            fences = len(re.findall(r"^```python\s*$", f.read(), re.MULTILINE))
        assert len(python_blocks(page)) == fences, page


def test_api_page_lists_every_public_name():
    """docs/api.md's "Public names" is ``mla_ops.__all__``, no more and no less."""
    import mla_ops

    with open(os.path.join(ROOT, "docs/api.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Public names"):]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    listed = set(re.findall(r"`(\w+)`", section.split(":", 1)[1])) - {"__all__"}
    assert listed == set(mla_ops.__all__), (sorted(listed - set(mla_ops.__all__)), sorted(set(mla_ops.__all__) - listed))


def test_every_page_with_python_blocks_is_run_or_says_why_not():
    docs = sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
    with_blocks = {page for page in docs if python_blocks(page)}
    assert with_blocks <= set(PAGES) | set(NOT_RUN), sorted(with_blocks - set(PAGES) - set(NOT_RUN))
    assert not set(NOT_RUN) & set(PAGES)
