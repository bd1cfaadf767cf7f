"""compute/models/families.py: one record per family, the only place that names them.

- docs/models.md lists exactly the records ("Families and their names");
- every name the loaders accept is a record's, looked up by either format's name, and any
  other is refused with the list the loaders' tests match on;
- no module of compute/, services/ or kernels/ but families.py compares or indexes on an
  architecture name (the family facts stay in their records);
- the records are pure data: importing them loads no torch and nothing of the project but
  compute/core at most.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from compute.models.families import (
    FAMILIES,
    GEMMA_VOCAB,
    METASPACE,
    NORMALIZER_PREFIX,
    PATTERN,
    Family,
    gguf_family,
    gguf_sentencepiece,
    hf_family,
)

ROOT = Path(__file__).resolve().parents[2]
HEADER = "| family | Hugging Face `model_type` | GGUF `general.architecture` |"
# The names each loader accepts, in the order it lists them when it refuses another
# (tests/engine/test_loaders_families.py and test_model_families.py match those lists).
HF_NAMES = ", ".join(f.hf_model_type for f in FAMILIES if f.hf_model_type)
GGUF_NAMES = ", ".join(f.gguf_architecture for f in FAMILIES if f.gguf_architecture)


def _cell_name(cell: str) -> str | None:
    cell = cell.strip()
    if cell == "—":
        return None
    assert cell.startswith("`") and cell.endswith("`") and cell.count("`") == 2, cell
    return cell.strip("`")


def _documented() -> list[tuple[str, str | None, str | None]]:
    """(family, model_type, general.architecture) of each row of docs/models.md's table."""
    lines = (ROOT / "docs" / "models.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        name, hf, gguf = line.strip("|").split(" | ")[:3]
        rows.append((name.strip(), _cell_name(hf), _cell_name(gguf)))
    return rows


def test_docs_list_every_family_by_its_names() -> None:
    records = [(f.name, f.hf_model_type, f.gguf_architecture) for f in FAMILIES]
    assert _documented() == records


def test_every_name_maps_to_one_record() -> None:
    hf = [f.hf_model_type for f in FAMILIES if f.hf_model_type]
    gguf = [f.gguf_architecture for f in FAMILIES if f.gguf_architecture]
    classes = [f.hf_class for f in FAMILIES if f.hf_class]
    names = [f.name for f in FAMILIES]
    for listed in (hf, gguf, classes, names):
        assert len(set(listed)) == len(listed), listed
    for family in FAMILIES:
        assert family.hf_model_type or family.gguf_architecture, family.name
        if family.hf_model_type:
            assert hf_family(family.hf_model_type) is family
            assert hf_family(None, ["Other", family.hf_class]) is family
        if family.gguf_architecture:
            assert gguf_family(family.gguf_architecture) is family


@pytest.mark.parametrize(
    ("lookup", "name", "supported"),
    [
        (hf_family, "gemma3", HF_NAMES),  # GGUF's name is not config.json's
        (hf_family, None, HF_NAMES),
        (gguf_family, "mixtral", GGUF_NAMES),  # llama.cpp writes Mixtral as llama
        (gguf_family, "gemma", GGUF_NAMES),  # Gemma 1: its vocabulary only
    ],
)
def test_other_names_are_refused_naming_the_supported(lookup, name, supported) -> None:
    message = f"unsupported architecture {name!r} (supported: {supported})"
    with pytest.raises(ValueError) as err:
        lookup(name)
    assert str(err.value) == message


def test_unknown_classes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unsupported architecture None"):
        hf_family(None, ["FalconForCausalLM"])


def test_sentencepiece_styles_of_any_architecture() -> None:
    assert gguf_sentencepiece("gemma3") == gguf_sentencepiece("gemma") == GEMMA_VOCAB
    assert gguf_sentencepiece("phi3") == NORMALIZER_PREFIX
    assert gguf_sentencepiece("llama") == gguf_sentencepiece("t5") == METASPACE
    assert gguf_sentencepiece(None) == METASPACE


def test_a_record_is_checked() -> None:
    with pytest.raises(ValueError, match="swa_pattern"):
        Family("X", "x", "XForCausalLM", "x", window_layers=PATTERN)
    with pytest.raises(ValueError, match="window_layers"):
        Family("X", "x", "XForCausalLM", "x", window_layers="some")
    with pytest.raises(ValueError, match="sentencepiece"):
        Family("X", "x", "XForCausalLM", "x", sentencepiece="t5")


_ARCHITECTURE_NAMES = {"model_type", "arch", "architecture"}


def _names_an_architecture(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id in _ARCHITECTURE_NAMES)
        or (isinstance(n, ast.Attribute) and n.attr in _ARCHITECTURE_NAMES)
        for n in ast.walk(node)
    )


def test_only_the_records_decide_on_an_architecture_name() -> None:
    found = []
    for package in ("compute", "services", "kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "families.py" or "gen" in path.relative_to(ROOT).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                compared = isinstance(node, ast.Compare) and any(
                    _names_an_architecture(n) for n in (node.left, *node.comparators)
                )
                indexed = isinstance(node, ast.Subscript) and _names_an_architecture(node.slice)
                if compared or indexed:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_the_records_are_pure_data() -> None:
    code = (
        "import json, sys\nimport compute.models.families\nprint(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(out.stdout))
    assert "torch" not in loaded
    ours = {m for m in loaded if m.split(".")[0] in ("compute", "services", "kernels")}
    allowed = {"compute", "compute.models", "compute.models.families"}
    assert {m for m in ours if not m.startswith("compute.core")} <= allowed, ours
