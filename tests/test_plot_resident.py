"""`benchmarks/plot_resident.py` on the committed H200 results: every case of both runs drawn, a real PNG written."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import plot_resident  # noqa: E402

RESULTS = os.path.join(HERE, "..", "benchmarks", "results", "resident-2026-12-02.json")


def test_plot_of_the_recorded_runs(tmp_path):
    rows = plot_resident.rows_of([RESULTS])
    assert set(rows) == {"llama8b-b1", "llama8b-b64", "llama8b-prefill2k", "mixtral8l-b1", "llama8b-16k-b16",
                         "yuanm32-b1"}
    out = tmp_path / "resident.png"
    plot_resident.plot(rows, str(out), "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
