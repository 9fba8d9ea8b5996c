"""Hybrid CPU-GPU experts on the CPU: host-computed misses equal the resident run exactly (fp32), the cost
model's choices on synthetic calibrations, and the calibration cache (round trip, other machine, corrupt)."""

import json
import os

import pytest
import torch

from ferrylm import LLM
from ferrylm.offload import calibration
from ferrylm.offload.cost_model import Costs, makespan, split_misses

from test_models_hf import build
from test_offload import run


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return build(tmp_path_factory, "mixtral")[0]


def test_host_experts_equal_resident(mixtral):
    _, ref_tokens, ref_logits = run(mixtral)
    llm, tokens, logits = run(mixtral, place=("experts=cpu", "layers.0.experts.1=gpu"), experts="cpu")
    stats = llm.engine.runner.placed.stats
    print(f"host experts: {stats}")
    assert stats.cpu_experts > 0 and stats.cpu_busy_s > 0
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))


def test_cost_model_choices():
    tokens = {e: 1 for e in range(6)}
    copy_bound = Costs(copy_s=10.0, cpu_s=lambda n: 1.0 * n)  # copies are slow: the CPU takes all
    assert split_misses(tokens, copy_bound) == ([], list(range(6)))
    cpu_bound = Costs(copy_s=1.0, cpu_s=lambda n: 10.0 * n)  # the CPU is slow: copy all
    assert split_misses(tokens, cpu_bound) == (list(range(6)), [])
    balanced = Costs(copy_s=1.0, cpu_s=lambda n: 1.0 * n)
    copy, cpu = split_misses(tokens, balanced)
    assert len(copy) == len(cpu) == 3 and sorted(copy + cpu) == list(range(6))
    assert makespan(tokens, balanced, copy, cpu) == 3.0
    # many tokens make the CPU cost grow: the big expert is copied, small ones stay on the host
    skewed = {0: 64, 1: 1, 2: 1}
    copy, cpu = split_misses(skewed, Costs(copy_s=2.0, cpu_s=lambda n: 0.5 + 0.1 * n))
    assert 0 in copy and cpu
    for split in ([0, 1, 2], []), ([], [0, 1, 2]):  # the model never loses to either side alone
        assert makespan(skewed, Costs(2.0, lambda n: 0.5 + 0.1 * n), copy, cpu) <= \
            makespan(skewed, Costs(2.0, lambda n: 0.5 + 0.1 * n), *split)
    assert split_misses(tokens, balanced, "gpu") == (list(range(6)), [])
    assert split_misses(tokens, balanced, "cpu") == ([], list(range(6)))


def test_calibration_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path))
    w13, w2 = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    act = torch.nn.functional.silu
    costs, m = calibration.calibrate(w13, w2, act, torch.device("cpu"))
    files = os.listdir(tmp_path)
    assert len(files) == 1 and costs.copy_s > 0 and costs.cpu_s(8) > 0
    assert costs.cpu_s(1) <= costs.cpu_s(4) * 4  # piecewise in tokens
    calls = []
    monkeypatch.setattr(calibration, "measure", lambda *a: calls.append(1) or m)
    calibration.calibrate(w13, w2, act, torch.device("cpu"))
    assert not calls  # the cache answered
    path = os.path.join(tmp_path, files[0])
    data = json.load(open(path))
    data["key"]["cpu"] = "another machine"
    json.dump(data, open(path, "w"))
    calibration.calibrate(w13, w2, act, torch.device("cpu"))
    assert calls == [1] and "another machine" in caplog.text
    open(path, "w").write("{not json")
    calibration.calibrate(w13, w2, act, torch.device("cpu"))
    assert calls == [1, 1] and "unreadable" in caplog.text
    assert json.load(open(path))["key"]["cpu"] != "another machine"  # rewritten whole


def test_experts_option_is_checked(mixtral):
    from ferrylm.errors import ConfigError

    with pytest.raises(ConfigError, match="experts 'disk'"):
        LLM(mixtral, experts="disk")


def test_profile_round_trip(mixtral, tmp_path, caplog):
    import subprocess
    import sys

    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "ferrylm.cli", "profile", "--model", mixtral, "-o", str(out),
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    prof = json.loads(out.read_text())
    assert sorted(prof["layers"]) == ["0", "1"] and all(len(v) == 4 and sum(v) > 0 for v in prof["layers"].values())
    llm = LLM(mixtral, place=("experts=cpu", "layers.0-1.experts.0=gpu"), expert_profile=str(out))
    caches = llm.engine.runner.placed.caches
    for layer, cache in caches.items():
        counts = prof["layers"][str(layer)]
        hottest = max(range(4), key=lambda e: (counts[e], -e))
        assert cache.pinned == {hottest} and hottest in cache.slot_of
    assert "expert profile" in llm.engine.runner.placed.profile_note
    # a profile of another model, or a corrupt one, is ignored with a warning
    prof["num_experts"] = 8
    out.write_text(json.dumps(prof))
    llm = LLM(mixtral, place=("experts=cpu",), expert_profile=str(out))
    assert "recorded for another model" in caplog.text and llm.engine.runner.placed.profile_note is None
    out.write_text("{")
    LLM(mixtral, place=("experts=cpu",), expert_profile=str(out))
    assert "cannot read it" in caplog.text
