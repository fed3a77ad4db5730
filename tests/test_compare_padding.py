"""compare says what padding decided: each policy's padding and its figures against its
run priced ragged, and whether the ranking holds without padding (issue 50)."""

import json

from cli_runner import run_module

from orca_jax.results import comparison

# The case, smaller: shared prefixes at 8 req/s, orca against sarathi.
CASE = ("--engine=sim", "--workload=shared_prefix", "--rate=8", "--num_requests=150",
        "--policies=orca,sarathi")


def _run(out, *extra):
    result = run_module("experiments.compare", *CASE, *extra, f"--out_dir={out}")
    rows = {row["policy"]: row for row in json.loads((out / "comparison.json").read_text())}
    return " ".join(line.strip() for line in result.stdout.splitlines()), rows


def test_the_fitted_ladder_keeps_the_ranking_and_the_pilots_are_the_ragged_runs(tmp_path):
    printed, rows = _run(tmp_path / "fit")
    _, ragged = _run(tmp_path / "ragged", "--step_padding=ragged")
    assert "ranking unchanged without padding: yes" in printed
    assert "padding (against each policy's run priced ragged, --step_padding=ragged): orca " \
        in printed
    for policy, row in rows.items():
        # The pilots' figures are the ragged runs' to the bit: no run was made twice.
        assert row["ragged_output_tok_s"] == ragged[policy]["output_tok_s"]
        assert row["ragged_ttft_p50_s"] == ragged[policy]["ttft_p50_s"]
        # Within the bounds: 5% of output tok/s, 1.5x TTFT p50.
        assert abs(row["output_tok_s"] / row["ragged_output_tok_s"] - 1) < 0.05
        assert row["ttft_p50_s"] / row["ragged_ttft_p50_s"] < 1.5
        assert f"{policy} {row['padding_fraction']:.1%} of step tokens" in printed
    assert not any(key.startswith("ragged_") for key in ragged["orca"])  # priced ragged


def test_pow2_s_padding_flips_the_ranking_and_the_warning_names_the_pairs(tmp_path):
    # No pilot under pow2: each policy is run again, priced ragged.
    printed, rows = _run(tmp_path / "pow2", "--bucket_ladder=pow2")
    assert rows["orca"]["padding_fraction"] > 0.3
    assert rows["orca"]["ttft_p50_s"] > 5 * rows["orca"]["ragged_ttft_p50_s"]
    assert "ranking unchanged without padding" not in printed
    assert "warning: the ranking depends on padding: sarathi vs orca by output tok/s (" \
        in printed
    assert "sarathi vs orca by TTFT p50 (" in printed


def test_a_ranking_change_needs_an_order_that_moved_past_a_tie():
    padded = {"a": {"output_tok_s": 100.0, "ttft_p50_s": 1.0},
              "b": {"output_tok_s": 90.0, "ttft_p50_s": 1.0}}
    same = {"a": {"output_tok_s": 110.0, "ttft_p50_s": 0.5},
            "b": {"output_tok_s": 95.0, "ttft_p50_s": 0.505}}  # TTFT: a tie both ways
    assert comparison.ranking_changes(padded, same) == []
    flipped = {"a": {"output_tok_s": 90.0, "ttft_p50_s": 1.0},
               "b": {"output_tok_s": 100.0, "ttft_p50_s": 1.0}}
    assert comparison.ranking_changes(padded, flipped) == [
        "a vs b by output tok/s (100 against 90 with padding, 90 against 100 without)"]
    # Ahead with padding, a tie without: the padding decided it.
    tied = {"a": {"output_tok_s": 100.0, "ttft_p50_s": 1.0},
            "b": {"output_tok_s": 99.5, "ttft_p50_s": 1.0}}
    assert len(comparison.ranking_changes(padded, tied)) == 1
    # At the tie's edge (2.1% and 1.9%) the gap moved too little to call.
    edge = {"a": {"output_tok_s": 100.0}, "b": {"output_tok_s": 97.9}}
    assert comparison.ranking_changes(edge, {"a": {"output_tok_s": 100.0},
                                             "b": {"output_tok_s": 98.1}}) == []
    lines = comparison.padding_lines({label: {**row, "padding_fraction": 0.25}
                                      for label, row in padded.items()}, flipped)
    assert lines[0] == ("padding (against each policy's run priced ragged, "
                        "--step_padding=ragged): a 25.0% of step tokens, output tok/s +11.1%, "
                        "TTFT p50 1.00x; b 25.0% of step tokens, output tok/s -10.0%, TTFT p50 "
                        "1.00x")
    assert lines[1].startswith("warning: the ranking depends on padding: a vs b by output")
    assert comparison.padding_lines(padded, {}) == []
