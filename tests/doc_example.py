"""The Python example a docs page prints between its markers, as the page prints it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def example(page: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    block = re.search(r"<!-- example: begin -->\n```python\n(.*?)```\n<!-- example: end -->", text, re.S)
    assert block, f"the example's markers are missing from docs/{page}"
    return block.group(1)
