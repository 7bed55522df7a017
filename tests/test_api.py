import importlib

import structinfer as si


def test_every_public_name_imports_and_is_documented():
    for name in si.__all__:
        obj = getattr(si, name)
        if name.startswith("__"):
            continue
        assert obj.__doc__, f"structinfer.{name} has no docstring"


def test_submodule_public_names_have_docstrings():
    for mod_name in [
        "structinfer.priors",
        "structinfer.scores",
        "structinfer.handlers",
        "structinfer.testing",
        "structinfer.testing.registry",
        "structinfer.testing.oracles",
    ]:
        mod = importlib.import_module(mod_name)
        assert mod.__doc__
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, str):
                continue
            assert obj.__doc__, f"{mod_name}.{name} has no docstring"
