"""The README and the docs keep their promises: short pages, links that lead somewhere, and the
guarantee sentence stating exactly the tolerances the exactness tests assert."""

import re
from pathlib import Path

import torch

from tests.integration.test_readme import script
from tests.unit.engine.test_batched import DEFAULT_MODEL_EPS
from tests.unit.engine.test_bf16 import DEFAULT_MODEL_BF16_EPS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_short_and_starts_with_something_to_run():
    lines = README.splitlines()
    assert len(lines) <= 300, len(lines)
    first_block = next(i for i, line in enumerate(lines, 1) if line.startswith("```sh"))
    assert first_block <= 120, first_block


def test_the_benchmarks_page_is_a_current_page():
    assert len((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()) <= 800


def guarantee(dtype: str) -> float:
    """The tolerance the README states for `dtype`: 'in **fp32**, **6e-4**'."""
    m = re.search(rf"in \*\*{dtype}\*\*, \*\*([0-9.]+(?:e-?[0-9]+)?)\*\*", README)
    assert m, f"the README's guarantee names no tolerance for {dtype}"
    return float(m.group(1))


def test_the_guarantee_states_the_tolerances_the_tests_assert():
    assert guarantee("fp32") == DEFAULT_MODEL_EPS
    assert guarantee("bf16") == DEFAULT_MODEL_BF16_EPS
    # "16 bf16 steps at logits of 32-64, where one step is 0.25"
    m = re.search(r"(\d+) bf16 steps at logits of (\d+)-(\d+), where one step is ([0-9]+(?:\.[0-9]+)?)", README)
    assert m, "the README states the bf16 tolerance in bf16 steps"
    steps, low, high, step = int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))
    assert high == 2 * low
    assert step == torch.finfo(torch.bfloat16).eps * low  # the spacing of bf16 numbers in [low, high)
    assert torch.tensor(low + step, dtype=torch.bfloat16).item() == low + step
    assert torch.tensor(low + step / 2, dtype=torch.bfloat16).item() in (low, low + step)
    assert steps * step == DEFAULT_MODEL_BF16_EPS


def test_relative_links_lead_to_files_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_readme_runner_keeps_every_block_in_order_and_skips_only_make_test():
    text = ("intro\n```sh\nmake demo\nmake test   # the suite\n```\n"
            "```python\nprint('hi')\n```\n```json\n{}\n```\n```sh\necho done\n```\n")
    s = script(text)
    assert "make demo" in s and "make test" not in s and "{}" not in s
    assert s.index("make demo") < s.index("print('hi')") < s.index("echo done")
    assert "<<'README_PYTHON'\nprint('hi')\nREADME_PYTHON\n" in s
