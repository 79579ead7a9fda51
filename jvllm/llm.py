"""The offline API, shaped like vLLM's: `LLM(model=...)`, `generate`, `chat`, `shutdown`.

Works in scripts, notebooks and sharded runs alike: no `if __name__ == "__main__"` guard, no
asyncio loop, and `shutdown()` (or `del llm` + garbage collection) returns the device memory of the
weights and the KV pool, so another `LLM` can be built in the same Jupyter kernel.
"""
from __future__ import annotations

import atexit
import dataclasses
import time
import weakref
from typing import Sequence

from jvllm.engine.engine_config import EngineConfig
from jvllm.engine.llm_engine import LLMEngine
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str = "smollm2", *, dtype: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.9, block_size: int = 16,
                 num_gpu_blocks_override: int | None = None, kv_cache_memory_bytes: int | None = None,
                 max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                 enable_prefix_caching: bool = True, seed: int = 0, skip_tokenizer_init: bool | None = None,
                 token_buckets: Sequence[int] | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, data_parallel_size: int = 1, **kwargs):
        known = {f for f in EngineConfig.__dataclass_fields__}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown option(s) {unknown}; known: {sorted(known)}")
        self.config = EngineConfig(
            model=model, dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            block_size=block_size, num_gpu_blocks_override=num_gpu_blocks_override,
            kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enable_prefix_caching=enable_prefix_caching, seed=seed,
            skip_tokenizer_init=skip_tokenizer_init, token_buckets=tuple(token_buckets) if token_buckets else None,
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size, **kwargs)
        from jvllm.memory.device import claim_device_memory
        from jvllm.sharding import initialize_distributed

        claim_device_memory(gpu_memory_utilization)  # this engine's share of each device, if still settable
        initialize_distributed()  # a multi-process run from the environment (jvllm launch); no-op otherwise
        if data_parallel_size > 1:
            from jvllm.engine.data_parallel import DataParallelEngine

            self.llm_engine = DataParallelEngine(self.config)
        else:
            self.llm_engine = LLMEngine(self.config)
        self._counter = 0
        _LIVE.add(self)

    # ------------------------------------------------------------------ API
    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams() under the model's generation config (`generation_config=`:
        jvllm.generation_config), what generate() and chat() use without sampling params."""
        return self.llm_engine.default_sampling_params()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (str, token-id list, or {"prompt_token_ids": [...]} / {"prompt": ...}; one or a
        list) to completion; outputs come back in input order. All prompts are validated before any
        is queued, so one bad prompt raises without leaving the others half-run."""
        from jvllm.inputs import check_prompt_dict, normalize_prompts

        prompts = normalize_prompts(prompts)
        for p in prompts:
            if isinstance(p, dict):
                check_prompt_dict(p)  # multi_modal_data and other fields jvllm does not take: named
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                                f"{type(sp).__name__} {sp!r:.80}")
        # generate() returns only final outputs (vLLM's: whatever output_kind says), and skips
        # building per-step outputs on the host
        params = [p if p.output_kind is RequestOutputKind.FINAL_ONLY else
                  dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        eng = self.llm_engine
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(eng.add_request(f"llm-{self._counter}", p, sp))
                self._counter += 1
        except Exception:
            eng.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    # keys of apply_chat_template that chat() sets itself: not overridable through chat_template_kwargs
    _CHAT_RESERVED = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                      "chat_template", "tools", "return_dict", "return_tensors")

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of {"role", "content"} dicts) or to a
        list of conversations, then generate (vLLM's `LLM.chat`).

        Content may be a string or a list of text parts (`jvllm.inputs.content_text`; other part
        types such as image_url are a ValueError naming them). `chat_template` (a Jinja string)
        replaces the tokenizer's; `tools` (OpenAI-style tool dicts) and `chat_template_kwargs` (extra
        template variables, e.g. enable_thinking) are handed to the template."""
        from jvllm.inputs import template_messages

        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer; this model was loaded without one")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template: pass chat_template=... or use generate()")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools must be a list of dicts (OpenAI tool definitions), got {tools!r:.200}")
        extra = dict(chat_template_kwargs or {})
        clash = sorted(set(extra) & set(self._CHAT_RESERVED))
        if clash:
            raise ValueError(f"chat_template_kwargs {clash} are set by chat() itself; pass them as its arguments")
        if not messages:
            raise ValueError("messages is empty: pass a conversation (a list of message dicts) or a list of them")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c, conv in enumerate(convs):
            where = "messages" if len(convs) == 1 else f"messages[{c}]"
            if not conv:
                raise ValueError(f"{where} is an empty conversation")
            conv = template_messages(conv, where)
            if continue_final_message and conv[-1]["role"] != "assistant":
                raise ValueError(f"continue_final_message needs the last message of {where} to be from the "
                                 f"assistant, got role {conv[-1]['role']!r}")
            ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, tools=tools,
                                          chat_template=chat_template, **extra)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            text = tok.decode(ids)
            prompts.append({"prompt_token_ids": list(ids), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts, params, use_tqdm: bool = False):
        """Beam search for each prompt (vLLM's `LLM.beam_search`): `params` a
        `jvllm.BeamSearchParams`; returns one `jvllm.beam_search.BeamSearchOutput` per prompt, its
        `sequences` the best `beam_width` beams, best first. Built on `generate` with logprobs
        (jvllm.beam_search states the algorithm and the score)."""
        from jvllm.beam_search import beam_search

        return beam_search(self, prompts, params, use_tqdm)

    def _run(self, ids, use_tqdm) -> list[RequestOutput]:
        eng = self.llm_engine
        want = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from jvllm.progress import bar as progress_bar

            # vLLM's: use_tqdm may be a tqdm-like class (or any callable taking tqdm's arguments)
            make = use_tqdm if callable(use_tqdm) else progress_bar
            bar = make(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        t0, ntok = time.perf_counter(), 0
        try:
            while eng.has_unfinished_requests() and len(done) < len(want):
                for out in eng.step():
                    if out.finished and out.request_id in want:
                        done[out.request_id] = out
                        ntok += sum(len(o.token_ids) for o in out.outputs)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"{ntok / (time.perf_counter() - t0):.1f} tok/s out")
        except BaseException:
            eng.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    # ------------------------------------------------------------------ research: weights and scores
    def _engines(self) -> list:
        return list(getattr(self.llm_engine, "replicas", [self.llm_engine]))

    def get_weights(self) -> dict:
        """The live params as a nested dict of device arrays ({'embed': ..., 'layers': {'0':
        {'self_attn': {'q_proj': ...}}}, ...}, jvllm's layout and names, `jvllm.models.param_specs`):
        the arrays the engine computes with, not copies (with data parallelism: replica 0's).
        Under pipeline parallelism each stage's arrays are on that stage's devices."""
        from jvllm.worker.weights import live_params, nest

        return nest(live_params(self._engines()[0].runner))

    def update_weights(self, weights) -> None:
        """Hand new weights to the engine, e.g. straight from an Optax step: a pytree like
        `get_weights()` (nested or flat dict, or an NNX State; a subset is fine) or an iterable of
        (Hugging Face name, array) pairs as vLLM's `load_weights` takes. Arrays already on the
        engine's devices with its sharding and dtype are used in place (no copy); others are
        resharded and cast. Names and shapes are checked first (ValueError naming the weight, nothing
        swapped). No program recompiles; the prefix cache is invalidated. `generate` leaves no
        request in flight, so from this API the swap lies between two calls (`LLMEngine.update_weights`
        states what happens to requests driven step by step). Hazard: arrays used in place are
        shared, so a training step that donates its params must not be given them afterwards."""
        for eng in self._engines():
            outs = eng.update_weights(weights)
            if outs:  # only when the engine is driven step by step next to this API
                raise RuntimeError(f"update_weights finished {len(outs)} in-flight request output(s) that "
                                   f"LLM cannot hand back; call llm.llm_engine.update_weights to receive them")

    def score(self, prompt_token_ids, continuation_token_ids, use_tqdm: bool = False) -> list:
        """Per-token log-probabilities of given continuations (what an RL trainer's
        `get_per_token_logps` computes): for each pair (prompt ids, continuation ids), a float32
        numpy array [len(continuation)] of log p(continuation[i] | prompt + continuation[:i]) under
        the live weights, over the full vocabulary (no temperature, no processors). One pair or a
        list of pairs (parallel lists); returns one array per pair."""
        import numpy as np

        single = bool(prompt_token_ids) and isinstance(prompt_token_ids[0], (int, np.integer))
        prompts = [prompt_token_ids] if single else list(prompt_token_ids)
        conts = [continuation_token_ids] if single else list(continuation_token_ids)
        if len(prompts) != len(conts):
            raise ValueError(f"score got {len(prompts)} prompts but {len(conts)} continuations")
        for i, (p, c) in enumerate(zip(prompts, conts)):
            if len(p) == 0:
                raise ValueError(f"score: prompt {i} is empty (the first token has no log-probability)")
            if len(c) == 0:
                raise ValueError(f"score: continuation {i} is empty")
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = self.generate([{"prompt_token_ids": [int(t) for t in p] + [int(t) for t in c]}
                              for p, c in zip(prompts, conts)], sp, use_tqdm=use_tqdm)
        res = []
        for p, c, out in zip(prompts, conts, outs):
            plp = out.prompt_logprobs
            ids = list(p) + list(c)
            res.append(np.array([plp[j][ids[j]].logprob for j in range(len(p), len(ids))], np.float32))
        return res[0] if single else res

    def sleep(self, level: int = 1) -> int:
        """Free device memory while idle (needs `LLM(enable_sleep_mode=True)`): level 1 the KV pool,
        level 2 also the weights (kept in host memory). Returns the bytes freed. Requests are refused
        until `wake_up()`; programs stay compiled. Hazard: level 2 invalidates arrays from
        `get_weights()` (`jvllm.memory.sleep`)."""
        return sum(eng.sleep(level) for eng in self._engines())

    def wake_up(self) -> None:
        """Reallocate what `sleep` freed (a fresh, empty KV pool; the weights as they were)."""
        for eng in self._engines():
            eng.wake_up()

    def get_stats(self) -> dict:
        return self.llm_engine.get_stats()

    def compile_report(self) -> list[dict]:
        """What XLA produced for every compiled program (one row per bucket): kind, bucket,
        FLOPs and bytes from XLA's cost analysis, argument / output / temp bytes, fusion count."""
        from jvllm.compilation import program_report

        self.llm_engine.wait_for_warmup()
        eng = self.llm_engine
        eng = getattr(eng, "replicas", [eng])[0]
        rows = []
        for (kind, key), exe in sorted(eng.worker.compiled_programs().items(), key=lambda kv: str(kv[0])):
            rows.append(dict(kind=kind, key=str(key), **program_report(exe)))
        return rows

    def shutdown(self):
        """Release the weights and KV pool device memory now (idempotent)."""
        eng = getattr(self, "llm_engine", None)
        if eng is not None:
            eng.shutdown()
            self.llm_engine = None

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


# Engines still alive at interpreter exit are shut down by an atexit hook, while imports still
# work: a step dispatched ahead of a request that then stopped early is collected and discarded
# there, instead of failing (with a logged traceback) in __del__ during interpreter teardown.
_LIVE: "weakref.WeakSet[LLM]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines():
    for llm in list(_LIVE):
        try:
            llm.shutdown()
        except Exception:
            pass
