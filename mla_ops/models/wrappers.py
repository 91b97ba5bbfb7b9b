"""Text models inside multimodal wrappers: a config.json whose ``model_type`` wraps an MLA text model
(Kimi K2.5: a vision tower and a projector around DeepSeek-V3's text weights; Mistral Small 4: the same
around Mistral 4's).

One ``Wrapper`` entry per wrapper model type says where its text model is: the config.json key of the
text model's config, the model type that config has when it names none, and the checkpoint name
prefixes of the text model's tensors, mapped to the decoder's names (``model.``, ``lm_head.``). Every
other tensor of the wrapper (the vision tower, the projector) is left out. A new wrapper is a new entry.

``unwrap`` gives the text model's config with what the wrapper's top level decides:
``tie_word_embeddings`` (transformers ties the wrapper's ``lm_head`` by the top-level key, whose
default is the wrapper class's), and ``dtype`` / ``torch_dtype`` / ``quantization_config`` where the
text config has none. ``MLAConfig.wrapper`` keeps the wrapper's model type; ``text_names`` maps the
checkpoint's names by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .mistral_large4 import native_name


@dataclass(frozen=True)
class Wrapper:
    text_config: str  # the config.json key holding the text model's config
    text_model_type: str  # the text config's model_type when it names none
    names: tuple[tuple[str, str], ...]  # checkpoint name prefix -> the decoder's, the first that matches
    tie_word_embeddings: bool  # the wrapper's default for its top-level key
    # name -> the decoder's name or None (skipped), where the names differ past their prefixes; replaces names
    rename: Optional[Callable[[str], Optional[str]]] = None


WRAPPERS = {
    # Hub release: language_model.model.layers.{i}; transformers' save_pretrained reverts its "blocks" ->
    # "layers" rename (meant for the vision tower's blocks) on every name, so it writes ...model.blocks.{i}.
    "kimi_k25": Wrapper(
        text_config="text_config", text_model_type="deepseek_v3",
        names=(("language_model.model.layers.", "model.layers."), ("language_model.model.blocks.", "model.layers."),
               ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
        tie_word_embeddings=True,
    ),
    # Mistral Small 4: Mistral3ForConditionalGeneration around a mistral4 text model (a Pixtral vision tower);
    # save_pretrained reverts llava's renames, writing language_model.model.* and language_model.lm_head.*.
    # A text config naming no model type is Mistral3Config's default, a plain Mistral (no MLA): refused by name.
    "mistral3": Wrapper(
        text_config="text_config", text_model_type="mistral",
        names=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
        tie_word_embeddings=True,
    ),
    # Mistral Large 4: a Pixtral vision tower around a mistral_large4_text model; the release and transformers'
    # save_pretrained both write Mistral's native names (tok_embeddings, layers.{i}.attention.wq, ...):
    # mla_ops.models.mistral_large4.native_name.
    "mistral_large4": Wrapper(
        text_config="text_config", text_model_type="mistral_large4_text", names=(), tie_word_embeddings=False,
        rename=native_name,
    ),
}


def unwrap(config: dict) -> tuple[dict, str | None]:
    """The text model's config.json object and the wrapper's model type; ``config`` itself and None if it
    is no wrapper's."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in WRAPPERS:
        return config, None
    w = WRAPPERS[model_type]
    text = config.get(w.text_config)
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
    if not isinstance(model_type, str) or model_type not in WRAPPERS:
        return None
    key = WRAPPERS[model_type].text_config
    return f"{key} (the text model of model_type {model_type!r})" if isinstance(config.get(key), dict) else None


def text_names(wrapper: str | None, names) -> dict[str, str]:
    """Checkpoint tensor name -> the decoder's name, for every tensor of the text model (all of them
    without a wrapper); two names of one tensor (``layers`` and ``blocks``) are a ValueError."""
    if wrapper is None:
        return {name: name for name in names}
    out, seen = {}, {}
    w = WRAPPERS[wrapper]
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
