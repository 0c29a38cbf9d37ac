"""``python -m bench.catalogue --quick --json`` runs end to end (stores of 100 and 1,000 sessions),
takes the catalogue's fast path at every timed open (the bench asserts it) and reports its keys."""
from __future__ import annotations

import pytest

from tests.bench.test_bench_smoke import run_bench


@pytest.mark.timeout(300)
def test_catalogue_bench_runs_and_reports_its_keys(tmp_path) -> None:
    res = run_bench("catalogue", "--quick", "--reps", "3", "--dir", str(tmp_path))
    assert res["sizes"] == [100, 1000] and res["ratio_of"] == "1000/100"
    for key in ("store_open_ratio", "list_first_page_ratio", "list_middle_page_ratio", "first_open_ratio",
                "catalogue_note_ratio"):
        assert res[key] > 0, key
    for size in res["results"]:
        for key in ("store_open_s", "list_first_page_s", "list_middle_page_s", "first_open_s", "rebuild_s"):
            assert size[key] > 0, key
