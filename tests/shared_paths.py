"""Where the tests find ``../shared/data`` (a module of its own, not ``conftest``: a second
``conftest.py`` elsewhere in the run, e.g. ``notebooks/clean/``, replaces the module named
``conftest`` in ``sys.modules``, so ``from conftest import ...`` at test time is fragile)."""

import os
import pathlib

# ../shared/data beside the checkout, or MRV2_SHARED_DATA (e.g. a copy carried to the GPU machine).
SHARED_DATA = pathlib.Path(os.environ.get(
    "MRV2_SHARED_DATA", pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"))
