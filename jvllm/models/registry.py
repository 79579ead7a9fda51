"""Model families: one registration each, as data (no jax import here).

A family is one model file (`jvllm/models/<family>.py`) plus one `register(Family(...))` in
`jvllm/models/families.py` (the built-in ones, with the GPT lineage's in `families_gpt.py`;
imported at the end of this module). The
registration says which architectures and `model_type`s it serves, where its Flax class lives
(imported on first use, so host-only code can read configs without jax), which converter name
maps read its checkpoints (`jvllm.converters.name_map.HF_RULES_BY_MAP`, `gguf.GGUF_RULES_BY_MAP`),
and how an HF config fills the family's `ModelConfig` fields:

  defaults   ModelConfig fields that are fixed for the family (Gemma: `norm_unit_offset=True`)
  hf_fields  {ModelConfig field: HF config attribute} read when the attribute is present and not None
  per_arch   {architecture: fields, applied last} (Qwen2's q/k/v bias without o bias, Qwen3's q/k norm);
             a value `FromHF(attr, default)` reads that architecture's own HF attribute, a value
             `Derived(fn)` is `fn(hf config)` (a rule over several attributes, pure Python)
  refused    {architecture: HF attributes} that must be unset or false: the reference honours them and
             jvllm does not implement them, so a config that sets one is an error naming it
  unread     {architecture or "*": HF attributes} that architecture's transformers class never reads
             (Mistral's `attention_bias`, GPT-2's `num_key_value_heads`): treated as absent, by
             `hf_fields` and by the shared reader (`jvllm.hf_config`), so a stray key in a config
             (`PretrainedConfig` keeps unknown keys) changes nothing, as in the reference

Adding a family (e.g. mixture-of-experts) is a new file plus one `register` call; nothing else in
jvllm lists architectures.

A multimodal checkpoint whose language model is a registered family is served as that decoder
alone (`register_text_only(TextOnly(...))`): its config's `text_config` is the model's config, its
tensors under the wrapper's prefixes are renamed to the text model's names and the vision tower's
are skipped (`TextOnly.rename`). Images are not implemented: prompts are text (or token ids).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable


@dataclasses.dataclass(frozen=True)
class FromHF:
    """A per_arch value read from the HF config's `attr` (`default` when absent or None)."""
    attr: str
    default: object = None


@dataclasses.dataclass(frozen=True)
class Derived:
    """A per_arch value computed from the whole HF config: `fn(hf)`."""
    fn: Callable


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: dict            # {HF model_type: architecture}
    model: str                   # "module:Class" of the Flax NNX model
    name_map: str = "llama"      # key of the converters' HF / GGUF name maps
    defaults: dict = dataclasses.field(default_factory=dict)
    hf_fields: dict = dataclasses.field(default_factory=dict)
    per_arch: dict = dataclasses.field(default_factory=dict)
    refused: dict = dataclasses.field(default_factory=dict)
    unread: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if ":" not in self.model:
            raise ValueError(f"family {self.name!r}: model must be 'module:Class', got {self.model!r}")
        bad = sorted(set(self.model_types.values()) - set(self.architectures))
        if bad:
            raise ValueError(f"family {self.name!r}: model_types map to unregistered architectures {bad}")

    def model_class(self):
        mod, cls = self.model.split(":")
        return getattr(importlib.import_module(mod), cls)

    def unread_attrs(self, arch: str) -> frozenset:
        """The HF attributes `arch`'s transformers class never reads (`unread`)."""
        return frozenset(self.unread.get("*", ())) | frozenset(self.unread.get(arch, ()))

    def config_fields(self, arch: str, hf, use_unread: bool = True) -> dict:
        """The family's extra ModelConfig fields for architecture `arch` from HF config `hf`
        (`use_unread` False: read the `unread` attributes too, for a config that is not transformers')."""
        out = dict(self.defaults)
        skip = self.unread_attrs(arch) if use_unread else frozenset()
        for field, attr in self.hf_fields.items():
            v = None if attr in skip else getattr(hf, attr, None)
            if v is not None:
                out[field] = v
        for field, v in self.per_arch.get(arch, {}).items():
            if isinstance(v, FromHF):
                got = getattr(hf, v.attr, None)
                v = v.default if got is None else got
            elif isinstance(v, Derived):
                v = v.fn(hf)
            out[field] = v
        bad = [a for a in self.refused.get(arch, ()) if getattr(hf, a, None)]
        if bad:
            raise ValueError(f"{arch}: config sets {', '.join(f'{a}={getattr(hf, a)!r}' for a in bad)}, which jvllm "
                             f"does not implement")
        return out


LLAVA_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
LLAVA_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


@dataclasses.dataclass(frozen=True)
class TextOnly:
    """A multimodal architecture served as its text decoder: `text_architecture` (a registered
    family's), or None to take the architecture of its `text_config`'s model_type (LLaVA and
    Mistral 3 wrap several decoders). `prefixes` maps the wrapper's tensor-name prefixes to the
    text model's (the hub's layout and transformers 5's; LLaVA-style by default:
    `language_model.model.` / `model.language_model.`); tensors under `skipped` (the vision
    tower, the projector) are not read."""
    architecture: str
    model_type: str
    text_architecture: str | None
    prefixes: tuple = LLAVA_PREFIXES
    skipped: tuple = LLAVA_SKIPPED

    def text_arch(self, text_config) -> str:
        """The decoder's architecture for this checkpoint's text config (ValueError naming an
        unregistered one)."""
        if self.text_architecture is not None:
            return self.text_architecture
        mt = getattr(text_config, "model_type", None)
        arch = arch_of_model_type(mt or "")
        if arch is None or arch not in _BY_ARCH:
            raise ValueError(f"{self.architecture}: its text decoder (text_config model_type {mt!r}) is not a "
                             f"supported architecture; supported: {', '.join(supported_architectures())}")
        return arch

    def rename(self, name: str) -> str | None:
        """The text model's name for checkpoint tensor `name`, or None for a skipped tensor."""
        if name.startswith(self.skipped):
            return None
        for old, new in self.prefixes:
            if name.startswith(old):
                return new + name[len(old):]
        return name


_FAMILIES: dict[str, Family] = {}
_BY_ARCH: dict[str, Family] = {}
_BY_MODEL_TYPE: dict[str, str] = {}


def register(family: Family) -> Family:
    """Add a family; an architecture or model_type registered twice is an error naming both."""
    for a in family.architectures:
        if a in _BY_ARCH:
            raise ValueError(f"architecture {a!r} is registered by {_BY_ARCH[a].name!r} and {family.name!r}")
    for mt in family.model_types:
        if mt in _BY_MODEL_TYPE:
            raise ValueError(f"model_type {mt!r} is registered twice (family {family.name!r})")
    _FAMILIES[family.name] = family
    _BY_ARCH.update({a: family for a in family.architectures})
    _BY_MODEL_TYPE.update(family.model_types)
    return family


_TEXT_ONLY: dict[str, TextOnly] = {}


def register_text_only(wrapper: TextOnly) -> TextOnly:
    """Serve multimodal `wrapper.architecture` as its (registered) text decoder."""
    if wrapper.text_architecture is not None:
        family_of(wrapper.text_architecture)  # ValueError for an unregistered decoder
    if wrapper.architecture in _BY_ARCH or wrapper.architecture in _TEXT_ONLY:
        raise ValueError(f"architecture {wrapper.architecture!r} is registered twice")
    if wrapper.model_type in _BY_MODEL_TYPE:
        raise ValueError(f"model_type {wrapper.model_type!r} is registered twice")
    _TEXT_ONLY[wrapper.architecture] = wrapper
    _BY_MODEL_TYPE[wrapper.model_type] = wrapper.architecture
    return wrapper


def text_only(arch: str) -> TextOnly | None:
    """The TextOnly registration of multimodal architecture `arch`, else None."""
    return _TEXT_ONLY.get(arch)


def supported_architectures() -> tuple[str, ...]:
    return tuple(_BY_ARCH) + tuple(_TEXT_ONLY)


def supported_model_types() -> tuple[str, ...]:
    return tuple(_BY_MODEL_TYPE)


def family_of(arch: str) -> Family:
    try:
        return _BY_ARCH[arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures())}") from None


def arch_of_model_type(model_type: str) -> str | None:
    return _BY_MODEL_TYPE.get(model_type)


importlib.import_module("jvllm.models.families")  # the built-in registrations (they use the above)
