"""converters.gguf_file (the fast header reader) and gguf_dequant against the gguf package's own
GGUFReader and dequantize: same metadata, same tensor table, bit-identical float32 values."""
from __future__ import annotations

import numpy as np
import pytest

from jvllm.converters import CheckpointError
from jvllm.converters.gguf import SUPPORTED_GGUF_TYPES
from jvllm.converters.gguf_dequant import dequantize
from jvllm.converters.gguf_file import GGUFFile
from tests.gguf_util import _KQ, random_kquant


def _same_value(a, b):
    if isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(b, float):
        return np.float32(a) == np.float32(b) or a == b
    return a == b


def assert_matches_reader(path):
    import gguf

    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert set(ours.fields) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for k, f in ref.fields.items():
        if k.startswith("GGUF."):  # the reader's own header entries (version, counts)
            continue
        assert _same_value(ours.fields[k], f.contents()), k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.shape == tuple(int(x) for x in b.shape), a.name
        assert a.ggml_type == int(b.tensor_type) and a.offset == b.data_offset and a.nbytes == b.n_bytes, a.name
        raw = np.ascontiguousarray(b.data).view(np.uint8).reshape(-1)
        assert np.array_equal(ours.tensor_bytes(a), raw), a.name
        if b.tensor_type.name in ("F32", "F16", "F64"):  # the previous loader's path for plain types
            want = np.asarray(b.data, np.float32).reshape(a.numpy_shape)
        else:
            want = np.asarray(gguf.quants.dequantize(raw, b.tensor_type), np.float32).reshape(a.numpy_shape)
        got = dequantize(ours.tensor_bytes(a), b.tensor_type, a.numpy_shape)
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{a.name} not bit-identical"


def test_real_smollm2_file_matches_gguf_reader(smollm2_path):
    assert_matches_reader(smollm2_path)


def write_all_types(path, rng):
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_string("test.text", "héllo ✓")
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.strings", ["a", "bé", ""])
    w.add_float32("test.f", 0.25)
    w.add_bool("test.flag", True)
    for qt in SUPPORTED_GGUF_TYPES:
        Q = gguf.GGMLQuantizationType[qt]
        arr = rng.standard_normal((4, 256)).astype(np.float32)
        if qt in ("F32", "F16", "F64"):
            w.add_tensor(f"t.{qt}", arr.astype({"F32": np.float32, "F16": np.float16, "F64": np.float64}[qt]))
        elif qt in _KQ:  # the super-block and i-quant types: random valid blocks
            w.add_tensor(f"t.{qt}", random_kquant(qt, 4, 256, rng), raw_dtype=Q)
        else:
            w.add_tensor(f"t.{qt}", gguf.quants.quantize(arr, Q), raw_dtype=Q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_supported_type_bit_identical(tmp_path):
    path = write_all_types(str(tmp_path / "all.gguf"), np.random.default_rng(0))
    assert_matches_reader(path)
    f = GGUFFile(path)
    assert f.get("test.strings") == ["a", "bé", ""] and f.get("test.ints") == [1, -2, 3]
    assert {t.name for t in f.tensors} == {f"t.{q}" for q in SUPPORTED_GGUF_TYPES}


def test_bad_files_name_the_problem(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(CheckpointError, match=r"x\.gguf: not a GGUF file \(magic b'NOPE'"):
        GGUFFile(str(p))
    p.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(CheckpointError, match=r"GGUF version 7 is not supported \(supported: 2, 3\)"):
        GGUFFile(str(p))
    p.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty file"):
        GGUFFile(str(p))
    good = write_all_types(str(tmp_path / "g.gguf"), np.random.default_rng(1))
    data = open(good, "rb").read()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: cannot read GGUF file: header cut short"):
        GGUFFile(str(tmp_path / "cut.gguf"))
    f = GGUFFile(good)
    (tmp_path / "trunc.gguf").write_bytes(data[:f.tensors[-1].offset + 10])
    t = GGUFFile(str(tmp_path / "trunc.gguf"))
    with pytest.raises(CheckpointError, match=r"truncated GGUF file: tensor 't\.\w+' ends at byte \d+, file has \d+"):
        t.tensor_bytes(t.tensors[-1])


def test_model_config_without_transformers_classes_is_the_same(smollm2_path, ckpt_dir, tmp_path):
    """model_config_from_dict (plain attributes) == ModelConfig from transformers' config class."""
    import transformers

    from jvllm.config import ModelConfig
    from jvllm.converters.gguf import gguf_hf_config, model_config_from_dict
    from tests.gguf_util import write_llama_gguf

    tiny = write_llama_gguf(ckpt_dir("llama"), str(tmp_path / "tiny.gguf"))
    for path in (smollm2_path, tiny):
        d = gguf_hf_config(path)
        cls = transformers.CONFIG_MAPPING[d["model_type"]]
        ref = ModelConfig.from_hf_config(cls(**{k: v for k, v in d.items() if k != "model_type"}))
        assert model_config_from_dict(d) == ref, path


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_model_config_without_transformers_classes_qwen(smollm2_path, arch):
    """The same equality for the other GGUF architectures (their HF config classes bring their own
    defaults, e.g. Qwen2's sliding window): the dict as gguf_hf_config builds it for `arch`."""
    import transformers

    from jvllm.config import ModelConfig
    from jvllm.converters.gguf import gguf_hf_config, model_config_from_dict

    d = dict(gguf_hf_config(smollm2_path), model_type=arch,
             architectures=[{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]])
    if arch == "qwen2":
        d["attention_bias"] = True
    cls = transformers.CONFIG_MAPPING[arch]
    ref = ModelConfig.from_hf_config(cls(**{k: v for k, v in d.items() if k != "model_type"}))
    assert model_config_from_dict(d) == ref


@pytest.mark.parametrize("qt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_block_kernels_bit_identical_across_chunks(qt):
    """jvllm's own block kernels against gguf's, on more blocks than one numpy pass takes (the
    chunk boundary) and on every nibble / int8 value with random finite f16 scales."""
    import gguf

    from jvllm.converters import gguf_dequant

    Q = gguf.GGMLQuantizationType[qt]
    type_size, block, _ = gguf_dequant._KERNELS[qt]
    n = (gguf_dequant._CHUNK_BLOCKS * 32 // block) + 38  # even: the values fill rows of 64
    rng = np.random.default_rng(3)
    if qt in _KQ:  # super-blocks: random bytes, finite scales
        raw = random_kquant(qt, 1, n * block, rng).reshape(n, type_size)
    else:
        raw = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
        n_scales = 2 if qt in ("Q4_1", "Q5_1") else 1
        raw[:, :2 * n_scales] = rng.standard_normal((n, n_scales)).astype(np.float16).view(np.uint8)
    want = np.asarray(gguf.quants.dequantize(raw.reshape(-1), Q), np.float32).reshape(n * block // 64, 64)
    got = dequantize(raw.reshape(-1), Q, (n * block // 64, 64))
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_reference(raw: np.ndarray, xs: bool) -> np.ndarray:
    """IQ4_NL / IQ4_XS decoded from ggml-common.h's layout (an implementation independent of the
    gguf package's): 4-bit indices into a fixed non-linear table, low nibbles then high ones per
    32 values; IQ4_XS adds a 6-bit scale per 32 values (low 4 bits in scales_l, high 2 in scales_h),
    offset by 32."""
    nb = 136 if xs else 18
    blocks = raw.reshape(-1, nb)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    if not xs:
        qs = blocks[:, 2:]
        idx = np.concatenate([qs & 0xF, qs >> 4], axis=1)
        return (d * _IQ4_VALUES[idx]).reshape(-1)
    sh = blocks[:, 2:4].copy().view(np.uint16).astype(np.int32)  # [n, 1]
    sl = blocks[:, 4:8].astype(np.int32)
    qs = blocks[:, 8:].reshape(-1, 8, 16)
    ib = np.arange(8)
    ls = ((sl[:, ib // 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)  # [n, 8]
    dl = d * (ls - 32).astype(np.float32)
    idx = np.concatenate([qs & 0xF, qs >> 4], axis=2)  # [n, 8, 32]
    return (dl[:, :, None] * _IQ4_VALUES[idx]).reshape(-1)


@pytest.mark.parametrize("qt", ["IQ4_NL", "IQ4_XS"])
def test_iq4_against_independent_decoder(qt, tmp_path):
    """The two common 4-bit i-quants, read from a file, equal a decoder written from ggml's block
    layout (the other i-quant types go through the same gguf package path; their grids are not
    re-derived here)."""
    import gguf

    rng = np.random.default_rng(4)
    raw = random_kquant(qt, 8, 512, rng)
    path = str(tmp_path / "iq4.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("t", raw, raw_dtype=gguf.GGMLQuantizationType[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    (t,) = f.tensors
    got = dequantize(f.tensor_bytes(t), gguf.GGMLQuantizationType[qt], t.numpy_shape)
    assert got.shape == (8, 512)
    np.testing.assert_allclose(got.reshape(-1), _iq4_reference(raw.reshape(-1), qt == "IQ4_XS"), rtol=1e-6)
