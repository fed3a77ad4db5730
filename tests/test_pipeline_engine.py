"""The real engine in pipeline stages: greedy tokens identical to one stage, compiles per stage.

In this process JAX sees one CPU device, so the in-process run puts both stages on it
(the same programs, caches and copies as on two); the run on separate devices, with
tensor parallelism inside each stage (TP 2 x PP 2 on 4 forced CPU devices), goes through
the command line in a subprocess started with `--xla_force_host_platform_device_count=4`
(test_pipeline_engine_cli.py, a file of its own so that the two can run on two test
workers at once).
"""


import jax
import numpy as np
import pytest

from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.api.policy import make_policy
from orca_jax.core.step.engine_api import EngineConfigError
from orca_jax.model.engine import JaxEngine
from orca_jax.model.pipeline_engine import PipelinedJaxEngine
from orca_jax.model.weights import init_params
from orca_jax.runner.spec import JaxEngineSpec
from orca_jax.sim.cost_model import LinearStepTime
from orca_jax.sim.profiled_clock import ProfiledClock
from orca_jax.specs.model_config import get_model_config

# Steps another real-engine module compiled are loaded (conftest.py).
pytestmark = pytest.mark.usefixtures("session_compile_cache")

CONFIG = get_model_config("tiny")  # 2 layers: one per stage
PAGE_SIZE, MAX_LEN, BUCKET = 8, 64, 32
GEOMETRY = dict(num_cache_pages=48 + 1, page_size=PAGE_SIZE, pages_per_seq=MAX_LEN // PAGE_SIZE,
                attention="bucketed")


def _requests():
    """Six requests arriving over the run: prefills beside decodes, in changing batches."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, CONFIG.vocab_size, n).astype(np.int32)
               for n in (9, 17, 4, 12, 6, 20)]
    return [Request(id=i, arrival_s=0.004 * i, prompt_len=len(p), output_len=5 + 2 * (i % 3),
                    prompt_tokens=p) for i, p in enumerate(prompts)]


def _run(engine):
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=BUCKET,
                                               max_model_len=MAX_LEN, token_buckets=(BUCKET,)),
                             kv=KVConfig(num_kv_pages=48, page_size=PAGE_SIZE))
    result = Scheduler(_requests(), make_policy("orca"), engine, config).run()
    tokens = {request: result.output_tokens[i].tolist()
              for i, request in enumerate(result.request_ids)}
    return tokens, result


@pytest.mark.slow  # whole runs of the real engine, compiled
def test_two_stages_give_one_stage_s_tokens_with_micro_batches_in_flight():
    params = init_params(CONFIG, seed=5)
    one, one_run = _run(JaxEngine(CONFIG, params, **GEOMETRY))
    assert sum(map(len, one.values())) == 5 + 7 + 9 + 5 + 7 + 9
    assert one_run.pipeline is None
    staged = PipelinedJaxEngine(CONFIG, params, stage_layers=(1, 1),
                                devices=jax.devices() * 2, **GEOMETRY)
    # A priced clock: each step's stage seconds are known at dispatch, so the executor
    # injects the next micro-batch while this one's tokens are still on the device.
    price = {BUCKET: LinearStepTime(base_s=0.002, per_seq_s=0.0005, per_tile_s=0.0,
                                    q_tile=8, kv_tile=8)}
    clock = ProfiledClock(staged, max_model_len=MAX_LEN, page_size=PAGE_SIZE,
                          pages_per_seq=MAX_LEN // PAGE_SIZE, num_pages=49, fit=price)
    two, two_run = _run(clock)
    assert two == one  # greedy, fp32: identical tokens
    assert two_run.pipeline["stages"] == 2 and two_run.pipeline["in_flight_mean"] > 1.2
    facts = staged.facts()
    assert facts["pp"] == 2 and facts["num_compiles"] == 2  # one bucket, one per stage
    assert [facts["pp_stages"][f"stage{s}"]["num_compiles"] for s in (0, 1)] == [1, 1]
    assert [facts["pp_stages"][f"stage{s}"]["layers"] for s in (0, 1)] == [1, 1]
    # Each stage holds its own layer's cache: half the one-stage cache.
    whole = JaxEngine(CONFIG, params, **GEOMETRY).kv_cache_bytes_per_device
    assert facts["kv_cache_bytes_per_device"] * 2 == whole
    # The wall clock times each stage alone; the tokens stay the same.
    walled, _ = _run(PipelinedJaxEngine(CONFIG, params, stage_layers=(1, 1),
                                        devices=jax.devices() * 2, **GEOMETRY))
    assert walled == one


def test_bad_stage_settings_are_one_line_each():
    params = init_params(CONFIG, seed=5)
    with pytest.raises(EngineConfigError, match=r"^pp 2 x tp 1 = 2 devices, JAX sees 1 \(cpu\); "
                                                 "on a CPU, start with XLA_FLAGS="):
        PipelinedJaxEngine(CONFIG, params, stage_layers=(1, 1), **GEOMETRY)
    with pytest.raises(EngineConfigError, match=r"stage_layers \(2, 1\) must be integers"):
        PipelinedJaxEngine(CONFIG, params, stage_layers=(2, 1), **GEOMETRY)
    for fields, message in [(dict(pp=3), "engine.pp 3 is more stages than the model's 2 layers"),
                            (dict(pp=2, pp_layers="1,2"), "engine.pp_layers '1,2' must be 2 "
                                                          "integers >= 1 summing to the model's "
                                                          "2 layers (they sum to 3)")]:
        with pytest.raises(ValueError) as raised:
            JaxEngineSpec(model="tiny", **fields)
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
