"""`benchmarks.sim_speed.row_texts`: the `--floor` text measurement remakes a results
file's bytes from its values (else it would time less work than writing the file)."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.sim_speed import row_texts

VALUES = st.one_of(st.integers(-2**63, 2**63), st.floats(allow_nan=True, allow_infinity=True),
                   st.booleans(), st.none(), st.text(max_size=8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["id", "start_s", "status", "x"]), VALUES,
                                min_size=1), min_size=1, max_size=6))
def test_templates_remake_every_line_byte_for_byte(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text, templates, values = row_texts(str(path))
    assert text == path.read_text()
    assert "".join(t % v for t, v in zip(templates, values)) == text


def test_floats_fill_in_as_numbers_and_the_rest_as_json_text(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"a": 1, "b": 0.1, "c": float("nan"), "d": "x"}) + "\n")
    _, templates, values = row_texts(str(path))
    assert templates == ['{"a": %d, "b": %r, "c": %s, "d": %s}\n']
    assert values == [(1, 0.1, "NaN", '"x"')]
