"""benchmarks/old_revision.py: a revision's files in a folder that goes away, round-robin
measurements, and one clear line for a revision that is not there."""

import subprocess
import sys

import pytest

from benchmarks import old_revision


def test_revision_tree_holds_the_revision_files_and_is_removed_after():
    committed = subprocess.run(["git", "-C", str(old_revision.REPO), "show", "HEAD:setup.cfg"],
                               capture_output=True, text=True, check=True).stdout
    with old_revision.revision_tree("HEAD", ("setup.cfg",)) as tree:
        assert (tree / "setup.cfg").read_text() == committed
        assert sorted(p.name for p in tree.iterdir()) == ["setup.cfg"]
        # A child on that tree imports from it first: here, a module only the tree has.
        (tree / "only_in_tree.py").write_text("WHERE = 'tree'\n")
        child = subprocess.run([sys.executable, "-c", "import only_in_tree, sys; "
                                "print(only_in_tree.WHERE, sys.path[1])"],
                               env=old_revision.tree_env(tree), capture_output=True, text=True)
        assert child.stdout.split() == ["tree", str(tree)]
    assert not tree.exists()


def test_a_name_that_is_no_commit_stops_with_one_line():
    with pytest.raises(SystemExit, match="--old_rev no-such-rev: not a commit of "):
        with old_revision.revision_tree("no-such-rev"):
            pass


def test_interleaved_alternates_the_order_of_the_trees_and_median_ratio():
    order = []
    trees = {"old": old_revision.REPO / "a", "new": old_revision.REPO / "b"}
    results = old_revision.interleaved(lambda tree: order.append(tree.name) or len(order),
                                       trees, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert results == {"old": [1, 4, 5], "new": [2, 3, 6]}
    assert old_revision.median_ratio([3.0, 1.0, 2.0], [4.0, 8.0, 6.0]) == pytest.approx(2 / 6)
