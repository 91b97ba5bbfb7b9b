"""Hypothesis strategies of a step's lengths for the planner tests (tests/planning/test_schedule.py,
and vLLM's planner compared field by field in the benchmarks' tests)."""

from hypothesis import strategies as st


@st.composite
def batches(draw, max_requests=12):
    """(context_lens, query_lens, workspace_size, split_alignment).

    Contexts mix zeros (first, middle, last), small values, values near W and values of several W.
    """
    A = draw(st.one_of(st.just(1), st.integers(1, 16)))
    W = draw(
        st.one_of(
            st.integers(A, 64),
            st.integers(max(A, 65), 2048),
            st.sampled_from([A, 2 * A, 16 * A + 1, 1024]),
        )
    )
    B = draw(st.integers(1, max_requests))
    kind = st.sampled_from(["zero", "zero", "small", "fits", "big"])
    kinds = draw(st.lists(kind, min_size=B, max_size=B))
    context_lens = []
    for kind in kinds:
        if kind == "zero":
            context_lens.append(0)
        elif kind == "small":
            context_lens.append(draw(st.integers(1, 40)))
        elif kind == "fits":
            context_lens.append(draw(st.integers(max(1, W - 2 * A), W)))
        else:
            context_lens.append(draw(st.integers(W + 1, 3 * W + 2 * A)))
    query_lens = draw(
        st.lists(
            st.one_of(st.just(0), st.integers(1, 8), st.integers(0, 300)), min_size=B, max_size=B
        )
    )
    return context_lens, query_lens, W, A
