"""Each formula the library, its generation and its vLLM plugin share is written once, in its owner's file, and the
plugin calls it (docs/design.md, "One owner per formula"): a copy written again elsewhere fails here."""

import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "causal_qwen"

# (what a copy would contain, the one file that may contain it, the owner's name the vLLM plugin calls)
FORMULAS = [
    ("torch.tan(math.pi * tail)", "cauchy.py", "value_interval"),  # the central interval's half-width
    ("symexp(y) if value_transform", "cauchy.py", "untransform_values"),  # a head value back to a value
    ("(entries[..., 2] > 0)", "context_values.py", "visible_entries"),  # which numbers a position reads
    ("posinf=_MAX_VALUE", "generated_numbers.py", "written_values"),  # the number a generation writes
    ("min(low, value)", "numbers.py", "round_to_interval"),  # the digits it keeps, a value outside its interval
    ("np.float32(v)", "generated_numbers.py", None),  # its digits
    ("reshape(1)", "migrations.py", "upgraded_weights"),  # a 0-dim tensor of an old checkpoint as a vector
    ("_LOG_PI = ", "cauchy.py", None),
]


@functools.cache
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



# The owners of docs/design.md's table "One owner per formula": (file, the owner's name, what the vLLM plugin calls of
# it, or None where the plugin does not compute that formula).
OWNERS = [
    ("modeling.py", "CausalQwenNumericEmbedding.forward", "self.numeric_embedding("),
    ("cauchy.py", "transform_values", None),
    ("cauchy.py", "untransform_values", "untransform_values"),
    ("cauchy.py", "symlog", None),
    ("cauchy.py", "symexp", None),
    ("modeling.py", "CausalQwenAbduction.forward", "self.abduction(hidden_states)"),
    ("modeling.py", "CausalQwenAction.noisy_scale", None),
    ("modeling.py", "CausalQwenAction.head_inputs", "self.action.head_inputs("),
    ("modeling.py", "CausalQwenAction.classify", "self.action.classify("),
    ("modeling.py", "CausalQwenAction.regress", "self.action.regress("),
    ("context_values.py", "ContextRead.apply", None),
    ("cauchy.py", "ovr_probability", None),
    ("modeling.py", "CausalQwenAction.margin", None),
    ("generation_modes.py", "StandardRule.scores", 'DECISION_RULES["standard"].scores('),
    ("context_values.py", "CausalQwenContextValues.read", "path.read("),
    ("context_values.py", "keys_of", None),
    ("context_values.py", "entry_values", None),
    ("context_values.py", "visible_entries", "visible_entries("),
    ("context_values.py", "CausalQwenContextValues._scores", None),
    ("starts/path_guard.py", "_fit_guard", None),
    ("cauchy.py", "ovr_log_probs", None),
    ("cauchy.py", "ovr_log_prob_gradients", None),
    ("cauchy.py", "nll", None),
    ("loss.py", "causal_qwen_loss", None),
    ("loss.py", "combine_losses", None),
    ("loss.py", "safe_mean", None),
    ("cauchy.py", "uniform", None),
    ("cauchy.py", "from_uniform", None),
    ("generation_modes.py", "CausalRule.head_inputs", None),
    ("cauchy.py", "quantile", None),
    ("cauchy.py", "value_interval", "value_interval("),
    ("generated_numbers.py", "written_values", "written_values("),
    ("numbers.py", "round_to_interval", "round_to_interval("),
    ("cauchy.py", "kl_divergence", None),
    ("loading.py", "inverse_softplus", None),
    ("conversion.py", "convert_qwen", None),
    ("starts/learning.py", "ValueLearner", None),
    ("migrations.py", "upgrade_state_dict", None),
    ("migrations.py", "upgraded_weights", "upgraded_weights("),
]


@functools.cache
def _definitions() -> dict[str, list[str]]:
    """Every function and class of the package by qualified name (`Class.method`), with the files defining it."""
    import ast

    found: dict[str, list[str]] = {}

    def visit(node, prefix: str, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualified = prefix + child.name
                found.setdefault(qualified, []).append(name)
                if isinstance(child, ast.ClassDef):
                    visit(child, qualified + ".", name)

    for name, source in _sources().items():
        visit(ast.parse(source), "", name)
    return found


@pytest.mark.parametrize(("owner", "name", "plugin_calls"), OWNERS)
def test_each_formula_has_one_owner_that_the_plugin_calls(owner, name, plugin_calls):
    assert _definitions().get(name) == [owner]
    if plugin_calls is not None:
        assert plugin_calls in _sources()["integrations/vllm.py"]


def test_the_design_table_names_every_owner():
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    table = design[design.index("One owner per formula"):]
    table = table[:table.index("\n\n", table.index("| formula"))]
    rows = [line for line in table.splitlines() if line.strip().startswith("|")]
    for owner, name, _ in OWNERS:
        short = name.split(".")[-1]
        assert any(f"`{owner}`" in row and (f"`{name}`" in row or f"`{short}`" in row) for row in rows), name


# The house's sizes (docs/design.md): a file a newcomer reads in one sitting, a function on a screen or two, a class
# of one concern. The corpus's file is its templates' text.
_MAX_FILE_LINES, _MAX_FUNCTION_LINES, _MAX_CLASS_LINES = 700, 80, 250
_TEXT_FILES = ("data/corpus.py",)


def test_no_file_function_or_class_outgrows_the_house():
    import ast

    too_long = []
    for name, source in _sources().items():
        if name not in _TEXT_FILES and source.count("\n") > _MAX_FILE_LINES:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            limit = _MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else _MAX_FUNCTION_LINES if isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{name}: {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long
