"""Every built-in policy's decisions, frozen: the mechanism's redesign (issue 24) moves no bit.

Each case runs one policy through `run_policy` on the simulator in one of five
settings — plain, KV-tight (preemptions), shared prefixes (vllm and lpm cache
them), two replicas behind a router, and a disaggregated 1+1 cluster — with
`log_step_requests` on, so steps.jsonl names every step's requests and token
counts. The digest covers every requests.jsonl row (timestamps, token counts,
preemptions, hits), every steps.jsonl row but its measured `host_s`, and
summary.json but its host-time fields.

The digests were taken before the mechanism was reshaped, once the simulator priced
steps with the same bits on every CPU (no BLAS `np.dot` in the cost models). A change
that moves one changes some policy's results: make it on purpose, update the
digest and say why in the commit.

`ltr` is left out: its ranking comes from a ranker trained with jax, whose
floats follow the CPU's BLAS kernels, so its digest would differ between
machines; its ordering code is `srpt`'s over the ranker's scores.
"""

import tempfile
from pathlib import Path

import pytest
from results_digest import results_digest

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax.core.api.policy import registered_policies
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, WorkloadSpec

# The built-in policies (not ones a test module registered at import), but ltr.
POLICIES = sorted(name for name, cls in registered_policies().items()
                  if cls.__module__.startswith("policies.") and name != "ltr")
_LOG = LimitsSpec(log_step_requests=True)
SETTINGS = {
    "plain": RunSpec(workload=WorkloadSpec(num_requests=120, rate=30), limits=_LOG),
    # 160 pages of 16 tokens under a 1,024-token context: orca and static reserve whole
    # contexts (two at a time), the others preempt (29-36 preemptions each).
    "kv_tight": RunSpec(workload=WorkloadSpec(num_requests=120, rate=30),
                        limits=LimitsSpec(log_step_requests=True, num_kv_pages=160,
                                          max_model_len=1024)),
    "shared_prefix": RunSpec(
        workload=WorkloadSpec(arrival="shared_prefix", num_requests=120, rate=30,
                              prefix_len="fixed:256"),
        limits=LimitsSpec(log_step_requests=True, num_kv_pages=600)),
    "replicas2": RunSpec(workload=WorkloadSpec(num_requests=120, rate=60), limits=_LOG,
                         cluster=ClusterSpec(num_replicas=2, router="least_outstanding")),
    "disaggregated": RunSpec(workload=WorkloadSpec(num_requests=120, rate=30), limits=_LOG,
                             cluster=ClusterSpec(num_prefill_replicas=1,
                                                 num_decode_replicas=1)),
}

# Taken before issue 24's changes with `python tests/test_decisions_frozen.py`.
DIGESTS: dict[str, str] = {
    "disaggregated/edf": "37861f874bb2f5e6",
    "disaggregated/lpm": "9e90faa5e9316e24",
    "disaggregated/mlfq": "b3a0fe50a0dbcf60",
    "disaggregated/orca": "8cbb60a93b11d2f7",
    "disaggregated/priority": "24f7adfbe9a024ff",
    "disaggregated/sarathi": "2082c4919afc913c",
    "disaggregated/sjf": "08a8dad7898a26eb",
    "disaggregated/srpt": "5b923bd15ebe5e2d",
    "disaggregated/static": "135fbfe9e231a33d",
    "disaggregated/vllm": "6f14455c526727cc",
    "disaggregated/vllm-priority": "7fd88c619b5171ba",
    "disaggregated/vtc": "f3938f0b470f543a",
    "kv_tight/edf": "911815e64c68f372",
    "kv_tight/lpm": "e5da892c370c39b7",
    "kv_tight/mlfq": "122ca7ce00201939",
    "kv_tight/orca": "178206216da13606",
    "kv_tight/priority": "292ec3161b413ec0",
    "kv_tight/sarathi": "6881368f06c2e93f",
    "kv_tight/sjf": "f32a8320ac344be1",
    "kv_tight/srpt": "26983aabf0fe2f9a",
    "kv_tight/static": "00b2b468febf17b4",
    "kv_tight/vllm": "deb3235ffea48e5f",
    "kv_tight/vllm-priority": "df89c243985e5913",
    "kv_tight/vtc": "c4b734df1136f868",
    "plain/edf": "0bbabc9efaa92f3e",
    "plain/lpm": "87020af5ad5492c2",
    "plain/mlfq": "b2c04b5c47fb671c",
    "plain/orca": "43f94e5d536fc53a",
    "plain/priority": "f1646bd40be11f0b",
    "plain/sarathi": "35e893a55b0b827d",
    "plain/sjf": "9b4f38116bbf8d4f",
    "plain/srpt": "85bf7d73e4ac80bd",
    "plain/static": "f89efc62411a68da",
    "plain/vllm": "f4bfb76df5b1767c",
    "plain/vllm-priority": "c2514ed5db238f4e",
    "plain/vtc": "9b81cafdefe49997",
    "replicas2/edf": "7258b63185c745a3",
    "replicas2/lpm": "78921fa91881459d",
    "replicas2/mlfq": "b977e9a343d9f0b0",
    "replicas2/orca": "875bb94e23e1c091",
    "replicas2/priority": "bf38f5ae739ef683",
    "replicas2/sarathi": "bc90098911b26aff",
    "replicas2/sjf": "1d36b54e42d5400e",
    "replicas2/srpt": "00cb6d6e7d8d7274",
    "replicas2/static": "b8a13ad3cb4745fa",
    "replicas2/vllm": "ef52772515edd8fe",
    "replicas2/vllm-priority": "53a7ba13a0903a92",
    "replicas2/vtc": "33ad38f21c6b0472",
    "shared_prefix/edf": "bedf7554cc1b8dbb",
    "shared_prefix/lpm": "141e6bd2ce96b2b1",
    "shared_prefix/mlfq": "f3f54d2b36cc74cc",
    "shared_prefix/orca": "036428e7bb6ab97a",
    "shared_prefix/priority": "d44a1b1977374df0",
    "shared_prefix/sarathi": "7f29cc19d926488f",
    "shared_prefix/sjf": "2eb82ee6694295ee",
    "shared_prefix/srpt": "ad3d0264cee2c8e6",
    "shared_prefix/static": "b99a3c24891d017c",
    "shared_prefix/vllm": "fad8c902c1c1adcb",
    "shared_prefix/vllm-priority": "8eb133b38fdcd5bc",
    "shared_prefix/vtc": "d0fca7127c610869",
}


def run_case(setting: str, policy: str, out: Path) -> str:
    """Runs `policy` in `setting`, writing its results under `out`; returns their digest."""
    run_policy(SETTINGS[setting], policy, out_dir=str(out), progress=False)
    return results_digest(out)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_decides_bit_for_bit_as_before(setting, policy, tmp_path):
    assert run_case(setting, policy, tmp_path / "run") == DIGESTS[f"{setting}/{policy}"]


def test_the_kv_tight_setting_preempts_and_the_prefix_setting_hits(tmp_path):
    """The settings exercise what they are named for (else a digest freezes too little)."""
    kv_tight, _ = run_policy(SETTINGS["kv_tight"], "vllm", out_dir=str(tmp_path / "a"),
                             progress=False)
    assert kv_tight["num_preemptions"] > 10
    cached, _ = run_policy(SETTINGS["shared_prefix"], "vllm", out_dir=str(tmp_path / "b"),
                           progress=False)
    assert cached["prefix_hit_rate"] > 0.5


if __name__ == "__main__":  # prints the digests of the code as it is
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(SETTINGS):
            for policy_name in POLICIES:
                digest = run_case(name, policy_name, Path(tmp) / f"{name}-{policy_name}")
                print(f'    "{name}/{policy_name}": "{digest}",', flush=True)
