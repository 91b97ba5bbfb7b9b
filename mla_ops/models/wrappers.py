"""Text models inside multimodal wrappers: a config.json whose ``model_type`` wraps an MLA text model
(Kimi K2.5: a vision tower and a projector around DeepSeek-V3's text weights; Mistral Small 4: the same
around Mistral 4's).

A wrapper model type's record in ``families.FAMILIES`` has a ``Wrapper``: where its text model is (the
config.json key of the text model's config, the model type that config has when it names none, and how
the checkpoint names of the text model's tensors map to the decoder's). Every other tensor of the
wrapper (the vision tower, the projector) is left out.

``unwrap`` gives the text model's config with what the wrapper's top level decides:
``tie_word_embeddings`` (transformers ties the wrapper's ``lm_head`` by the top-level key, whose
default is the wrapper class's), and ``dtype`` / ``torch_dtype`` / ``quantization_config`` where the
text config has none. ``MLAConfig.wrapper`` keeps the wrapper's model type; ``text_names`` maps the
checkpoint's names by it.
"""

from __future__ import annotations

from .. import _checks
from .families import FAMILIES, Wrapper


def _wrapper(model_type) -> Wrapper | None:
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    return None if family is None else family.wrapper


WRAPPER_TYPES = tuple(name for name, family in FAMILIES.items() if family.wrapper is not None)


def unwrap(config: dict) -> tuple[dict, str | None]:
    """The text model's config.json object and the wrapper's model type; ``config`` itself and None if it
    is no wrapper's."""
    model_type = config.get("model_type")
    w = _wrapper(model_type)
    if w is None:
        return config, None
    text = config.get(w.text_config)
    if text is None and w.top_level_text is not None:  # the text model's keys at the top level (dots3_note's release)
        text = {key: value for key, value in config.items() if key not in w.top_level_text}
    if not isinstance(text, dict):
        raise ValueError(f"{w.text_config} must be an object (the text model of model_type {model_type!r}), "
                         f"got {text!r}")
    text = dict(text)
    if text.get("model_type") is None:
        text["model_type"] = w.text_model_type
    tie = config.get("tie_word_embeddings")
    text["tie_word_embeddings"] = w.tie_word_embeddings if tie is None else tie
    if all(text.get(key) is None for key in ("dtype", "torch_dtype")):
        text.update({key: config[key] for key in ("dtype", "torch_dtype") if config.get(key) is not None})
    if text.get("quantization_config") is None and config.get("quantization_config") is not None:
        text["quantization_config"] = config["quantization_config"]
    return text, model_type


def text_config_key(config: dict) -> str | None:
    """For the errors of a wrapper's text model: the key holding its config, and what it is."""
    model_type = config.get("model_type")
    w = _wrapper(model_type)
    if w is None:
        return None
    key = w.text_config
    return f"{key} (the text model of model_type {model_type!r})" if isinstance(config.get(key), dict) else None


def text_names(wrapper: str | None, names) -> dict[str, str]:
    """Checkpoint tensor name -> the decoder's name, for every tensor of the text model (all of them
    without a wrapper); two names of one tensor (``layers`` and ``blocks``) are a ValueError."""
    if wrapper is None:
        return {name: name for name in names}
    w = _wrapper(_checks.check_str(wrapper, "wrapper", WRAPPER_TYPES))  # MLAConfig stands below the registry
    out, seen = {}, {}
    for name in names:
        if w.rename is not None:
            renamed = w.rename(name)
            if renamed is None:
                continue  # the vision tower, the projector
            out[name] = renamed
        else:
            prefix = next((p for p in w.names if name.startswith(p[0])), None)
            if prefix is None:
                continue  # the vision tower, the projector
            out[name] = prefix[1] + name[len(prefix[0]):]
        if out[name] in seen:
            raise ValueError(f"checkpoint tensors {seen[out[name]]} and {name} are both {out[name]}")
        seen[out[name]] = name
    return out
