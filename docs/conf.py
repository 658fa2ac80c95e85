"""Sphinx configuration of the trec_pipelines documentation (`make docs`)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

from trec_pipelines import __version__  # noqa: E402  (after the path is set)

project = "trec_pipelines"
author = "the trec_pipelines authors"
copyright = "2026, the trec_pipelines authors"
version = release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
# Names our docstrings refer to in torch and torchrec that have no inventory here
# (the build runs offline): shown as code, not links.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
nitpicky = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

html_theme = "alabaster"
html_title = f"trec_pipelines {release}"
html_theme_options = {"description": "TorchRec's training pipelines, drop-in"}


def _check_every_public_name(app, env) -> None:  # type: ignore[no-untyped-def]
    """Warn (an error under -W) for each name in ``trec_pipelines.__all__`` the
    API reference does not document."""
    from sphinx.util import logging

    import trec_pipelines

    documented = set(env.get_domain("py").objects)
    for name in trec_pipelines.__all__:
        if f"trec_pipelines.{name}" not in documented:
            logging.getLogger(__name__).warning(
                "trec_pipelines.%s is public (__all__) but not in the API reference", name
            )


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("env-check-consistency", _check_every_public_name)
