"""Every generated table of the docs equals what its stored data gives now (app/bench/doc_tables.py):
a page edited by hand, or data rerun without `python -m app.bench.doc_tables`, fails here."""
import pytest

from app.bench.doc_tables import BENCHMARKS, ROOT, TABLES, benchmarks_page, blocks, pages, rendered


@pytest.mark.parametrize("page", pages())
def test_a_pages_generated_tables_equal_their_data(page):
    want, have = blocks(rendered(page)), blocks((ROOT / page).read_text())
    names = {name for name, (where, _, _) in TABLES.items() if page in where}
    assert set(have) == names, f"{page}: tables {sorted(have)}, expected {sorted(names)}"
    for name in names:
        assert have[name] == want[name], f"{page}: table {name} differs from its data; run python -m app.bench.doc_tables"


def test_the_benchmark_page_equals_its_stored_runs():
    assert (ROOT / BENCHMARKS).read_text() == benchmarks_page(), \
        f"{BENCHMARKS} differs from docs/benchmarks/; run python -m app.bench.doc_tables"
