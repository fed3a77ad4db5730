"""Every built-in policy's decisions, frozen: the mechanism's redesign (issue 24) moves no bit.

Each case runs one policy through `run_policy` on the simulator in one of five
settings — plain, KV-tight (preemptions), shared prefixes (vllm and lpm cache
them), two replicas behind a router, and a disaggregated 1+1 cluster — with
`log_step_requests` on, so steps.jsonl names every step's requests and token
counts. The digest covers every requests.jsonl row (timestamps, token counts,
preemptions, hits), every steps.jsonl row but its measured `host_s`, and
summary.json but its host-time fields.

The digests were taken at 5b7b34e, before the mechanism was reshaped. A change
that moves one changes some policy's results: make it on purpose, update the
digest and say why in the commit.

`ltr` is left out: its ranking comes from a ranker trained with jax, whose
floats follow the CPU's BLAS kernels, so its digest would differ between
machines; its ordering code is `srpt`'s over the ranker's scores.
"""

import hashlib
import json
import tempfile
from pathlib import Path

import pytest

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax.core.policy import registered_policies
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, WorkloadSpec

POLICIES = sorted(set(registered_policies()) - {"ltr"})
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

# Taken at 5b7b34e with `python tests/test_decisions_frozen.py`.
DIGESTS: dict[str, str] = {
    "disaggregated/edf": "a237b4f94bc63265",
    "disaggregated/lpm": "4640f13d7e3e4a84",
    "disaggregated/mlfq": "fbe8f8cf6c5df48e",
    "disaggregated/orca": "ff99bfd6d1a80b47",
    "disaggregated/priority": "9d01d4feda089d1c",
    "disaggregated/sarathi": "5b79f9e72b69603f",
    "disaggregated/sjf": "91926fb2aa2f223e",
    "disaggregated/srpt": "1147032155910e83",
    "disaggregated/static": "173deb57d937b4ac",
    "disaggregated/vllm": "4ababce90a1a4cb8",
    "disaggregated/vllm-priority": "89a3212d01650351",
    "disaggregated/vtc": "62b8b3c3f5b764a2",
    "kv_tight/edf": "829cc03ea642ae9f",
    "kv_tight/lpm": "cb0455efa8de9c2d",
    "kv_tight/mlfq": "d1828753f14a91c0",
    "kv_tight/orca": "40811fb19dd5c31f",
    "kv_tight/priority": "ff60987ef2c2e5f9",
    "kv_tight/sarathi": "a9149fa01c021acf",
    "kv_tight/sjf": "040d3bbb00e0ee19",
    "kv_tight/srpt": "5ca6f1f8ca784938",
    "kv_tight/static": "84ed629975ff7236",
    "kv_tight/vllm": "240bd0e97bf15158",
    "kv_tight/vllm-priority": "2bd66ee7e35ede10",
    "kv_tight/vtc": "af667b85d8e63d26",
    "plain/edf": "3fa5c16d6395590f",
    "plain/lpm": "f7c75e8860f6559f",
    "plain/mlfq": "dac87302120a3cd3",
    "plain/orca": "fcfa023450ec986f",
    "plain/priority": "e2adaedd0d8d20dd",
    "plain/sarathi": "f7107be305502d14",
    "plain/sjf": "a2242b71a02ed4b8",
    "plain/srpt": "653a9de8f5242777",
    "plain/static": "c826def3451ce287",
    "plain/vllm": "dbb25f796e898f9c",
    "plain/vllm-priority": "2efc264aa2e73b12",
    "plain/vtc": "83ee193458c633a6",
    "replicas2/edf": "f143d53b99583f4c",
    "replicas2/lpm": "3638edaba4a363f8",
    "replicas2/mlfq": "9a03b763a0cc2914",
    "replicas2/orca": "80796e085789ae17",
    "replicas2/priority": "66295867a0b5eb06",
    "replicas2/sarathi": "ae6067740ee5525b",
    "replicas2/sjf": "cc779db1f703a376",
    "replicas2/srpt": "cc6c105e1f462208",
    "replicas2/static": "ee3673598b527949",
    "replicas2/vllm": "11bef4093bcd91c2",
    "replicas2/vllm-priority": "dec9504655d22bcf",
    "replicas2/vtc": "3f19705e50b46da5",
    "shared_prefix/edf": "bd81ea61bd24abc0",
    "shared_prefix/lpm": "98f03da65f2dfc41",
    "shared_prefix/mlfq": "74e3d3e70bd4d026",
    "shared_prefix/orca": "d135f47f900da0bb",
    "shared_prefix/priority": "8619f244d4c4f14f",
    "shared_prefix/sarathi": "3da19e857e10d3a3",
    "shared_prefix/sjf": "1fc4ad500b8870a3",
    "shared_prefix/srpt": "0fb7928a0f41ce1e",
    "shared_prefix/static": "f21217a526c024e7",
    "shared_prefix/vllm": "9bf876d0c0ff14db",
    "shared_prefix/vllm-priority": "82acab66a2b0c51e",
    "shared_prefix/vtc": "e7d34102617d63a2",
}


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for line in (out / "requests.jsonl").read_text().splitlines():
        h.update(json.dumps(json.loads(line), sort_keys=True).encode())
    for line in (out / "steps.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if k != "host_s"}
        h.update(json.dumps(row, sort_keys=True).encode())
    summary = json.loads((out / "summary.json").read_text())
    h.update(json.dumps({k: v for k, v in summary.items() if "host" not in k},
                        sort_keys=True).encode())
    return h.hexdigest()[:16]


def run_case(setting: str, policy: str, out: Path) -> str:
    """Runs `policy` in `setting`, writing its results under `out`; returns their digest."""
    run_policy(SETTINGS[setting], policy, out_dir=str(out), progress=False)
    return _digest(out)


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
