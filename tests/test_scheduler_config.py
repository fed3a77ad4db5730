"""SchedulerConfig in parts: each part checks its own fields, and 0.1's flat form
still builds the same config (and the same run) with one DeprecationWarning."""

import dataclasses
import warnings

import numpy as np
import pytest

from orca_jax import (
    KVConfig,
    LoopFeatures,
    Request,
    SamplingConfig,
    Scheduler,
    SchedulerConfig,
    SLOTargets,
    StepLimits,
    make_policy,
)
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

PARTS = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64, max_model_len=256),
                        kv=KVConfig(num_kv_pages=20, page_size=8, watermark_pages=1),
                        sampling=SamplingConfig(seed=5), slo=SLOTargets(ttft_slo_s=0.5),
                        features=LoopFeatures(log_step_requests=True))
FLAT = dict(max_num_seqs=4, max_num_tokens=64, max_model_len=256, num_kv_pages=20, page_size=8,
            watermark_pages=1, seed=5, ttft_slo_s=0.5, log_step_requests=True)


@pytest.mark.parametrize("build, message", [
    (lambda: StepLimits(max_num_seqs=0),
     "SchedulerConfig.limits.max_num_seqs must be >= 1, got 0"),
    (lambda: StepLimits(no_progress_steps=-3),
     "SchedulerConfig.limits.no_progress_steps must be >= 1, got -3"),
    (lambda: KVConfig(page_size=0), "SchedulerConfig.kv.page_size must be >= 1, got 0"),
    (lambda: KVConfig(num_kv_pages=8, watermark_pages=8),
     "SchedulerConfig.kv.watermark_pages must be in [0, num_kv_pages=8), got 8"),
    (lambda: KVConfig(kv_layout="slab"),
     "SchedulerConfig.kv.kv_layout 'slab' is not one of ('paged', 'buddy')"),
    (lambda: SamplingConfig(top_p=0.0), "SchedulerConfig.sampling.top_p must be in (0, 1], "
                                        "got 0.0"),
    (lambda: SamplingConfig(temperature=-1.0),
     "SchedulerConfig.sampling.temperature must be >= 0, got -1.0"),
    (lambda: SLOTargets(tpot_slo_s=0.0),
     "SchedulerConfig.slo.tpot_slo_s must be > 0 or None, got 0.0"),
])
def test_a_bad_value_is_one_line_naming_its_part_and_field(build, message):
    with pytest.raises(ValueError) as raised:
        build()
    assert str(raised.value) == message


def test_a_part_of_the_wrong_kind_is_named():
    with pytest.raises(TypeError, match=r"^SchedulerConfig.kv must be a KVConfig, got "
                                        r"StepLimits\("):
        SchedulerConfig(kv=StepLimits())


def test_the_flat_form_builds_the_parts_with_one_warning_naming_each_new_place():
    with pytest.warns(DeprecationWarning) as caught:
        config = SchedulerConfig(**FLAT)
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "SchedulerConfig(max_num_seqs=..., max_num_tokens=..., max_model_len=..., "
        "num_kv_pages=..., page_size=..., watermark_pages=..., seed=..., ttft_slo_s=..., "
        "log_step_requests=...): 0.1's flat keywords are deprecated and go in the next "
        "release; write SchedulerConfig(limits=StepLimits(max_num_seqs=..., max_num_tokens=..., "
        "max_model_len=...), kv=KVConfig(num_kv_pages=..., page_size=..., watermark_pages=...), "
        "sampling=SamplingConfig(seed=...), slo=SLOTargets(ttft_slo_s=...), "
        "features=LoopFeatures(log_step_requests=...))")
    assert caught[0].filename == __file__  # it points at the caller
    assert config == PARTS


def _run(config: SchedulerConfig):
    requests = [Request(id=i, arrival_s=0.0, prompt_len=20 + 9 * i, output_len=20 + 6 * i)
                for i in range(8)]
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))
    return Scheduler(requests, make_policy("vllm"), engine, config).run()


def test_the_flat_form_gives_the_identical_run():
    with pytest.warns(DeprecationWarning):
        flat = _run(SchedulerConfig(**FLAT))
    nested = _run(PARTS)
    assert flat.num_preemptions.sum() > 0  # the pool is tight enough to matter
    for field in ("finish_s", "first_token_s", "num_preemptions", "num_generated"):
        np.testing.assert_array_equal(getattr(flat, field), getattr(nested, field))
    # Every step's time, size and pool (host_s is measured: it differs run to run).
    assert ([s._replace(host_s=0.0) for s in flat.steps]
            == [s._replace(host_s=0.0) for s in nested.steps])


def test_a_flat_keyword_beside_a_part_is_refused_naming_it():
    with pytest.raises(TypeError) as raised:
        SchedulerConfig(kv=KVConfig(), max_num_seqs=4)
    assert str(raised.value) == ("SchedulerConfig: flat keyword 'max_num_seqs' beside the part "
                                 "'kv': give max_num_seqs inside limits=StepLimits(...)")


def test_a_flat_read_warns_naming_the_part():
    with pytest.warns(DeprecationWarning, match=r"read SchedulerConfig.kv.page_size"):
        assert PARTS.page_size == 8
    with pytest.raises(AttributeError, match="page_sizes"):
        PARTS.page_sizes  # noqa: B018  (no knob of that name: no warning, an error)


def test_with_knobs_changes_each_knob_in_its_part_and_nothing_else():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the supported form: no deprecation
        changed = PARTS.with_knobs(num_kv_pages=30, max_num_seqs=2, kv_handoff=True)
    assert changed == dataclasses.replace(
        PARTS, limits=dataclasses.replace(PARTS.limits, max_num_seqs=2),
        kv=dataclasses.replace(PARTS.kv, num_kv_pages=30),
        features=dataclasses.replace(PARTS.features, kv_handoff=True))
    with pytest.raises(TypeError, match="'pages' is no knob of any part"):
        PARTS.with_knobs(pages=3)
    with pytest.raises(ValueError, match="SchedulerConfig.kv.watermark_pages"):
        PARTS.with_knobs(num_kv_pages=1)  # the part checks itself again


def test_only_the_paged_layout_receives_transferred_pages():
    assert KVConfig().receives_transfers
    assert not KVConfig(kv_layout="buddy").receives_transfers
