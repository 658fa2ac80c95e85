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
# Types in the signature, one parameter a line when it is long; the description
# then says only what the docstring says (no generated "Parameters" list that
# repeats a dataclass's documented attributes).
autodoc_typehints = "signature"
python_maximum_signature_line_length = 120
# Members without a docstring too (a pipeline's progress(), torchrec's methods);
# a dataclass's fields are left out where its docstring documents them (see
# _skip_documented_fields).
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
# Names our docstrings refer to in torch and torchrec that have no inventory here
# (the build runs offline): shown as code, not links.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
nitpicky = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" becomes one field list, with each type read from the annotation.
napoleon_use_ivar = True
napoleon_attr_annotations = True

html_theme = "alabaster"
html_title = f"trec_pipelines {release}"
html_static_path = ["_static"]
html_theme_options = {
    "description": "TorchRec's training pipelines, drop-in",
    # Wide enough for TrainPipelineSparseDistCompAutograd in the sidebar.
    "page_width": "1240px",
    "sidebar_width": "320px",
}
# The sidebar's navigation (docs/_templates/navigation.html) goes one level
# deeper than the index's toctrees, to the API page's classes under its groups.
templates_path = ["_templates"]


def _check_every_public_name(app, env) -> None:  # type: ignore[no-untyped-def]
    """Warn (an error under -W) for each public name (``trec_pipelines.__all__``,
    ``trec_pipelines.testing.__all__``) the API reference does not document."""
    from sphinx.util import logging

    import trec_pipelines
    import trec_pipelines.testing

    documented = set(env.get_domain("py").objects)
    for module in (trec_pipelines, trec_pipelines.testing):
        for name in module.__all__:
            if f"{module.__name__}.{name}" not in documented:
                logging.getLogger(__name__).warning(
                    "%s.%s is public (__all__) but not in the API reference", module.__name__, name
                )


# The class whose members autodoc is choosing, by the directive's options object
# (the same object reaches autodoc-process-docstring for the class and
# autodoc-skip-member for each of its members).
_class_of_options: dict[int, type] = {}


def _remember_class(app, what, name, obj, options, lines) -> None:  # type: ignore[no-untyped-def]
    if what in ("class", "exception") and isinstance(obj, type):
        _class_of_options[id(options)] = obj


def _skip_documented_fields(app, what, name, obj, skip, options):  # type: ignore[no-untyped-def]
    """Leave out a dataclass field its class's docstring documents (under
    "Attributes:"): it is listed there once, with its type and meaning."""
    import dataclasses
    import re

    cls = _class_of_options.get(id(options))
    if skip or cls is None or not dataclasses.is_dataclass(cls):
        return None
    if name not in {f.name for f in dataclasses.fields(cls)}:
        return None
    if re.search(rf"^\s+{re.escape(name)}( \(.*\))?:", cls.__doc__ or "", re.M):
        return True
    return None


def _public_bases(app, name, obj, options, bases) -> None:  # type: ignore[no-untyped-def]
    """Show a class's public bases: leave out our internal ones (PipelineCore,
    the mixins of core/), which the reader cannot look up here."""
    import trec_pipelines

    public = set(trec_pipelines.__all__)
    kept = [
        base
        for base in bases
        if not (
            getattr(base, "__module__", "").startswith("trec_pipelines.")
            and base.__name__ not in public
        )
    ]
    if kept:
        bases[:] = kept


def _readable_defaults(app, what, name, obj, options, signature, return_annotation):  # type: ignore[no-untyped-def]
    """Defaults whose repr is not Python (``<factory>`` of a dataclass field,
    ``<class 'a.b.C'>``, ``<Enum.MEMBER: 'v'>``) break the signature's layout
    (one parameter a line): show them as ``...`` (a fresh default), ``C`` and
    ``Enum.MEMBER``."""
    import re

    if signature is None or "<" not in signature:
        return None
    signature = signature.replace("<factory>", "...")
    signature = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", signature)
    signature = re.sub(r"<(\w+\.\w+): [^<>]*>", r"\1", signature)
    return signature, return_annotation


def _public_target(app, env, node, contnode):  # type: ignore[no-untyped-def]
    """Resolve a docstring's reference by module path
    (``trec_pipelines.sparse.forwards.PipelinedForward``) to the public name this
    page documents (``trec_pipelines.PipelinedForward``)."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith("trec_pipelines."):
        return None
    domain = env.get_domain("py")
    parts = target.split(".")
    for i in range(2, len(parts)):
        for package in ("trec_pipelines", "trec_pipelines.testing"):
            candidate = ".".join([package, *parts[i:]])
            if candidate in domain.objects:
                return domain.resolve_xref(
                    env, node["refdoc"], app.builder, node["reftype"], candidate, node, contnode
                )
    return None


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("env-check-consistency", _check_every_public_name)
    app.connect("autodoc-process-docstring", _remember_class)
    app.connect("autodoc-skip-member", _skip_documented_fields)
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("autodoc-process-signature", _readable_defaults)
    app.connect("missing-reference", _public_target)
