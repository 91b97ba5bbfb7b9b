"""``PlanOptions``: every planning option of a step in one frozen, validated object.

``plan_prefill``, ``mla_prefill``, ``PrefillGraphs`` and ``Generator`` take ``options=`` or the options
as loose keywords (DESIGN §4), which build one of these (``options_from``); each option is checked
here, once, and its default resolved here, once, whatever path (host or device form, one device or
context parallel) plans the step.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, fields

import torch

from .. import _checks
from .index_schedule import DEFAULT_INDEX_SCORES_BUDGET
from .routing import DEFAULT_ABSORB_MAX_QUERY_LEN, MEASURED_MASKED_MHA_RATIO
from .schedule import POLICIES


@dataclass(frozen=True)
class PlanOptions:
    """How a step is planned.

    block_size: rows per cache block. workspace_size: rows one chunk gathers (W).
    policy, split_alignment: the host schedule's (``plan_context_chunks``).
    max_chunks: K, the device form's static chunk capacity (packed, ``split_alignment=1``);
      None plans on the host.
    absorb_max_query_len: requests with at most this many new tokens (and some context) take the
      absorbed path; None: ``routing.DEFAULT_ABSORB_MAX_QUERY_LEN`` on one device, the cost model
      under context parallel; 0: no absorbed path.
    max_absorbed_tokens: the most new tokens the absorbed path takes in one step (the first routed
      requests that fit take it, the rest the chunk loop); None: no cap in the host form, W // 4 in
      the device form, where it sizes a static scratch.
    index_topk: K_I, the keys DeepSeek Sparse Attention's indexer selects per query (DESIGN §12);
      requests with more than K_I keys (context + new tokens) take the sparse path, the others the
      dense ones. None: dense MLA (no indexer).
    index_scores_budget: the scores (query tokens x key rows) one indexer chunk may hold: a chunk of
      W rows is scored by ``index_scores_budget // W`` query tokens at a time. Default 2**26 (256 MiB
      of float32 scores); at least ``workspace_size``.
    max_index_chunks: the device form's static capacity of indexer chunks (DESIGN §12), apart from the
      chunk loop's ``max_chunks``: a long sparse prompt needs many indexer pieces but no attention chunk.
      None: ``max_chunks``. Only with ``max_chunks`` (the host form sizes both to the step).
    sliding_window: w, a sliding window (DESIGN §11): query ``c_r + j`` sees only keys ``c_r + j - w + 1 ..
      c_r + j``, so each request's context is clamped to its last ``w - 1`` rows (the work grows with the
      window, not the context). None: no window. A model whose layers differ plans one step per kind.
    masked_mha_ratio: how a DSA step's sparse requests are attended (DESIGN §12, docs/routing.md): a request
      takes top-k-masked MHA (its keys up-projected, the selection a mask) where that costs fewer FLOPs than
      this ratio times the absorbed sparse path's, at the layer's dims (``routing.masked_mha_requests``), else
      the sparse path. None: ``routing.MEASURED_MASKED_MHA_RATIO``; 0: always sparse; ``math.inf``: always
      masked MHA. Exact either way; masked MHA runs only where the lengths are free to read (CPU, eager).
    """

    block_size: int = 16
    workspace_size: int = 65536
    policy: str = "packed"
    split_alignment: int = 1
    max_chunks: int | None = None
    absorb_max_query_len: int | None = None
    max_absorbed_tokens: int | None = None
    index_topk: int | None = None
    index_scores_budget: int = DEFAULT_INDEX_SCORES_BUDGET
    max_index_chunks: int | None = None
    sliding_window: int | None = None
    masked_mha_ratio: float | None = None

    def __post_init__(self):
        # Every size is compared with int32 lengths or becomes an int32 offset: bounded by int32, by name
        # (2**31 would wrap around, e.g. route every request sparse under index_topk=2**31).
        size = _checks.check_int32_size
        normalized = dict(
            block_size=size(self.block_size, "block_size"),
            workspace_size=size(self.workspace_size, "workspace_size"),
            split_alignment=size(self.split_alignment, "split_alignment"),
        )
        _checks.check_choice(self.policy, "policy", POLICIES)
        if normalized["workspace_size"] < normalized["split_alignment"]:
            raise ValueError(
                f"workspace_size must hold at least one split_alignment step ({self.split_alignment} rows), "
                f"got {self.workspace_size}"
            )
        if self.max_chunks is not None:
            normalized["max_chunks"] = size(self.max_chunks, "max_chunks")
            # The device form has one planner: the packed schedule, split anywhere.
            if self.policy != "packed":
                raise ValueError(
                    f"max_chunks (the device form) plans only policy='packed', got policy={self.policy!r}: plan "
                    f"{self.policy!r} on the host (max_chunks=None) or use policy='packed'")
            if normalized["split_alignment"] != 1:
                raise ValueError(
                    f"max_chunks (the device form) plans only split_alignment=1, got "
                    f"split_alignment={self.split_alignment}: plan an aligned schedule on the host (max_chunks=None)")
        if self.max_index_chunks is not None:
            normalized["max_index_chunks"] = size(self.max_index_chunks, "max_index_chunks")
            if self.max_chunks is None:
                raise ValueError("max_index_chunks is the device form's indexer capacity: set max_chunks too (the "
                                 "host form plans as many indexer chunks as the step needs)")
        if self.absorb_max_query_len is not None:
            normalized["absorb_max_query_len"] = size(self.absorb_max_query_len, "absorb_max_query_len", 0,
                                                      " (0 disables)")
        if self.max_absorbed_tokens is not None:
            normalized["max_absorbed_tokens"] = size(self.max_absorbed_tokens, "max_absorbed_tokens", 0)
        if self.sliding_window is not None:
            normalized["sliding_window"] = size(self.sliding_window, "sliding_window", 1, " (None: no window)")
        if self.masked_mha_ratio is not None:
            ratio = self.masked_mha_ratio
            if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
                raise TypeError(f"masked_mha_ratio must be a number or None, got {type(ratio).__name__}")
            if not ratio >= 0:
                raise ValueError(f"masked_mha_ratio must be >= 0 (0: never masked MHA, math.inf: always), "
                                 f"got {ratio!r}")
            normalized["masked_mha_ratio"] = float(ratio)
        normalized["index_scores_budget"] = size(self.index_scores_budget, "index_scores_budget")
        if self.index_topk is not None:
            normalized["index_topk"] = size(self.index_topk, "index_topk")
            if normalized["index_scores_budget"] < normalized["workspace_size"]:
                raise ValueError(
                    f"index_scores_budget must hold one query token's scores over a chunk of workspace_size "
                    f"rows ({normalized['workspace_size']}), got {self.index_scores_budget}")
        for name, value in normalized.items():  # numpy ints become ints: the plan's static sizes
            object.__setattr__(self, name, value)

    @property
    def device_form(self) -> bool:
        return self.max_chunks is not None

    @property
    def absorb_threshold(self) -> int:
        """The single-device routing threshold (None resolved to the default)."""
        if self.absorb_max_query_len is None:
            return DEFAULT_ABSORB_MAX_QUERY_LEN
        return self.absorb_max_query_len

    @property
    def absorbed_capacity(self) -> int | None:
        """Tokens the absorbed path may take: None (no cap, host form) or a static int."""
        if self.max_absorbed_tokens is None and self.device_form:
            return self.workspace_size // 4
        return self.max_absorbed_tokens

    @property
    def index_capacity(self) -> int | None:
        """The device form's indexer chunk slots: ``max_index_chunks``, else ``max_chunks``."""
        return self.max_chunks if self.max_index_chunks is None else self.max_index_chunks

    @property
    def masked_mha_cost_ratio(self) -> float:
        """``masked_mha_ratio`` with None resolved to the measured default."""
        return MEASURED_MASKED_MHA_RATIO if self.masked_mha_ratio is None else self.masked_mha_ratio

    @property
    def window(self) -> int:
        """The sliding window as the plan and the ops hold it: w, or 0 for none."""
        return self.sliding_window or 0

    @property
    def index_tokens(self) -> int:
        """Query tokens one indexer chunk scores at a time (``index_scores_budget // workspace_size``)."""
        return max(1, self.index_scores_budget // self.workspace_size)


_DEFAULTS = {f.name: f.default for f in fields(PlanOptions)}  # read while tracing: a constant


def options_from(options: PlanOptions | None, **loose) -> PlanOptions:
    """``options``, or the loose keywords (``PlanOptions`` fields) that build one: not both, so a
    keyword is never silently overridden. Keywords left at their defaults are not "set"."""
    if options is None:
        return plan_options(**loose)
    if not isinstance(options, PlanOptions):
        raise TypeError(f"options must be a mla_ops.PlanOptions or None, got {type(options).__name__}")
    for name, value in loose.items():
        if value is not _DEFAULTS[name] and value != _DEFAULTS[name]:
            raise ValueError(f"{name}={value!r} was passed beside options=: set it in the PlanOptions "
                             f"(options.{name} is {getattr(options, name)!r})")
    return options


def plan_options(**fields_) -> PlanOptions:
    """``PlanOptions(**fields_)``, checked once per distinct arguments: a server plans every step with
    the same options, and their checks would otherwise be a tenth of a small step's plan."""
    if torch.compiler.is_compiling():  # traced: checked once per compile anyway
        return PlanOptions(**fields_)
    try:
        hash(tuple(fields_.items()))
    except TypeError:
        return PlanOptions(**fields_)  # an unhashable argument: its check names it
    return _cached_options(**fields_)


@functools.lru_cache(maxsize=64, typed=True)  # typed: 16.0 or True must not pass as 16 or 1
def _cached_options(**fields_) -> PlanOptions:
    return PlanOptions(**fields_)
