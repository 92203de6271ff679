"""MkDocs hooks (mkdocs.yml ``hooks:``): the same Markdown reads right on GitHub and on the site.

* The repository's two READMEs are pages of the site: README.md is its home page
  (``index.md``), deploy/README.md its deploy guide (``deploy.md``); so are CHANGELOG.md
  (``changelog.md``) and the licence, LICENSE (``license.md``: plain text, shown as such).
  Each is written once and its links are checked by the same strict build as every page in
  docs/.
* Links are written as they work in the repository, relative to the file (``docs/x.md``
  from README.md, ``../deploy/README.md#monitoring`` from docs/). Each one that leads to a
  page of the site is rewritten to that page (``x.md``, ``deploy.md#monitoring``). Any other
  relative link is left as it is, so the build's link validation refuses it: link a
  repository file that is not a page as a code span instead.
* In a table row, ``\\|`` inside a code span is a pipe: GitHub needs the backslash there
  (a bare pipe ends the cell), Python-Markdown does not (it would show it).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS_DIR = "docs"

#: Pages made from files outside docs/: page in the site -> the file in the repository.
GENERATED = {
    "index.md": "README.md",
    "deploy.md": "deploy/README.md",
    "changelog.md": "CHANGELOG.md",
    "license.md": "LICENSE",
}
#: Generated pages whose source is plain text: shown as it is, under a title.
PLAIN_TEXT = {"license.md": "License"}
_PAGE_OF_REPO_FILE = {source: page for page, source in GENERATED.items()}

#: An inline Markdown link's target, ``](target)``.
_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A code span, and a table row (a line that starts with a pipe).
_CODE_SPAN = re.compile(r"`[^`\n]+`")
_TABLE_ROW = re.compile(r"^\s*\|.*$", re.MULTILINE)


def repo_path(page: str) -> str:
    """Where the page ``page`` (a path in the site's docs) lives in the repository."""
    return GENERATED.get(page, posixpath.join(DOCS_DIR, page))


def site_link(target: str, page: str) -> str | None:
    """``target``, a link in the repository file of ``page``, as a link of the site; None
    when it leads to no page (a URL, an anchor of the same page, a file outside docs/)."""
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return None
    path, hash_, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path(page)), path))
    if resolved in _PAGE_OF_REPO_FILE:
        site_path = _PAGE_OF_REPO_FILE[resolved]
    elif resolved.startswith(DOCS_DIR + "/"):
        site_path = resolved[len(DOCS_DIR) + 1 :]
    else:
        return None
    # Every page sits at the top of the site's docs: the path is the link.
    return site_path + hash_ + anchor


def rewrite_links(markdown: str, page: str) -> str:
    def replace(match: re.Match[str]) -> str:
        link = site_link(match.group(1), page)
        return match.group(0) if link is None else f"]({link})"

    return _LINK.sub(replace, markdown)


def unescape_table_pipes(markdown: str) -> str:
    def row(match: re.Match[str]) -> str:
        return _CODE_SPAN.sub(lambda span: span.group(0).replace("\\|", "|"), match.group(0))

    return _TABLE_ROW.sub(row, markdown)


def on_files(files: Files, config: MkDocsConfig, **kwargs: Any) -> Files:
    for page, source in GENERATED.items():
        if files.get_file_from_path(page) is not None:
            raise ValueError(f"docs/{page} exists: the site's {page} is made from {source}")
        content = (REPO_ROOT / source).read_text(encoding="utf-8")
        if page in PLAIN_TEXT:
            content = f"# {PLAIN_TEXT[page]}\n\n```text\n{content.rstrip()}\n```\n"
        files.append(File.generated(config, page, content=content))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, **kwargs: Any) -> str:
    return unescape_table_pipes(rewrite_links(markdown, page.file.src_uri))


def on_serve(server: Any, config: MkDocsConfig, builder: Any, **kwargs: Any) -> Any:
    # `mkdocs serve` watches docs/ only: rebuild when a README changes too.
    for source in GENERATED.values():
        server.watch(str(REPO_ROOT / source))
    return server
