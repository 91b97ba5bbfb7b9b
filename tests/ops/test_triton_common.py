"""The launch guard every Triton launcher runs under (``mla_ops/triton/_common.py``), without the interpreter.

On CPU tensors without ``TRITON_INTERPRET=1`` each launcher says what to do before Triton sees
the tensors; the kernels themselves are checked in ``tests/interpreter`` and, on a GPU, ``tests/ops``.
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("checks the launchers without Triton's interpreter", allow_module_level=True)

from mla_ops.triton import _common, absorbed, attention, gather, merge, rows_gemm  # noqa: E402


def launches():
    """Each launcher with small CPU arguments of its contract."""
    q, kv = torch.randn(3, 2, 12), torch.randn(4, 2, 16)
    qsl, ctx = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    out, lse = torch.empty(3, 2, 8), torch.empty(2, 3)
    cache, table = torch.randn(2, 4, 20), torch.tensor([[0], [1]], dtype=torch.int32)
    return {
        "gather": lambda: gather.gather_context(cache, table, qsl, ctx, None, torch.empty(8, 20)),
        "up_project": lambda: rows_gemm.up_project(torch.randn(8, 16), torch.randn(32, 16), qsl,
                                                       torch.empty(8, 32)),
        "context_attention": lambda: attention.context_attention(
            q, kv[..., :8], torch.randn(4, 4), kv[..., 8:], qsl, qsl, ctx, 0.1, out, lse),
        "suffix_attention": lambda: attention.suffix_attention(q, kv[..., :8], torch.randn(3, 4), kv[..., 8:], qsl,
                                                               0.1, out, lse),
        "merge": lambda: merge.merge_attn_states(out, lse, out, lse),
        "absorbed": lambda: absorbed.absorbed_context_attention(
            q, cache, table, qsl, ctx, torch.randn(2 * 16, 16), 0.1, None, out, lse),
    }


@pytest.mark.parametrize("name", sorted(launches()))
def test_cpu_tensors_without_the_interpreter_are_refused(name):
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        launches()[name]()


def test_the_guard_yields_where_the_launch_runs(monkeypatch):
    with pytest.raises(RuntimeError, match="got cpu tensors"):
        with _common.device_guard(torch.empty(1)):
            pass
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with _common.device_guard(torch.empty(1)) as interpreted:
        assert interpreted is True
    with pytest.raises(RuntimeError, match="meta"):
        with _common.device_guard(torch.empty(1, device="meta")):
            pass


def test_dot_dtypes():
    import triton.language as tl

    assert _common.dot_dtype(torch.bfloat16, False, "x") == tl.bfloat16
    assert _common.dot_dtype(torch.bfloat16, True, "x") == tl.float32  # the interpreter has no bf16 math
    with pytest.raises(TypeError, match="float64"):
        _common.dot_dtype(torch.float64, False, "attention")


def test_no_kernel_loops_range_over_a_bound_read_at_run_time():
    """Triton 3.6's interpreter turns a ``range()`` bound into an int with ``int(array)``, which numpy >= 2.4
    refuses for the interpreter's 1-element scalars (``mla_ops/triton/_common.py``): every ``for ... in range``
    of a kernel runs over constexpr bounds, or is the compiled branch of an ``if INTERPRETED:`` whose other
    branch walks the bounds with a ``while`` loop."""
    import ast
    import inspect

    from mla_ops.triton import cache, indexer, sparse

    def constant(node, constexprs):
        return all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Load))
                   or (isinstance(n, ast.Name) and n.id in constexprs) for n in ast.walk(node))

    loops = []
    for module in (absorbed, attention, cache, gather, indexer, merge, rows_gemm, sparse):
        tree = ast.parse(inspect.getsource(module))
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            if not any("jit" in ast.unparse(d) for d in fn.decorator_list):
                continue
            constexprs = {a.arg for a in fn.args.args
                          if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}
            compiled_only = {id(n) for branch in ast.walk(fn) if isinstance(branch, ast.If)
                             and ast.unparse(branch.test) == "INTERPRETED" for s in branch.orelse for n in ast.walk(s)}
            for loop in ast.walk(fn):
                if (isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call)
                        and ast.unparse(loop.iter.func) == "range" and id(loop) not in compiled_only
                        and not all(constant(arg, constexprs) for arg in loop.iter.args)):
                    loops.append(f"{module.__name__}.{fn.name}: {ast.unparse(loop.iter)}")
    assert not loops, f"range() over a run-time bound outside `if INTERPRETED: ... else:`: {loops}"
