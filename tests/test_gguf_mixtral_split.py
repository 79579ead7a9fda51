"""Mixtral GGUF files in llama.cpp's older per-expert layout (`blk.N.ffn_gate.J.weight`, ...): the
stacked file of tests.gguf_util.write_hf_as_gguf rewritten expert by expert, loaded to the same
params as the stacked file, logits against transformers on the source safetensors, and a missing,
extra or doubled expert named."""
import numpy as np
import pytest

from tests.gguf_util import write_hf_as_gguf

PROMPTS = [list(range(3, 40)), [5, 6, 7]]


def _rewrite(src, out, split=True, drop=(), extra_expert=False, keep_stacked=False):
    """`src` (stacked experts) as a file whose blk.N.ffn_X_exps tensors are split per expert."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, "llama")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        a = np.asarray(t.data).reshape(tuple(reversed([int(d) for d in t.shape])))
        if split and t.name.endswith("_exps.weight"):
            base = t.name[:-len("_exps.weight")]
            n = a.shape[0] + (1 if extra_expert and base == "blk.1.ffn_down" else 0)
            for j in range(n):
                name = f"{base}.{j}.weight"
                if name not in drop:
                    w.add_tensor(name, np.ascontiguousarray(a[j % a.shape[0]]))
            if not (keep_stacked and base == "blk.0.ffn_up"):
                continue
        w.add_tensor(t.name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def mixtral_files(ckpt_dir, tmp_path_factory):
    hf = ckpt_dir("mixtral")
    d = tmp_path_factory.mktemp("gguf_mixtral_split")
    stacked = write_hf_as_gguf(hf, str(d / "stacked.gguf"))
    return hf, stacked, _rewrite(stacked, str(d / "split.gguf"))


def test_split_layout_names_and_params(mixtral_files):
    """The per-expert file carries no stacked tensor, streams the checkpoint's HF names, and
    loads to params identical to the stacked file's."""
    import gguf
    from safetensors.numpy import load_file

    from jvllm.converters import load_checkpoint
    from jvllm.converters.gguf import gguf_tensor_stream

    hf, stacked, split = mixtral_files
    names = [t.name for t in gguf.GGUFReader(split).tensors]
    assert "blk.0.ffn_gate.3.weight" in names and not any(n.endswith("_exps.weight") for n in names)
    want = load_file(f"{hf}/model.safetensors")
    got = {n: load() for n, load in gguf_tensor_stream(split)}
    assert sorted(got) == sorted(want)
    for n, a in got.items():
        np.testing.assert_array_equal(a, want[n], err_msg=n)
    a, b = load_checkpoint(stacked, "float32").params, load_checkpoint(split, "float32").params
    assert sorted(a) == sorted(b)
    for n in a:
        np.testing.assert_array_equal(np.asarray(a[n]), np.asarray(b[n]), err_msg=n)


def test_split_layout_logits_match_transformers(mixtral_files):
    import torch
    import transformers

    from tests.gguf_util import jvllm_logits as _jvllm_logits

    hf, _, split = mixtral_files
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    for ids, ours in zip(PROMPTS, _jvllm_logits(split, PROMPTS)):
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(ours - theirs).max() < 1e-4


def test_split_layout_errors(mixtral_files, tmp_path):
    from jvllm.converters import CheckpointError
    from jvllm.converters.gguf import gguf_tensor_stream

    _, stacked, _ = mixtral_files

    def stream(**kw):
        for _, load in gguf_tensor_stream(_rewrite(stacked, str(tmp_path / f"{len(kw)}{sorted(kw)}.gguf"), **kw)):
            load()

    with pytest.raises(CheckpointError, match=r"missing expert tensor\(s\) blk.1.ffn_up.2.weight \(3 of 4 experts"):
        stream(drop=("blk.1.ffn_up.2.weight",))
    with pytest.raises(CheckpointError, match=r"'blk.1.ffn_down.4.weight' names expert 4 but the file has 4 experts"):
        stream(extra_expert=True)
    with pytest.raises(CheckpointError, match=r"layer 0 stores its up experts twice: 'blk.0.ffn_up_exps.weight'"):
        stream(keep_stacked=True)
