"""The first five minutes: the built-in model loads without torch, paths that need torch say so in
one line, no TPU/allocator noise on a CPU-only install, --help shows defaults, `jvllm convert`
prints a table, and the Makefile's test target keeps pytest's summary line."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from jvllm.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"  # `import torch` fails, find_spec says absent
TORCH_LINE = "needs PyTorch: pip install torch==2.13.0"


def run_py(code: str, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JVLLM_CACHE_DIR="off")
    return subprocess.run([sys.executable, "-c", HIDE_TORCH + code], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.timeout(600)
def test_builtin_model_loads_without_torch(smollm2_path):
    r = run_py(
        "from jvllm.converters import load_checkpoint, load_tokenizer, resolve_model\n"
        "spec = resolve_model('smollm2')\n"
        "ck = load_checkpoint(spec, 'float32')\n"
        "tok = load_tokenizer(spec)\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True)\n"
        "assert len(ck.params) > 0 and tok('Hello world')['input_ids'] == [19556, 905]\n"
        "assert sys.modules.get('torch') is None, 'torch was imported'\n"
        "print('OK', len(ck.params), type(tok).__name__)\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("OK")


def test_verify_without_torch_is_one_line():
    r = run_py("from jvllm.cli import main\nmain(['verify', 'smollm2'])\n", timeout=300)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"jvllm verify {TORCH_LINE}"], r.stderr


def test_torch_checkpoint_without_torch_names_the_file(tmp_path, monkeypatch):
    from jvllm.converters.deps import MissingDependencyError
    from jvllm.converters.readers import read_torch

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingDependencyError, match=rf"reading the PyTorch checkpoint .*x\.bin {TORCH_LINE}$"):
        next(read_torch(str(tmp_path / "x.bin")))


def test_verify_reference_without_torch(monkeypatch):
    from jvllm.converters.deps import MissingDependencyError
    from jvllm.verify import load_reference

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingDependencyError, match=TORCH_LINE):
        load_reference(None)


# ------------------------------------------------------------------------------- CPU noise
def test_cpu_only_install_defaults_to_cpu(monkeypatch):
    from jvllm import platform

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_PLATFORM_NAME", raising=False)
    monkeypatch.setattr(platform, "accelerator_plugins", lambda: ())
    assert platform.cpu_only_default() and os.environ["JAX_PLATFORMS"] == "cpu"


def test_no_tpu_probe_line_after_jvllm_is_imported():
    """The CLI's order: jvllm (and so jax) imported, then cpu_only_default(), then the backends."""
    from jvllm.platform import accelerator_plugins

    if accelerator_plugins():
        pytest.skip(f"accelerator plugins installed: {accelerator_plugins()}")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "import jvllm.cli, jax\n"
            "from jvllm.platform import cpu_only_default\n"
            "assert cpu_only_default()\n"
            "print(jax.devices()[0].platform)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "cpu"
    assert "Unable to initialize backend" not in r.stderr, r.stderr[-2000:]


def test_gpu_plugin_or_user_choice_is_left_alone(monkeypatch):
    from jvllm import platform

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_PLATFORM_NAME", raising=False)
    monkeypatch.setattr(platform, "accelerator_plugins", lambda: ("xla_cuda12",))
    assert not platform.cpu_only_default() and "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(platform, "accelerator_plugins", lambda: ())
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert not platform.cpu_only_default() and os.environ["JAX_PLATFORMS"] == "cuda"


def test_accelerator_plugins_sees_entry_points(monkeypatch):
    import importlib.metadata

    from jvllm import platform

    class EP:
        name = "xla_cuda12"

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [EP()] if group == "jax_plugins" else [])
    assert "xla_cuda12" in platform.accelerator_plugins()


def test_no_allocator_line_on_a_cpu_only_install(monkeypatch, caplog):
    from jvllm import platform
    from jvllm.memory import device

    monkeypatch.setattr(device, "_claimed", None)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platform, "accelerator_plugins", lambda: ())
    monkeypatch.setattr(device, "backends_initialized", lambda: True)
    with caplog.at_level(logging.INFO, logger="jvllm"):
        assert not device.claim_device_memory(0.9)
    assert "allocator" not in caplog.text
    monkeypatch.setattr(platform, "accelerator_plugins", lambda: ("xla_cuda12",))
    with caplog.at_level(logging.INFO, logger="jvllm"):
        assert not device.claim_device_memory(0.9)
    assert "allocator settings are kept" in caplog.text  # on a GPU install the line still says why


# ------------------------------------------------------------------------------- CLI
def test_every_option_of_every_command_shows_its_default():
    import argparse

    ap = build_parser()
    sub = next(a for a in ap._actions if a.choices and "generate" in a.choices)
    assert {"generate", "chat", "verify", "convert", "serve"} <= set(sub.choices)
    missing = []
    for name, p in sub.choices.items():
        assert p.formatter_class is argparse.ArgumentDefaultsHelpFormatter, name
        for act in p._actions:
            if act.option_strings and act.default is not argparse.SUPPRESS and not act.help:
                missing.append(f"{name} {act.option_strings[0]}")  # no help line: its default would not show
    assert not missing, missing
    gen = " ".join(sub.choices["generate"].format_help().split())
    assert "tokens to generate per prompt (default: 64)" in gen and "(default: smollm2)" in gen
    assert "tokens to generate per prompt (default: 256)" in " ".join(sub.choices["chat"].format_help().split())


def test_convert_prints_a_table(ckpt_dir, tmp_path, capsys):
    src = ckpt_dir("llama")
    main(["convert", src, str(tmp_path / "o")])
    out, err = capsys.readouterr()
    assert "{" not in out
    rows = dict(line.split(None, 1) if "  " not in line else (line[:line.index("  ")], line[line.index("  "):].strip())
                for line in out.strip().splitlines())
    assert set(rows) >= {"source", "destination", "dtype", "tensors", "parameters", "size on disk", "reload check"}
    assert "reading" in err and "writing" in err and "reloading" in err


# ------------------------------------------------------------------------------- Makefile / CI
def test_make_test_keeps_pytests_summary_line():
    make = subprocess.run(["make", "-n", "test", "PY=python3"], capture_output=True, text=True, cwd=ROOT)
    assert make.returncode == 0, make.stderr
    line = next(ln for ln in make.stdout.splitlines() if "pytest" in ln)
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        addopts = tomllib.load(f)["tool"]["pytest"]["ini_options"].get("addopts", "")
    quiet = (line.split() + addopts.split()).count("-q") + sum(a.count("q") for a in (line.split() + addopts.split())
                                                              if a.startswith("-q") and a != "-q")
    assert quiet <= 1, f"pytest would run with -{'q' * quiet}: no 'N passed' line ({line!r}, addopts {addopts!r})"


def test_ci_runs_both_readme_commands_from_fresh_venvs():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    for target in ("generate", "test"):
        assert f"make {target} PY=" in ci, target
    assert ci.count("-m venv") >= 2


def test_progress_bar_without_ipywidgets_is_the_text_bar(monkeypatch):
    import importlib.util
    import warnings

    import tqdm.std

    from jvllm import progress

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "ipywidgets" else real(n, *a))
    progress.bar_class.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a TqdmWarning would fail here
            b = progress.bar(total=1, disable=True)
        assert type(b) is tqdm.std.tqdm
    finally:
        progress.bar_class.cache_clear()


def test_cpu_vs_hf_batch1_case_records_both_engines():
    """benchmarks/cpu_vs_hf.py's batch-1 case: interleaved runs, best run per engine, ratio and
    whether the greedy outputs agree (timed functions faked: the figures come from the real run)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import cpu_vs_hf
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    speeds = {"j": iter([10.0, 30.0]), "h": iter([20.0, 15.0])}

    def fake(which, ids):
        return lambda: (dict(out_tok_s=next(speeds[which]), cpu_util=1.0, load_before=0.0), [ids])

    out = cpu_vs_hf.batch1(fake("j", [1, 2, 3]), fake("h", [1, 2, 4]), repeats=2)
    assert out["jvllm"]["out_tok_s"] == 30.0 and out["hf"]["out_tok_s"] == 20.0
    assert out["ratio"] == 1.5 and out["identical"] is False and len(out["hf"]["runs"]) == 2
    speeds["j"] = iter([5.0])
    alone = cpu_vs_hf.batch1(fake("j", [1]), None, repeats=1)  # --skip-hf
    assert alone["jvllm"]["out_tok_s"] == 5.0 and "hf" not in alone and "ratio" not in alone


def test_gguf_without_the_gguf_package_is_one_line(smollm2_path, monkeypatch):
    from jvllm.converters.deps import MissingDependencyError
    from jvllm.converters.gguf import gguf_hf_config

    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(MissingDependencyError, match=r"needs the gguf package: pip install 'jvllm\[gguf\]'$"):
        gguf_hf_config(smollm2_path)


def test_generate_exits_nonzero_when_the_engine_fails(ckpt_dir, monkeypatch, capsys):
    """An engine error fails the request (finish_reason "error"); `jvllm generate` then says so and
    exits 1 instead of printing an empty completion with status 0."""
    from jvllm import cli
    from jvllm.worker.model_runner import ModelRunner

    def boom(self, handle):
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(ModelRunner, "collect", boom)
    path = ckpt_dir("llama", tokenizer=True)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hello", "--model", path, "--dtype", "float32", "--max-model-len", "64",
                  "--max-num-batched-tokens", "16", "--max-num-seqs", "2", "--token-buckets", "8,16",
                  "--max-tokens", "4"])
    assert e.value.code == 1
    assert "1 of 1 prompt(s) failed in the engine" in capsys.readouterr().err


def test_generate_warms_up_first_only(monkeypatch):
    """`jvllm generate` runs one batch and exits: it compiles what its requests use (warmup
    "first"), unless $JVLLM_WARMUP or --warmup says otherwise; other commands keep EngineConfig's."""
    from jvllm.cli import build_parser, engine_kwargs

    monkeypatch.delenv("JVLLM_WARMUP", raising=False)
    a = build_parser().parse_args(["generate", "hi"])
    assert engine_kwargs(a)["warmup"] == "first"
    assert build_parser().parse_args(["generate", "--warmup", "all"]).warmup == "all"
    assert "warmup" not in engine_kwargs(build_parser().parse_args(["chat"]))
    monkeypatch.setenv("JVLLM_WARMUP", "all")
    assert build_parser().parse_args(["generate"]).warmup == "all"
