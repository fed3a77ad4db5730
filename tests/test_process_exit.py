"""A command's `main`, wrapped to skip the exit's final garbage collection."""

import gc

import pytest

from experiments.process_exit import without_final_collection


@pytest.fixture
def unfrozen():
    frozen = gc.get_freeze_count() > 0  # conftest.py froze what the collection made
    gc.unfreeze()
    yield
    gc.unfreeze()  # this process goes on: its objects stay collectable
    if frozen:  # and the later tests' full collections skip them again
        gc.freeze()


def test_after_main_returns_what_it_left_is_frozen_out_of_the_exit_s_collection(unfrozen):
    wrapped = without_final_collection(lambda argv: len(argv))
    assert wrapped(["a", "b"]) == 2 and wrapped.__name__ == "<lambda>"
    assert gc.get_freeze_count() > 0


def test_a_main_that_raises_freezes_nothing(unfrozen):
    def main(argv):
        raise SystemExit("error: bad flag")

    with pytest.raises(SystemExit, match="bad flag"):
        without_final_collection(main)([])
    assert gc.get_freeze_count() == 0
