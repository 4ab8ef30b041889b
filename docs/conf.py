"""Sphinx configuration: MyST Markdown pages rendered with furo.

Build (warnings are errors, as in CI)::

    pip install -e ".[docs]"
    sphinx-build -W -b html docs docs/_build/html
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "collectives"
author = "the collectives developers"
copyright = "2026, the collectives developers"
try:  # the one version: pyproject.toml's, from the installed package's metadata
    from importlib.metadata import version as _version
    release = _version("collectives")
except Exception:  # noqa: BLE001  (not installed: the docs still build)
    release = "unknown"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

myst_heading_anchors = 3          # [text](page.md#a-heading) links
myst_enable_extensions = ["colon_fence", "deflist"]

html_theme = "furo"
html_title = "collectives"
html_static_path = []
