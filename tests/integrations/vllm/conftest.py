"""The engine tests' shared fixtures (session-wide: each costs an engine run or transformers' generation)."""

import pytest
import torch

from tests.integrations.vllm.engine import write_checkpoint
from tests.integrations.vllm.harness import MAX_TOKENS, PLUGIN, SCHEDULING, engine, prompts


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deepseek_v2"))
    return path, write_checkpoint(path)


@pytest.fixture(scope="session")
def transformers_greedy(checkpoint):
    """transformers' float32 greedy tokens for each prompt, and each step's top-2 logit gap."""
    _, hf = checkpoint
    tokens, gaps = [], []
    with torch.no_grad():
        for p in prompts():
            # The mask given: inferred from pad_token_id it would hide the prompt's own tokens of that id.
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            gaps.append([float(s[0].topk(2).values.diff().abs()) for s in out.scores])
    return tokens, gaps


@pytest.fixture(scope="session")
def transformers_tokens(transformers_greedy):
    return transformers_greedy[0]


@pytest.fixture(scope="session")
def plugin_f32(checkpoint):
    """Two waves through the plugin, vLLM's own forward_mha run beside ours on every call."""
    return engine(checkpoint[0], PLUGIN, engine=SCHEDULING, waves=[prompts(), prompts()], compare=True)


@pytest.fixture(scope="session")
def stock_f32(checkpoint):
    """vLLM as it is (MLA_OPS_VLLM=0): it turns the user's prefix caching and chunked prefill off."""
    return engine(checkpoint[0], {"MLA_OPS_VLLM": "0"}, engine=SCHEDULING, waves=[prompts(), prompts()])
