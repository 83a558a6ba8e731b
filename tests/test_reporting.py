"""Tables: one Table rendered as plain text, Markdown and rich, and the record table of simulate/compare."""
from __future__ import annotations

from heterog.reporting import Column, Table, format_table, key_values


def test_text_pads_each_column_and_rules_the_header():
    tab = Table([Column("name", 6, "left"), Column("ms", 7)])
    tab.add("ab", "1.50")
    tab.add("longer-name", "12345678.00")         # wider than the column: kept whole
    assert tab.text(rule=True) == ("name        ms\n"
                                   "--------------\n"
                                   "ab        1.50\n"
                                   "longer-name 12345678.00")
    assert tab.text(header=False) == "ab        1.50\nlonger-name 12345678.00"


def test_markdown_aligns_as_the_columns_say():
    tab = Table([Column("method", align="left"), Column("ms"), Column("OOM")])
    tab.add("cp-ar", "1.5", "")
    assert tab.markdown() == "| method | ms | OOM |\n|---|---:|---:|\n| cp-ar | 1.5 |  |"


def test_rich_keeps_title_headers_and_alignment():
    tab = Table([Column("op", align="left"), Column("GFLOP")], title="t")
    tab.add("mm", "2.00")
    r = tab.rich()
    assert r.title == "t" and [c.header for c in r.columns] == ["op", "GFLOP"]
    assert [c.justify for c in r.columns] == ["left", "right"] and r.row_count == 1


def test_a_row_must_fill_the_columns():
    import pytest

    with pytest.raises(ValueError, match="row of 1 cells for 2 columns"):
        Table([Column("a"), Column("b")]).add("x")


def test_record_table_of_simulate_and_compare():
    rec = {"method": "cp-ar", "iteration_time_s": 0.0125, "order": "fifo", "compute_time_s": 0.01,
           "comm_time_s": 0.002, "overlap_ratio": 0.5, "peak_memory_bytes": {"gpu0": 2**30, "gpu1": 2**31},
           "oom": False, "search_time_s": 0.25}
    assert format_table([rec]).split("\n") == [
        "method         iter ms           order compute ms   comm ms overlap peak GiB (max)  OOM search s",
        "-" * 96,
        "cp-ar            12.50            fifo      10.00      2.00    0.50           2.00   no     0.25"]


def test_key_values():
    assert key_values({"sim_tasks_per_s": 5, "x": 1.5}) == f"{'sim_tasks_per_s':36s} 5\n{'x':36s} 1.5"
