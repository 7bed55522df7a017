"""The catalogue page (docs/catalogue.md) is generated from the registry and up to date.

The generator is ``docs/gen_catalogue.py``; it reads the rows of
``structinfer.testing.registry`` and each model's docstring (the Graph / Prior /
Potentials / Value columns of Singh & Buckley Table 1) and source (the excerpt).
"""

import importlib.util
import pathlib

import pytest

from structinfer.testing import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_catalogue", ROOT / "docs" / "gen_catalogue.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def test_every_model_docstring_has_the_catalogue_columns():
    for model in {m.model for m in registry.REGISTRY}:
        cols = gen.model_columns(model)
        assert all(cols[s].strip() for s in ("Graph", "Prior", "Potentials", "Value")), model
        assert gen.model_excerpt(model).count("\n") < 10


def test_a_missing_column_is_a_clear_error():
    def model(x):
        """A model.

        Graph:
            one node.

        Prior:
            uniform.
        """

    with pytest.raises(
        ValueError, match=r"model: docstring lacks the section\(s\) \['Potentials', 'Value'\]"
    ):
        gen.model_columns(model)


def test_catalogue_page_is_up_to_date():
    page = ROOT / "docs" / "catalogue.md"
    assert page.exists(), "run `python docs/gen_catalogue.py`"
    assert page.read_text() == gen.render_catalogue() + "\n", (
        "docs/catalogue.md is stale: run `python docs/gen_catalogue.py`"
    )
    assert gen.main(["--check"]) == 0


def test_check_reports_a_stale_page(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "catalogue.md"
    stale.write_text((ROOT / "docs" / "catalogue.md").read_text() + "edited by hand\n")
    monkeypatch.setattr(gen, "PAGE", stale)
    assert gen.main(["--check"]) == 1
    assert "is stale; run python docs/gen_catalogue.py" in capsys.readouterr().err
