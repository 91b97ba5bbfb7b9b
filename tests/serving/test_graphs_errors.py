"""PrefillGraphs refuses what a compiled or captured step could not check itself (it reads no value
on the host inside the graph), before anything is built or written, and stays usable afterwards."""

import pytest
import torch

from tests.serving.test_graphs import BLOCK_SIZE, NUM_BLOCKS, make_model, make_runner, valid_call


def test_an_unknown_compile_backend_is_refused_at_construction():
    with pytest.raises(ValueError, match="compile_backend must be a torch.compile backend"):
        make_runner(make_model(layers=1), "compile", compile_backend="no-such-backend")
    make_runner(make_model(layers=1), "compile", compile_backend=lambda gm, inputs: gm)  # a callable is fine


def _past_the_cache(call):
    call["block_table"] = call["block_table"].clone()
    call["block_table"][0, 0] = NUM_BLOCKS
    return "block_table uses block 128, past the 128 blocks"


def _slot_past_the_cache(call):
    call["slot_mapping"] = call["slot_mapping"].clone()
    call["slot_mapping"][1] = NUM_BLOCKS * BLOCK_SIZE
    return "slot_mapping holds slot 512, past the 128 x 4 slots"


def _token_past_the_vocabulary(call, vocab):
    call["input_ids"] = call["input_ids"].clone()
    call["input_ids"][2] = vocab
    return r"input_ids\[2\] is \d+: input_ids must lie in \[0, \d+\)"


def _negative_token(call, vocab):
    call["input_ids"] = call["input_ids"].clone()
    call["input_ids"][0] = -3
    return r"input_ids\[0\] is -3"


@pytest.mark.parametrize("mode", ["compile", "eager"])
@pytest.mark.parametrize("change", ["block past the cache", "slot past the cache", "token past the vocabulary",
                                    "negative token"])
def test_ids_past_the_cache_or_vocabulary_are_refused_in_every_mode(mode, change):
    model = make_model(layers=1)
    runner = make_runner(model, mode, compile_backend="eager")
    caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    call = valid_call(model)
    vocab = model.embed_tokens.num_embeddings
    match = {"block past the cache": lambda: _past_the_cache(call),
             "slot past the cache": lambda: _slot_past_the_cache(call),
             "token past the vocabulary": lambda: _token_past_the_vocabulary(call, vocab),
             "negative token": lambda: _negative_token(call, vocab)}[change]()
    inputs = {k: v.clone() for k, v in call.items()}
    with pytest.raises(ValueError, match=match):
        runner(kv_caches=caches, **call)
    assert not caches.any() and runner.built == () and runner.stats["replays"] == runner.stats["eager"] == 0
    assert all(torch.equal(call[k], v) for k, v in inputs.items())
    out = runner(kv_caches=caches, **valid_call(model))  # still usable
    assert out.shape[0] == 5 and runner.stats["replays"] == 1
