"""The arguments of a generate call that name tokens: the prompts and the stop ids (read only:
the checks run before anything is written).

Accepted: a prompt as a list or tuple of Python or numpy ints (not bools), or a 1-D integer tensor
or array; ``eos_token_id`` None, an int, a list/tuple/set of ints, or a 0-d/1-D integer tensor or
array. Anything else is a TypeError, an id outside the vocabulary a ValueError, naming
``prompts[i][j]`` or ``eos_token_id``.
"""

from __future__ import annotations

import numpy as np
import torch


def is_int(value) -> bool:
    """A Python or numpy int, not a bool (numpy's bool is no np.integer)."""
    return type(value) is int or (isinstance(value, (int, np.integer)) and not isinstance(value, bool))


def _integer_array(x) -> bool:
    """An integer (not bool) torch tensor or numpy array."""
    if isinstance(x, torch.Tensor):
        return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
    return x.dtype.kind in "iu"


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """prompts as fresh lists of Python ints; a TypeError or ValueError naming ``prompts[i]`` (and
    ``[j]``, the id) otherwise."""
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a list of token-id lists (e.g. [[1, 2, 3]]), got {type(prompts).__name__}"
            + (" (use .tolist(), or a list of 1-D tensors)" if isinstance(prompts, (torch.Tensor, np.ndarray)) else "")
        )
    if not prompts:
        raise TypeError("prompts must be a non-empty list of token-id lists, got an empty list")
    out = []
    for i, prompt in enumerate(prompts):
        if is_int(prompt) or isinstance(prompt, bool) or \
                (isinstance(prompt, (torch.Tensor, np.ndarray)) and prompt.ndim == 0):
            raise TypeError(
                f"prompts must be a list of token-id lists, not a flat list of ids: prompts[{i}] is {prompt!r} "
                "(one prompt is written [[1, 2, 3]])"
            )
        if isinstance(prompt, (torch.Tensor, np.ndarray)):
            if prompt.ndim != 1 or not _integer_array(prompt):
                raise TypeError(
                    f"prompts[{i}] must be a 1-D integer tensor or array of token ids, got {prompt.ndim}-D "
                    f"{prompt.dtype}"
                )
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise TypeError(
                f"prompts[{i}] must be a list of int token ids (or a 1-D integer tensor), got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token id")
        for j, t in enumerate(ids):
            if type(t) is not int:
                if not is_int(t):
                    raise TypeError(f"prompts[{i}][{j}] must be an int token id, got {type(t).__name__} {t!r}")
                ids[j] = t = int(t)
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"prompts[{i}][{j}] is {t}: token ids must be in [0, {vocab_size}) (the model's vocab_size)"
                )
        out.append(ids)
    return out


def check_eos(eos_token_id, vocab_size: int) -> set[int]:
    """The stop ids: None -> none; an int, a list/tuple/set of ints, or a 0-d/1-D integer tensor or
    array. Anything else is refused, never ignored: a str "7" or a float 7.0 would never match."""
    if eos_token_id is None:
        return set()
    what = "eos_token_id must be None, an int, or a list/tuple/set of ints"
    if isinstance(eos_token_id, (torch.Tensor, np.ndarray)):
        if eos_token_id.ndim > 1 or not _integer_array(eos_token_id):
            raise TypeError(f"{what} (or a 0-d/1-D integer tensor), got a {eos_token_id.ndim}-D "
                            f"{eos_token_id.dtype} {type(eos_token_id).__name__}")
        items = eos_token_id.reshape(-1).tolist()
    elif isinstance(eos_token_id, (list, tuple, set, frozenset)):
        items = list(eos_token_id)
    else:
        items = [eos_token_id]
    for t in items:
        if not is_int(t):
            raise TypeError(f"{what}, got {type(t).__name__} {t!r}" + (
                f" in {eos_token_id!r}" if isinstance(eos_token_id, (list, tuple, set, frozenset)) else ""))
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"eos_token_id {int(t)} is outside [0, {vocab_size}) (the model's vocab_size): it would never be "
                "generated; pass None for no stop token"
            )
    return {int(t) for t in items}
