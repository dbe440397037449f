"""Sphinx extension of the mrv2 book: small fixes the pages need to load cleanly offline.

- sphinx-thebe registers its inline configuration script once per read pass, so a full
  rebuild repeats ``const THEBE_JS_URL = ...`` in every page, a SyntaxError in the browser
  ("Identifier 'THEBE_JS_URL' has already been declared"); each page keeps one copy.
"""

from __future__ import annotations


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:  # the same inline script may come twice (filename None and "")
        key = (getattr(js, "filename", js) or None, tuple(sorted(getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique  # in place: Sphinx renders from this very list


def setup(app):
    """Register the page hook (after every other extension's)."""
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
