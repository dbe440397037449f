"""``load_script(name)``: a module of ``scripts/<name>.py``, loaded from its file (the scripts
are not a package). A module of its own, as ``shared_paths`` is (see there why not conftest)."""

import importlib.util
import pathlib

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """The module ``scripts/<name>.py``, freshly executed."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
