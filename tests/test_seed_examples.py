"""The seed figures of continuous vs static batching, exactly."""

import pytest

from experiments.reproduce import seed_examples


def test_example_a_static_returns_every_answer_when_the_longest_is_done():
    answers = seed_examples.example_a()
    assert answers["static"] == pytest.approx([5.0, 5.0, 5.0, 5.0], abs=1e-9)


def test_example_a_continuous_returns_each_answer_when_it_is_done():
    answers = seed_examples.example_a()
    assert answers["orca"] == pytest.approx([0.5, 1.0, 1.5, 5.0], abs=1e-9)


def test_example_b_step_counts_and_waiting():
    rows = {row["policy"]: row for row in seed_examples.example_b()}
    # Static: three batches of four, each as long as its longest member: 17 + 20 + 19.
    assert rows["static"]["num_steps"] == 56
    # Batch 2 waits 17 steps, batch 3 waits 37: (0 * 4 + 17 * 4 + 37 * 4) / 12.
    assert rows["static"]["mean_wait_steps"] == pytest.approx(18.0, abs=1e-6)
    # Continuous: a freed slot is refilled on the next step. Requests 4..11 start at steps
    # 5, 7, 9, 10, 11, 17, 19, 21; the slot of requests 3 (17), 9 (4) and 11 (19) never
    # idles and is the last to finish: 17 + 4 + 19.
    assert rows["orca"]["num_steps"] == 40
    assert rows["orca"]["mean_wait_steps"] == pytest.approx(
        (5 + 7 + 9 + 10 + 11 + 17 + 19 + 21) / 12, abs=1e-6)


def test_timeline_figure_of_example_b(tmp_path):
    path = tmp_path / "figures" / "seed_timeline.png"
    timelines, drawn = seed_examples.write_timeline(str(path))
    steps = {row["policy"]: row["num_steps"] for row in seed_examples.example_b()}
    assert {p: t.num_steps for p, t in timelines.items()} == steps
    # Continuous batching: request 4 takes slot 2 the step after request 2 (5 tokens) is
    # done; under static batching request 2 holds it, idle, until its batch is done.
    assert timelines["orca"].request_id_at(5, 2) == 4
    assert timelines["static"].request_id_at(5, 2) == 2
    if drawn:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_draws_the_timeline_under_its_out_dir(tmp_path):
    from tests.cli_runner import run_module

    result = run_module("experiments.reproduce.seed_examples", f"--out_dir={tmp_path}")
    figure = tmp_path / seed_examples.TIMELINE  # not the tracked docs/figures/
    assert f"slot timeline: {figure}" in result.stdout
    assert figure.read_bytes()[:4] == b"\x89PNG"
    named = tmp_path / "elsewhere" / "t.png"
    result = run_module("experiments.reproduce.seed_examples", f"--out_dir={tmp_path}",
                        f"--figure={named}")
    assert f"slot timeline: {named}" in result.stdout and named.exists()
