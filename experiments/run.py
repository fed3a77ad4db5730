"""Runs one policy: `python -m experiments.run --policy=orca --engine=sim ...`.

Writes config.json, requests.jsonl, steps.jsonl and summary.json to --out_dir
and prints the summary as a table. `--describe_policy=NAME_OR_PATH` prints a
policy's (or router's) knobs, with their types, defaults and docs, and exits.
"""

from __future__ import annotations

import contextlib
import textwrap

from experiments.process_exit import imports_uncollected, without_final_collection

with imports_uncollected(freeze=__name__ == "__main__"):
    from absl import flags

    import policies
    from experiments import flags as run_flags
    from experiments.list_flags import registered_names
    from experiments.terminal_table import fit_table
    from orca_jax.cluster.planning import resolve_planner_class
    from orca_jax.cluster.rebalancing import resolve_rebalancer_class
    from orca_jax.cluster.routing import resolve_route_stage_class, resolve_router_class
    from orca_jax.core.api import plugins
    from orca_jax.core.api.policy import (
        PolicyLoadError,
        prefix_caching_line,
        resolve_policy_class,
    )
    from orca_jax.results import comparison
    from orca_jax.results.folder_lock import run_lock
    from orca_jax.results.run_folder import check_out_dir
    from orca_jax.runner.bucket_pilot import (
        PilotPolicy,
        ladder_line,
        token_sizes,
        with_fitted_buckets,
    )
    from orca_jax.runner.build import (
        build_workload,
        check_policies,
        scheduler_config,
        workload_line,
    )
    from orca_jax.runner.experiment import run_policy
    from orca_jax.runner.leap_hint import leap_hint
    from orca_jax.runner.spec import SimEngineSpec
    from orca_jax.sim.engine_profiles import get_engine_profile

flags.adopt_module_key_flags(run_flags)
flags.DEFINE_string("policy", "orca", "Policy: a registered name, package.module:Class, or "
                    "path/to/file.py:Class. " + registered_names("policies"))
flags.DEFINE_string("describe_policy", None, "Print the knobs (types, defaults, docs) of this "
                    "policy, router, chain router stage (filter, scorer, picker), rebalancer, "
                    "planner or KV cache policy (a registered name, package.module:Class or "
                    "path/to/file.py:Class) and exit.")


def describe(spec: str) -> str:
    """The knobs of the policy `spec` and what it does with prefix caching, or the knobs of
    the router `spec` (or of a `chain` router's filter, scorer or picker, or of a
    rebalancer, or of a planner) if no policy is called so.

    Raises:
      PolicyLoadError: `spec` is neither (the policy's message).
    """
    try:
        cls = resolve_policy_class(spec)
        return f"{plugins.describe(cls, 'policy')}\n{prefix_caching_line(cls)}"
    except PolicyLoadError as policy_error:
        try:
            return plugins.describe(resolve_router_class(spec), "router")
        except PolicyLoadError:
            pass
        for kind in ("filter", "scorer", "picker"):  # the `chain` router's stages
            try:
                cls = resolve_route_stage_class(kind, spec)
            except PolicyLoadError:
                continue
            return plugins.describe(cls, kind).replace(
                f"knobs (--{kind}_opts=key=value,...):",
                f"knobs (the chain router's --router_opts=stage_opts={cls.name}.key=value;...):")
        try:
            return plugins.describe(resolve_rebalancer_class(spec), "rebalancer")
        except PolicyLoadError:
            pass
        try:
            return plugins.describe(resolve_planner_class(spec), "planner")
        except PolicyLoadError:
            pass
        try:
            return plugins.describe(plugins.resolve_cache_policy_class(spec), "cache policy",
                                    flag="kv_cache_policy_opts")
        except PolicyLoadError:
            raise policy_error from None


@run_flags.clean_errors()
def main(argv: list[str]) -> None:
    del argv
    if run_flags.FLAGS.describe_policy:
        print(describe(run_flags.FLAGS.describe_policy))
        return
    spec = run_flags.spec_from_flags()
    _, fresh = run_flags.results_folder("run")  # --out_dir, or a fresh folder of runs/
    out_dir = run_flags.join_processes()  # before any jax use
    options = policies.parse_options(run_flags.FLAGS.policy_opts)
    check_policies(spec, scheduler_config(spec), [(run_flags.FLAGS.policy, options)])
    if out_dir is not None:
        check_out_dir(out_dir)  # before the workload: a bad folder costs nothing
    # One run at a time into the folder, from before its workload is built to its end.
    try:
        with run_lock(out_dir) if out_dir is not None else contextlib.nullcontext():
            requests = build_workload(spec)
            print(workload_line(spec, requests))
            # A single run's ladder is fitted to its own policy's pilot.
            policy = run_flags.FLAGS.policy
            spec, bucket_fit = with_fitted_buckets(
                spec, requests, progress=True, policies=[PilotPolicy(policy, policy, options)])
            print(ladder_line(spec, bucket_fit, run_flags.ladder_reason()))
            if isinstance(spec.engine, SimEngineSpec):  # which engine the simulator prices
                profile = get_engine_profile(spec.engine.engine_profile)
                print(textwrap.fill(f"engine profile: {profile.name}: {profile.summary}", 100,
                                    subsequent_indent="  "))
            summary, result = run_policy(spec, run_flags.FLAGS.policy, options,
                                         out_dir=out_dir, requests=requests,
                                         bucket_fit=bucket_fit)
    finally:  # a failed run's folder too: it is the newest
        if out_dir is not None:
            run_flags.link_latest(out_dir, fresh and run_flags.FLAGS.process_id == 0)
    print(fit_table([summary]))
    left_out = comparison.left_out_line(summary["policy"], result)
    if left_out:  # the requests the table's columns do not count, and why
        print(left_out)
    # The compiled step shapes beside the padding they leave (config.json holds the sizes).
    print(f"padding: {summary['padding_fraction']:.4f} of the padded step tokens, "
          f"{len(token_sizes(spec))} step sizes")
    hint = leap_hint(spec, run_flags.FLAGS.policy)
    if hint:  # a plugin planned step by step: how it may leap
        print(hint)
    print(f"results in {out_dir}")


if __name__ == "__main__":
    run_flags.run_command(without_final_collection(main))
