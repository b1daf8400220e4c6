"""The persistent block-table rows a decode step reads: appends copied, replaced tables rewritten,
rows reused and the tensor grown as needed."""

from __future__ import annotations

import pathlib

from corral_engine import SamplingParams
from corral_engine.model.batch import BlockTableRows

from tests.engine.helpers import make_engine, random_prompts


def _row_values(rows: BlockTableRows, row: int, n: int) -> list[int]:
    return [int(v) for v in rows.table[row, :n]]


def test_appends_are_copied_and_a_replaced_table_is_rewritten() -> None:
    rows = BlockTableRows(num_columns=4, num_rows=2)
    table = [7, 8]
    r = rows.row(1, table)
    assert _row_values(rows, r, 2) == [7, 8]
    table.extend([9, 10, 11])  # in place, past the initial width: the columns grow
    assert rows.row(1, table) == r and _row_values(rows, r, 5) == [7, 8, 9, 10, 11]
    table[0] = 99  # the block manager never does this; shows that only the new tail is copied
    assert _row_values(rows, rows.row(1, table), 5) == [7, 8, 9, 10, 11]
    replaced = [3, 4]  # freed and re-allocated: a new list
    assert _row_values(rows, rows.row(1, replaced), 2) == [3, 4]


def test_rows_are_released_reused_and_grown() -> None:
    rows = BlockTableRows(num_columns=2, num_rows=1)
    a = rows.row(1, [1])
    b = rows.row(2, [2])  # no free row: the tensor doubles
    assert a != b and rows.table.shape[0] == 2
    rows.release(1)
    assert rows.row(3, [3]) == a
    assert _row_values(rows, b, 1) == [2] and _row_values(rows, a, 1) == [3]


def test_decode_rows_mirror_the_block_tables_through_preemption(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir, num_kv_blocks=16, block_size=8, kv_policy="preempt")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(8, 500, seed=3, min_len=20, max_len=40)):
        engine.add_request(f"r{i}", prompt, params)
    rows = engine.runner.batches.block_rows
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.live_sequences():
            entry = rows._rows.get(seq.seq_id)
            if entry is not None and entry[1] is seq.block_table:
                row, _, written = entry
                assert _row_values(rows, row, written) == seq.block_table[:written]
                checked += 1
    assert checked and engine.stats().num_preemptions_total > 0
    assert not rows._rows  # every finished request gave its rows back
