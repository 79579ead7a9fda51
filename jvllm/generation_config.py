"""The model's generation defaults: HF's `generation_config.json`, read as vLLM reads it.

`LLM(..., generation_config=...)` (vLLM's option and values):
  "auto"   the model folder's generation_config.json, when it has one (GGUF files, built-in short
           names and random: models have none)
  "vllm"   none: SamplingParams' own defaults, and only the config's / tokenizer's end tokens
  a folder holding a generation_config.json
What it changes, as in vLLM:
- `eos_token_ids`: its eos_token_id (an id or a list) joins the end-of-sequence ids, so an instruct
  model that ends its turns with another token than config.json's eos (Gemma 3's <end_of_turn>,
  Llama 3's <|eot_id|>) stops there.
- `sampling`: the SamplingParams defaults of requests that do not set them: temperature, top_p,
  top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens. Only values that differ from
  transformers' GenerationConfig defaults count (vLLM reads the config's `to_diff_dict`), and
  `do_sample` is not read (vLLM does not either). `LLM.generate(prompts)` without SamplingParams
  and the server's unset fields use them; SamplingParams a caller builds are never changed.
Reading needs no transformers: the file is JSON. A file that is not valid JSON is an error naming it.
"""
from __future__ import annotations

import dataclasses
import json
import os

FILE = "generation_config.json"
SOURCES = ("auto", "vllm")  # or a folder
# generation_config key -> (SamplingParams field, transformers' GenerationConfig default)
FIELDS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 50),
          "min_p": ("min_p", None), "repetition_penalty": ("repetition_penalty", 1.0),
          "max_new_tokens": ("max_tokens", None)}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    sampling: tuple = ()        # ((SamplingParams field, value), ...)
    eos_token_ids: tuple = ()
    path: str | None = None     # the file they came from

    def sampling_dict(self) -> dict:
        return dict(self.sampling)


def check_source(source) -> None:
    if not isinstance(source, str) or (source not in SOURCES and not os.path.isdir(source)):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding {FILE}, got {source!r}")
    if source not in SOURCES and not os.path.isfile(os.path.join(source, FILE)):
        raise ValueError(f"generation_config folder {source!r} has no {FILE}")


def load(source: str, model: str) -> GenerationDefaults:
    """The defaults under `source` for the model at `model` (a path or a short name)."""
    check_source(source)
    if source == "vllm":
        return GenerationDefaults()
    folder = model if source == "auto" else source
    path = os.path.join(folder, FILE) if isinstance(folder, str) and os.path.isdir(folder) else None
    if path is None or not os.path.isfile(path):
        return GenerationDefaults()
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON generation config ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a generation config must be a JSON object, got {type(raw).__name__}")
    sampling = []
    for key, (field, hf_default) in FIELDS.items():
        v = raw.get(key)
        if v is not None and v != hf_default:
            sampling.append((field, v))
    eos = raw.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return GenerationDefaults(tuple(sampling), tuple(int(e) for e in eos), path)
