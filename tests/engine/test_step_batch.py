"""The step batch (`minerva.engine.step_batch`): the views unpacked are the sequences packed,
and a burst's `advance` gives the buffer that packing the next step anew gives."""

from __future__ import annotations

import torch

from minerva.engine.step_batch import FORWARD, HEADER, STOP, Seq, StepBatch

BS = 4
TABLES = [[[7, 2, 9], [1, 3, 5]], [[4, 0], [6, 8]]]  # two sequences, two groups of the layout


def test_unpack_gives_what_was_packed():
    seqs = [Seq([11, 12, 13], 5, TABLES[0], logit_rows=1), Seq([21], 6, TABLES[1], logit_rows=1)]
    batch = StepBatch.pack(seqs, groups=2, block_size=BS)
    assert batch.header == [FORWARD, 4, 2, 3, 2]
    v = StepBatch.unpack(batch.tensor, 2, torch.device("cpu"))
    assert v.ids.tolist() == [11, 12, 13, 21] and v.positions.tolist() == [5, 6, 7, 6]
    slot = lambda table, p: table[p // BS] * BS + p % BS  # noqa: E731
    assert v.slots.tolist() == [[slot(TABLES[0][g], p) for p in (5, 6, 7)] + [slot(TABLES[1][g], 6)] for g in (0, 1)]
    assert v.query_start_loc.tolist() == [0, 3, 4] and v.seq_lens.tolist() == [8, 7]
    assert v.tables.tolist() == [[[7, 2, 9], [4, 0, 0]], [[1, 3, 5], [6, 8, 0]]]  # zero-padded to the width
    assert v.logit_rows.tolist() == [2, 3] and not v.copied
    assert v.ids.data_ptr() == batch.tensor.data_ptr() + HEADER * 8  # views, not copies


def test_advance_is_the_next_step_packed_anew():
    tables = [TABLES[0], [[4, 0, 10], [6, 8, 12]]]  # room for three more tokens each
    seqs = [Seq([11], 5, tables[0], 1), Seq([21], 6, tables[1], 1)]
    batch = StepBatch.pack(seqs, 2, BS)
    views = StepBatch.unpack(batch.tensor, 2, torch.device("cpu"))
    for step, tokens in enumerate([[30, 40], [31, 41], [32, 42]], start=1):
        batch.advance(tokens, BS)
        fresh = StepBatch.pack([Seq([tokens[0]], 5 + step, tables[0], 1), Seq([tokens[1]], 6 + step, tables[1], 1)], 2, BS)
        assert batch.buf == fresh.buf, step
        assert views.ids.tolist() == tokens  # the tensors over the buffer see it
    assert StepBatch.kind_of(StepBatch.stop()) == STOP
