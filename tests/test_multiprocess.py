"""The process group's flags and the step descriptor's digest that multi-process runs check
(the two-process run itself is in test_tensor_parallel.py, against its tp=1 run)."""

import numpy as np
import pytest

from orca_jax.core.step.engine_api import Bucket
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model import distributed


def test_process_group_names_the_flag_it_lacks():
    with pytest.raises(ValueError, match="--num_processes=2 needs --coordinator=HOST:PORT"):
        distributed.ProcessGroup(num_processes=2, process_id=1)
    with pytest.raises(ValueError, match=r"--process_id=2 must be in \[0, --num_processes=2\)"):
        distributed.ProcessGroup(coordinator="localhost:1234", num_processes=2, process_id=2)
    distributed.initialize(distributed.ProcessGroup())  # one process: nothing to join
    assert not distributed.is_multiprocess()


def test_descriptor_digest_sees_a_changed_page_or_token():
    def descriptor(pages, tokens):
        return build_step_inputs(Bucket(16, 4), num_tokens=np.array([3, 1]),
                                 num_computed=np.array([0, 5]),
                                 page_rows=np.array(pages, np.int32), page_size=16,
                                 token_ids=np.array(tokens, np.int32))

    base = distributed.descriptor_digest(descriptor([[1, 2], [3, 4]], [7, 8, 9, 10]))
    assert base == distributed.descriptor_digest(descriptor([[1, 2], [3, 4]], [7, 8, 9, 10]))
    assert base != distributed.descriptor_digest(descriptor([[1, 2], [3, 5]], [7, 8, 9, 10]))
    assert base != distributed.descriptor_digest(descriptor([[1, 2], [3, 4]], [7, 8, 9, 11]))
    assert 0 <= base < 2 ** 31
