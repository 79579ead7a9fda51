"""jvllm.memory.device: the allocator share jvllm claims and the KV budget inside the pool the
allocator really holds (CPU; the GPU allocator's stats are faked)."""
import pytest

from jvllm.memory import device


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(device, "_claimed", None)
    for v in device.ALLOCATOR_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")  # a GPU process (CI runs JAX_PLATFORMS=cpu)
    return monkeypatch


def test_no_claim_without_a_gpu_platform(fresh):
    fresh.setattr(device, "backends_initialized", lambda: False)
    fresh.setenv("JAX_PLATFORMS", "cpu")
    assert not device.claim_device_memory(0.5) and device.claimed_fraction() is None


def test_claim_sets_the_fraction_before_the_backend_exists(fresh):
    import os

    fresh.setattr(device, "backends_initialized", lambda: False)
    assert device.claim_device_memory(0.45)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.4500"
    assert "XLA_CLIENT_MEM_FRACTION" not in os.environ  # jaxlib refuses both spellings together
    assert device.claimed_fraction() == 0.45
    assert not device.claim_device_memory(0.9)  # the first engine's claim stands (the pool cannot change)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.4500"


@pytest.mark.parametrize("bad", [0.0, 1.5, -1, "0.5", None])
def test_no_claim_for_a_bad_share(fresh, bad):
    """A bad gpu_memory_utilization never reaches JAX's allocator (the config check names it)."""
    import os

    fresh.setattr(device, "backends_initialized", lambda: False)
    assert not device.claim_device_memory(bad)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


@pytest.mark.parametrize("var,value", [("XLA_PYTHON_CLIENT_MEM_FRACTION", ".3"), ("XLA_CLIENT_MEM_FRACTION", ".3"),
                                       ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
                                       ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")])
def test_claim_keeps_the_users_allocator_settings(fresh, var, value):
    import os

    fresh.setattr(device, "backends_initialized", lambda: False)
    fresh.setenv(var, value)
    assert not device.claim_device_memory(0.5)
    assert device.claimed_fraction() is None
    assert [v for v in device.FRACTION_VARS if v in os.environ] == ([var] if var in device.FRACTION_VARS else [])


def test_claim_leaves_a_live_backend_alone(fresh):
    import os

    fresh.setattr(device, "backends_initialized", lambda: True)
    assert not device.claim_device_memory(0.5)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


def test_kv_budget_inside_the_pool_the_allocator_holds(fresh, caplog):
    G = 2**30
    full = dict(bytes_limit=100 * G, bytes_in_use=16 * G, pool_bytes=100 * G)
    budget, how, advice = device.kv_budget_bytes(full, 0.9, 2 * G)
    assert budget == 72 * G and advice == "raise gpu_memory_utilization"
    assert device.kv_budget_bytes(dict(bytes_limit=100 * G, bytes_in_use=16 * G), 0.9, 2 * G)[0] == 72 * G
    # another process held memory: the preallocation backed off to 60 GiB; size inside that, say so
    short = dict(full, pool_bytes=60 * G)
    with caplog.at_level("WARNING", logger="jvllm"):
        budget, how, advice = device.kv_budget_bytes(short, 0.9, 2 * G)
    assert budget == int(0.9 * 60 * G) - 18 * G
    assert "holds 60.00 GiB of its 100.00 GiB limit" in how and "another process" in caplog.text
    assert advice.startswith("free memory on the device")
    # growing pools (no preallocation) start small: their pool size says nothing about free memory
    fresh.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    assert device.kv_budget_bytes(short, 0.9, 2 * G)[0] == 72 * G


def test_kv_budget_in_a_pool_jvllm_sized(fresh):
    """A pool jvllm claimed already is the engine's share of the device: the KV cache takes
    POOL_SHARE of it, not the share again (at 0.2 of an H200 an 8B model still fits)."""
    G = 2**30
    fresh.setattr(device, "backends_initialized", lambda: False)
    device.claim_device_memory(0.2)
    pool = dict(bytes_limit=28 * G, bytes_in_use=16 * G, pool_bytes=28 * G)  # 0.2 of a 140 GiB device
    budget, how, _ = device.kv_budget_bytes(pool, 0.2, 1 * G)
    assert budget == int(0.9 * 28 * G) - 17 * G > 0
    assert how.startswith("0.9 x allocator limit 28.00 GiB (sized by jvllm to gpu_memory_utilization 0.2")


def test_engine_sizes_the_kv_cache_inside_a_short_pool(ckpt_dir, monkeypatch):
    """The engine's sizing uses the pool the allocator holds, and a pool too small for 2 blocks is
    an error naming every term."""
    from jvllm import LLM
    from jvllm.memory import sizing as eng_mod

    monkeypatch.setattr(device, "_claimed", None)
    M = 2**20
    monkeypatch.setattr(eng_mod, "device_memory_stats",
                        lambda: dict(bytes_limit=256 * M, bytes_in_use=4 * M, pool_bytes=40 * M))
    kw = dict(dtype="float32", max_model_len=512, max_num_seqs=8, token_buckets=(8, 16), max_num_batched_tokens=16)
    llm = LLM(ckpt_dir("llama"), gpu_memory_utilization=0.5, **kw)
    try:
        eng = llm.llm_engine
        assert 2 < eng.runner.num_blocks <= (0.5 * 40 * M - 4 * M) // eng.kv_bytes_per_block()
    finally:
        llm.shutdown()
    monkeypatch.setattr(eng_mod, "device_memory_stats",
                        lambda: dict(bytes_limit=256 * M, bytes_in_use=4 * M, pool_bytes=8 * M))
    with pytest.raises(ValueError, match=r"no device memory left for the KV cache: 0.5 x the allocator holds 0.01 GiB "
                                         r"of its 0.25 GiB limit .* - weights 0.00 GiB - activations .* < 2 blocks .*; free memory on the device"):
        LLM(ckpt_dir("llama"), gpu_memory_utilization=0.5, **kw)


def test_weights_that_do_not_fit_are_a_clear_error(ckpt_dir, monkeypatch):
    """An allocator failure while loading the weights names the memory figures and what to do."""
    import jvllm.converters as conv_mod
    from jvllm import LLM
    from jvllm.memory import sizing as eng_mod

    def oom(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1048576 bytes.")

    monkeypatch.setattr(conv_mod, "load_checkpoint", oom)
    monkeypatch.setattr(eng_mod, "device_memory_stats", lambda: dict(bytes_limit=2**30, bytes_in_use=2**29, pool_bytes=2**29))
    with pytest.raises(MemoryError, match=r"ran out of device memory \(allocator limit 1.00 GiB, pool 0.50 GiB, in use "
                                          r"0.50 GiB; gpu_memory_utilization 0.9\): free memory on the device"):
        LLM(ckpt_dir("llama"), dtype="float32", max_model_len=64)


def test_the_claimed_fraction_is_one_jaxlib_accepts(fresh):
    """jaxlib's GPU plugin options from the environment jvllm leaves (both spellings together
    raise there, and JAX would fall back to the CPU)."""
    from jaxlib import xla_client

    fresh.setattr(device, "backends_initialized", lambda: False)
    device.claim_device_memory(0.45)
    opts = xla_client.generate_pjrt_gpu_plugin_options()
    assert opts["memory_fraction"] == pytest.approx(0.45)


def test_a_full_preallocation_is_not_a_short_one(fresh, caplog):
    G = 2**30
    with caplog.at_level("WARNING", logger="jvllm"):
        budget, how, advice = device.kv_budget_bytes(dict(bytes_limit=100 * G, bytes_in_use=0, pool_bytes=99 * G), 0.5, 0)
    assert budget == 50 * G and "holds" not in how and not caplog.text
