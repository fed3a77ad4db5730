"""A step's page-table rows are cut to its widest context, not max_model_len: every page
a sequence reads is listed, the rest of the descriptor's row is the null page."""

import numpy as np

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, StepOutput
from orca_jax.core.step.engine_api import NULL_PAGE


class RecordingEngine:
    """Keeps every step's descriptor (and the page table as the step saw it)."""

    name = "recording"
    needs_token_ids = False

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.scheduler = None

    def warmup(self, buckets) -> None:
        del buckets

    def step(self, inputs) -> StepOutput:
        kv = self.scheduler.kv
        self.seen.append((inputs, kv.page_table.copy(), kv.row_of.copy()))
        return StepOutput(sampled_tokens=inputs.kv_lens, step_s=0.01)


def test_a_step_lists_each_sequence_s_context_pages_and_null_past_them():
    requests = [Request(id=i, arrival_s=0.0, prompt_len=20 + 7 * i, output_len=30)
                for i in range(5)]
    engine = RecordingEngine()
    # orca reserves every request's whole max_model_len up front: rows are full of pages
    # that a step does not read yet.
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256,
                                               max_model_len=512),
                             kv=KVConfig(num_kv_pages=400, page_size=8))
    scheduler = Scheduler(requests, policies.make_policy("orca", {}), engine, config)
    engine.scheduler = scheduler
    scheduler.run()
    assert len(engine.seen) >= 30
    for inputs, page_table, row_of in engine.seen:
        n = int(inputs.num_seqs[0])
        assert inputs.page_indices.shape == (inputs.bucket.num_seqs, 512 // 8)
        widest = -(-int(inputs.kv_lens[:n].max()) // 8)  # pages of the widest context
        rows = page_table[row_of[row_of >= 0]]
        for i in range(n):
            used = -(-int(inputs.kv_lens[i]) // 8)
            listed = inputs.page_indices[i]
            # The request's row up to the step's widest context, as the KV manager holds it.
            assert any(np.array_equal(r[:widest], listed[:widest]) for r in rows)
            assert (listed[:used] != NULL_PAGE).all()
            assert (listed[widest:] == NULL_PAGE).all()
        assert (inputs.page_indices[n:] == NULL_PAGE).all()
    # Pages past the contexts were held (reserved): the rows were cut, not empty.
    assert any((pt[row_of[row_of >= 0]] != NULL_PAGE).sum(axis=1).max()
               > -(-int(inp.kv_lens.max()) // 8) for inp, pt, row_of in engine.seen)
