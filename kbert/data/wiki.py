"""Wikipedia dumps as documents: the articles of a `pages-articles` XML dump with their MediaWiki markup stripped.

Only what a language model should read is kept: paragraphs of prose (headings, lists, tables, templates,
references, file links and categories are dropped; links keep their text). Redirects and other namespaces
are skipped.
"""

from __future__ import annotations

import re
from typing import Iterator, List


_WIKI_DROP = [
    re.compile(r"<!--.*?-->", re.S),
    re.compile(r"<ref[^>/]*/>", re.S),
    re.compile(r"<ref[^>]*>.*?</ref>", re.S),
    re.compile(r"<(math|gallery|timeline|score|syntaxhighlight|source)[^>]*>.*?</\1>", re.S | re.I),
    re.compile(r"\{\|.*?\|\}", re.S),  # tables
]
_WIKI_FILE_LINK = re.compile(r"\[\[(?:File|Image|파일|그림|분류|Category):[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]",
                             re.I)
_WIKI_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_WIKI_EXT_LINK = re.compile(r"\[(?:https?:)?//[^\s\]]+\s?([^\]]*)\]")
_WIKI_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_WIKI_TAG = re.compile(r"</?[A-Za-z][^>]*>")
_WIKI_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M)
_WIKI_QUOTES = re.compile(r"'{2,}")


def strip_wiki_markup(text: str) -> List[str]:
    """MediaWiki source -> paragraphs of plain text (templates, tables, references, files, categories,
    headings and list markers removed; link labels kept)."""
    for pattern in _WIKI_DROP:
        text = pattern.sub(" ", text)
    for _ in range(5):  # nested templates, innermost first
        text, n = _WIKI_TEMPLATE.subn(" ", text)
        if not n:
            break
    text = _WIKI_FILE_LINK.sub(" ", text)
    text = _WIKI_LINK.sub(r"\1", text)
    text = _WIKI_EXT_LINK.sub(r"\1", text)
    text = _WIKI_TAG.sub(" ", text)
    text = _WIKI_HEADING.sub("", text)
    text = _WIKI_QUOTES.sub("", text)
    text = text.replace("&nbsp;", " ").replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    paragraphs = []
    for line in text.split("\n"):
        line = line.strip()
        if not line or line[0] in "*#:;|!{}" or line.startswith("__"):
            continue
        paragraphs.append(line)
    return paragraphs


def wiki_dump_articles(path: str) -> Iterator[List[str]]:
    import xml.etree.ElementTree as ET

    from kbert.utils import open_binary

    with open_binary(path) as f:
        ns = text = None
        redirect = False
        for _, elem in ET.iterparse(f, events=("end",)):
            tag = elem.tag.rsplit("}", 1)[-1]
            if tag == "ns":
                ns = elem.text
            elif tag == "redirect":
                redirect = True
            elif tag == "text":
                text = elem.text or ""
            elif tag == "page":
                if ns in (None, "0") and not redirect and text and not text.lstrip().lower().startswith(
                        ("#redirect", "#넘겨주기")):
                    yield strip_wiki_markup(text)
                ns = text = None
                redirect = False
                elem.clear()
