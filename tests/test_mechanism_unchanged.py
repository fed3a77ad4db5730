"""benchmarks/mechanism_unchanged.py's verdicts: the first request or step that differs."""

from benchmarks.mechanism_unchanged import first_step_difference, first_token_difference


def test_a_changed_or_missing_token_names_its_request():
    reference = {0: [5, 6], 1: [7], 2: [8, 9]}
    assert first_token_difference({0: [5, 6], 1: [7], 2: [8, 9]}, reference) == "identical"
    assert first_token_difference({0: [5, 6], 1: [7], 2: [8, 1]}, reference) == (
        "DIFFER from request 2: [8, 1] vs [8, 9]")
    assert first_token_difference({0: [5, 6], 2: [8, 9]}, reference) == (
        "DIFFER from request 1: None vs [7]")


def test_steps_compare_on_the_fields_both_trees_write():
    reference = [{"step": 0, "num_tokens": 28, "bucket": 64}, {"step": 1, "num_tokens": 1}]
    renamed = [{"step": 0, "num_tokens": 28, "new_field": 1}, {"step": 1, "num_tokens": 1}]
    assert first_step_difference(renamed, reference) == "identical"
    changed = [{"step": 0, "num_tokens": 28, "bucket": 16}, {"step": 1, "num_tokens": 2}]
    assert first_step_difference(changed, reference) == "DIFFER from step 0 (bucket)"
    assert first_step_difference(reference[:1], reference) == "DIFFER: 1 steps vs 2"
