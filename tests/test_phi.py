"""Phi-1 / 1.5 / 2 (PhiForCausalLM) in the engine, beyond logit parity (tests/test_models.py): the
LM head's bias is a parameter like any other (`lm_head_bias`, `jvllm.models.layers.HeadParams`):
greedy generation equals transformers', `update_weights` reaches the bias by jvllm's name and by
the checkpoint's, sleep level 2 brings it back, and tensor parallelism (the bias sharded over the
vocabulary like the head) gives the one-device tokens."""
import numpy as np

from jvllm import LLM, SamplingParams
from tests.helpers import hf_greedy, hf_model

PROMPTS = [[3, 4, 5, 6, 7], list(range(10, 37)), [200, 1, 2] * 6]
SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
KW = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8, token_buckets=(8, 32),
          use_tqdm_on_load=False)


def _gen(llm):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP,
                                                         use_tqdm=False)]


def test_phi_head_bias_in_the_engine(ckpt_dir):
    from safetensors.numpy import load_file

    path = ckpt_dir("phi")
    llm = LLM(path, enable_sleep_mode=True, **KW)
    try:
        ours = _gen(llm)
        bias = np.asarray(llm.get_weights()["lm_head_bias"])
        forced = np.zeros_like(bias)
        forced[7] = 1e4  # every token becomes 7 exactly when the live bias is the one sampled with
        llm.update_weights({"lm_head_bias": forced})
        assert all(t == 7 for toks in _gen(llm) for t in toks)
        llm.update_weights(load_file(f"{path}/model.safetensors").items())  # lm_head.bias by its HF name
        assert np.array_equal(np.asarray(llm.get_weights()["lm_head_bias"]), bias)
        assert _gen(llm) == ours
        llm.sleep(level=2)
        llm.wake_up()
        assert _gen(llm) == ours
    finally:
        llm.shutdown()
    ref = hf_model(path)
    assert ours == [hf_greedy(ref, p, 8) for p in PROMPTS]
    tp = LLM(path, tensor_parallel_size=2, **KW)
    try:
        assert _gen(tp) == ours
    finally:
        tp.shutdown()
