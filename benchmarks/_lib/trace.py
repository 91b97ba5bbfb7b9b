"""The Mooncake trace and the scheduler model that replays it (``trace_replay``, ``planner_bench``,
``device_path_work``, ``context_parallel_cost`` and the tests read their batches from it).

Trace: one JSON object per line (the Mooncake FAST'25 format, see benchmarks/traces/README.md):
``timestamp`` (arrival, ms), ``input_length`` (prompt tokens), ``output_length`` (generated
tokens), ``hash_ids`` (one id per ``block_size``-token prompt block; equal chains = same prefix).

The scheduler model (simple and deterministic; no randomness, no wall clock):

* Time advances by a fixed ``step_ms`` per step; when nothing is running or waiting it jumps to
  the next arrival. A request arriving at time ``t`` can be scheduled by the first step at ``>= t``.
* Prefix cache: a global, unbounded set of block-hash *chains* (a block is keyed by its whole
  prefix of hash ids, not by its own id). When a request is admitted, its cached prefix is the
  longest prefix of its chain that is cached, times the block size, capped to ``input_length - 1``
  rounded down to whole blocks (at least one token is computed, as in vLLM). Only full blocks are
  cached; they become cached at the end of the step that computes their last token.
* Each step spends ``token_budget`` tokens, first-come first-served:
  1. every decoding request gets 1 token (decodes use budget and running slots but are not part of
     the planner's batch);
  2. running partial prefills continue, in admission order, each getting
     ``min(remaining prompt tokens, remaining budget)`` tokens (chunked prefill);
  3. waiting requests are admitted in arrival order while budget remains and fewer than
     ``max_running`` requests (prefilling + decoding) run, with the same rule.
  A prefill's ``context_len`` in a step is the number of its prompt tokens already computed or
  cached, its ``query_len`` the tokens it gets in this step.
* A request whose prompt is complete decodes for ``output_length`` steps from the next step on
  (1 token per step), then leaves; its running slot is free from the step after its last decode.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT / "benchmarks" / "traces" / "mooncake_conversation_trace.jsonl"


@dataclass
class Request:
    """One trace request and its scheduler state."""

    arrival_ms: float
    input_len: int
    output_len: int
    blocks: list[int]  # prefix-chain id of each prompt block (equal id = equal whole prefix)
    computed: int = 0  # prompt tokens computed or cached so far
    decodes_left: int = 0


@dataclass(frozen=True)
class Step:
    """One scheduler step that holds at least one prefill."""

    t_ms: float
    context_lens: list[int]
    query_lens: list[int]
    num_decodes: int


def repo_path(path: str | Path) -> str:
    """``path`` relative to the repository when it lies inside it (results stay machine-independent)."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read the trace, turning each request's hash ids into prefix-chain ids (a trie walk)."""
    chain_ids: dict[tuple[int, int], int] = {}
    requests = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            parent, blocks = -1, []
            for h in rec["hash_ids"]:
                parent = chain_ids.setdefault((parent, h), len(chain_ids))
                blocks.append(parent)
            requests.append(
                Request(float(rec["timestamp"]), int(rec["input_length"]), int(rec["output_length"]), blocks)
            )
    requests.sort(key=lambda r: r.arrival_ms)  # stable: ties keep trace order
    return requests


def simulate(
    requests: Sequence[Request],
    *,
    token_budget: int = 8192,
    max_running: int = 256,
    step_ms: float = 50.0,
    block_size: int = 512,
    on_finish=None,
) -> Iterator[Step]:
    """Run the scheduler model (module doc); yield every step that has prefills.

    ``requests`` must be sorted by arrival; their state fields are reset here. ``on_finish`` is
    called once per request that leaves (for a progress bar).
    """
    for r in requests:
        r.computed, r.decodes_left = 0, 0
    cached: set[int] = set()
    waiting: collections.deque[Request] = collections.deque()
    prefilling: list[Request] = []  # admitted, prompt not complete, in admission order
    decoding: list[Request] = []
    next_arrival, now = 0, requests[0].arrival_ms if requests else 0.0

    while next_arrival < len(requests) or waiting or prefilling or decoding:
        while next_arrival < len(requests) and requests[next_arrival].arrival_ms <= now:
            waiting.append(requests[next_arrival])
            next_arrival += 1
        if not (waiting or prefilling or decoding):
            now = requests[next_arrival].arrival_ms  # idle: jump to the next arrival
            continue

        budget = token_budget
        # 1. Decodes, one token each.
        num_decodes = min(len(decoding), budget)
        budget -= num_decodes
        still_decoding = []
        for i, r in enumerate(decoding):
            if i < num_decodes:
                r.decodes_left -= 1
            if r.decodes_left > 0:
                still_decoding.append(r)
            elif on_finish is not None:
                on_finish(r)

        # 2. Continue partial prefills, then 3. admit waiting requests.
        scheduled: list[tuple[Request, int]] = []  # (request, tokens this step)
        for r in prefilling:
            if budget == 0:
                break
            n = min(r.input_len - r.computed, budget)
            scheduled.append((r, n))
            budget -= n
        while waiting and budget > 0 and len(prefilling) + len(decoding) < max_running:
            r = waiting.popleft()
            hit = 0
            for block in r.blocks[: (r.input_len - 1) // block_size]:
                if block not in cached:
                    break
                hit += 1
            r.computed = hit * block_size
            prefilling.append(r)
            n = min(r.input_len - r.computed, budget)
            scheduled.append((r, n))
            budget -= n

        if scheduled:
            yield Step(now, [r.computed for r, _ in scheduled], [n for _, n in scheduled], num_decodes)

        # End of step: cache newly completed blocks, move finished prompts to decoding.
        for r, n in scheduled:
            full_before, r.computed = r.computed // block_size, r.computed + n
            cached.update(r.blocks[full_before : r.computed // block_size])
            if r.computed == r.input_len:
                r.decodes_left = r.output_len
                if r.decodes_left > 0:
                    still_decoding.append(r)
                elif on_finish is not None:
                    on_finish(r)
        prefilling = [r for r in prefilling if r.computed < r.input_len]
        decoding = still_decoding
        now += step_ms
