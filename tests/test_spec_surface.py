"""Speculative decoding on the surfaces: --speculative-config on the CLI (generate / serve / bench
share it), the /metrics lines, the bench JSON fields."""
from __future__ import annotations

import argparse
import types

import pytest

from jvllm.cli import add_engine_args, engine_kwargs


def _parser():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_cli_speculative_config_flag(capsys):
    a = _parser().parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'])
    kw = engine_kwargs(a)
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                        "prompt_lookup_min": 2}
    assert engine_kwargs(_parser().parse_args([]))["speculative_config"] is None
    for bad, msg in (("{oops", "not valid JSON"), ("[1]", "must be a JSON object"),
                     ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown or unsupported key")):
        with pytest.raises(SystemExit):
            _parser().parse_args(["--speculative-config", bad])
        assert msg in capsys.readouterr().err


def test_metrics_lines():
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from jvllm.server.metrics import ServerMetrics
    from jvllm.spec_decode.metrics import SpecStats

    st = SpecStats(3)
    st.record(3, 2)
    st.record(3, 3)
    eng = types.SimpleNamespace(stats=dict(st.as_dict()), num_admitted=0, alive=True, warmup_pending=False)
    m = ServerMetrics("tiny")
    m.attach_engine(eng)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    val = {s.name + "".join(f"[{s.labels[k]}]" for k in sorted(s.labels) if k != "model_name"): s.value
           for f in fams.values() for s in f.samples}
    assert val["jvllm:spec_decode_num_drafts_total"] == 2
    assert val["jvllm:spec_decode_num_draft_tokens_total"] == 6
    assert val["jvllm:spec_decode_num_accepted_tokens_total"] == 5
    assert [val[f"jvllm:spec_decode_num_accepted_tokens_per_pos_total[{j}]"] for j in range(3)] == [2, 2, 1]
    assert val["jvllm:spec_decode_acceptance_rate"] == pytest.approx(5 / 6)
    assert val["jvllm:spec_decode_mean_accepted_length"] == pytest.approx(3.5)
    assert val["vllm:spec_decode_num_accepted_tokens_total"] == 5  # vLLM's names too
    # an engine without speculation has no such lines
    plain = ServerMetrics("tiny")
    plain.attach_engine(types.SimpleNamespace(stats={}, num_admitted=0, alive=True, warmup_pending=False))
    assert b"spec_decode" not in plain.render()


def test_bench_spec_fields():
    from jvllm.bench.run import spec_delta as _spec_delta

    assert _spec_delta({}, {}) == {}
    s0 = dict(spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=4)
    s1 = dict(spec_num_drafts=3, spec_num_draft_tokens=12, spec_num_accepted_tokens=10)
    d = _spec_delta(s0, s1)
    assert d["spec_acceptance_rate"] == pytest.approx(6 / 8) and d["spec_mean_accepted_length"] == pytest.approx(4.0)
