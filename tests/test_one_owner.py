"""Each formula the library, its generation and its vLLM plugin share is written once, in its owner's file, and the
plugin calls it (docs/design.md, "One owner per formula"): a copy written again elsewhere fails here."""

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "causal_qwen"

# (what a copy would contain, the one file that may contain it, the owner's name the vLLM plugin calls)
FORMULAS = [
    ("torch.tan(math.pi * tail)", "cauchy.py", "value_interval"),  # the central interval's half-width
    ("symexp(y) if value_transform", "cauchy.py", "untransform_values"),  # a head value back to a value
    ("(entries[..., 2] > 0)", "context_values.py", "visible_entries"),  # which numbers a position reads
    ("posinf=_MAX_VALUE", "generated_numbers.py", "written_values"),  # the number a generation writes
    ("np.float32(v)", "generated_numbers.py", None),  # its digits
    ("reshape(1)", "migrations.py", "upgraded_weights"),  # a 0-dim tensor of an old checkpoint as a vector
    ("_LOG_PI = ", "cauchy.py", None),
]


def _sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in PACKAGE.rglob("*.py")}


@pytest.mark.parametrize(("text", "owner", "called"), FORMULAS)
def test_a_formula_is_written_in_its_owner_only(text, owner, called):
    holders = [name for name, source in _sources().items() if text in source]
    assert holders == [owner]
    if called is not None:
        assert called in _sources()["integrations/vllm.py"]


def test_the_plugin_imports_nothing_private_of_the_library():
    source = _sources()["integrations/vllm.py"]
    imports = [line for line in source.splitlines() if line.strip().startswith("from ..")]
    assert imports and not [line for line in imports if " import _" in line or ", _" in line]
