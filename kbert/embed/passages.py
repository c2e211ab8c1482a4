"""Long documents cut into passages for retrieval: whole sentences packed up to a model's token budget.

    spans = kbert.split_passages(decision_text, emb, max_tokens=128, overlap=1)   # [(start, end), ...]
    parts = kbert.split_documents(decisions, emb, max_tokens=128, ids=case_ids)  # texts, ids, metadata
    index = kbert.SearchIndex.build("my-bi-encoder", parts.texts, "cases", ids=parts.ids, metadata=parts.metadata)
    index.search("부당해고 구제 신청", top_k=5, group_by="document")            # the best passage per decision

A bi-encoder reads at most `max_length` tokens, so a statute or a court decision of thousands of tokens is either
cut (its first tokens only), read as the mean of its windows (`Embedder.encode(long_texts="mean")`, one vector
for the whole), or split into passages, each its own vector: the usual form of retrieval-augmented generation
(LangChain's and LlamaIndex's text splitters, DPR's 100-word passages), where a query finds the passage that
answers it and the reader gets that passage, not the document. Passages here are spans of the original text:
- cut at sentence ends (`kbert.data.sentences`' Korean rules, kiwipiepy's splitter, or lines), so no passage
  starts or ends mid-sentence unless one sentence alone is over the budget (then it is cut at token boundaries);
- packed greedily up to `max_tokens` tokens of the model's own tokenizer, [CLS], [SEP] and the document prompt
  counted, so each passage is encoded whole (not truncated);
- overlapping by `overlap` sentences, so an answer that spans a passage boundary is still read whole once;
- given as character offsets `(start, end)` into the document, so a hit can be shown in place.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Iterable, List, Optional, Sequence, Tuple

from kbert.data.sentences import get_splitter


def _token_counts(tokenizer, texts: List[str]) -> List[int]:
    return [len(ids) for ids in tokenizer.ids_batch(texts)] if texts else []


def _sentence_spans(text: str, splitter) -> List[Tuple[int, int]]:
    """Each sentence's (start, end) in `text`; a sentence the splitter changed (not found as it is) joins the
    span before it, so every character is covered once."""
    spans, at = [], 0
    for sentence in splitter(text):
        sentence = sentence.strip()
        if not sentence:
            continue
        start = text.find(sentence, at)
        if start < 0:
            continue
        spans.append((start, start + len(sentence)))
        at = start + len(sentence)
    if not spans:
        stripped = text.strip()
        return [(text.find(stripped), text.find(stripped) + len(stripped))] if stripped else []
    return spans


def _cut(tokenizer, text: str, span: Tuple[int, int], room: int) -> List[Tuple[int, int, int]]:
    """(start, end, tokens) pieces of one over-long sentence, each at most `room` tokens when tokenized on its
    own, cut between words where a word boundary lies in the second half of the window (else between tokens)."""
    start, end = span
    offsets = [(start + s, start + e) for s, e in
               tokenizer.encode(text[start:end], add_special_tokens=False).offsets if e > s]
    pieces, i = [], 0
    while i < len(offsets):
        limit = min(i + room, len(offsets))
        while True:
            j = limit
            if j < len(offsets):  # the last word start in the window's second half, if any
                j = next((k for k in range(j, i + room // 2, -1) if text[offsets[k][0] - 1].isspace()), j)
            # a piece tokenized alone may take a token more than inside the sentence ("과" becomes "▁과")
            count = _token_counts(tokenizer, [text[offsets[i][0]:offsets[j - 1][1]]])[0]
            if count <= room or j == i + 1:
                break
            limit = max(i + 1, j - (count - room))
        pieces.append((offsets[i][0], offsets[j - 1][1], count))
        i = j
    return pieces or [(start, end, 0)]


def split_passages(text: str, model, max_tokens: Optional[int] = None, overlap: int = 1,
                   splitter="rules", prompt: str = "") -> List[Tuple[int, int]]:
    """Character spans `(start, end)` of `text`'s passages, in order (an empty list for a blank text).

    Args:
        model: a `kbert.Embedder` (its tokenizer counts the tokens) or a `kbert.Tokenizer`.
        max_tokens: the most tokens a passage takes when encoded, [CLS], [SEP] and `prompt` included
            (default: the Embedder's max_length; required with a bare Tokenizer).
        overlap: sentences each passage repeats from the end of the one before (0: none).
        splitter: "rules" (kbert's Korean sentence rules, the default), "kiwi", "lines", or a function of a text
            returning its sentences.
        prompt: the text the model puts before each document (its document prompt), whose tokens count too.

    Example:
        >>> text = "제1조 이 법은 근로자의 기본적 생활을 보장한다. 제2조 이 법에서 사용하는 용어의 뜻은 다음과 같다."
        >>> [text[s:e] for s, e in kbert.split_passages(text, emb, max_tokens=24, overlap=0)]
    """
    tokenizer = getattr(model, "tokenizer", model)
    if max_tokens is None:
        max_tokens = getattr(model, "max_length", None)
        if max_tokens is None:
            raise ValueError("`max_tokens` is needed with a bare Tokenizer (an Embedder gives its max_length)")
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"`overlap` must be an integer >= 0. Received: overlap={overlap!r}")
    if not isinstance(text, str):
        raise TypeError(f"`text` must be a str. Received: {type(text).__name__}")
    room = int(max_tokens) - 2 - (_token_counts(tokenizer, [prompt])[0] if prompt else 0)
    if room < 1:
        raise ValueError(f"`max_tokens` {max_tokens} leaves no room for text after [CLS], [SEP] and the prompt")
    split = (lambda t: t.splitlines()) if splitter == "lines" else get_splitter(splitter)  # lines: one a sentence
    spans = _sentence_spans(text, split)
    counts = _token_counts(tokenizer, [text[s:e] for s, e in spans])
    units = []  # (start, end, tokens): sentences, and pieces of sentences over the budget
    for span, count in zip(spans, counts):
        units.extend([(span[0], span[1], count)] if count <= room else _cut(tokenizer, text, span, room))
    passages, first = [], 0
    while first < len(units):
        last, total = first, units[first][2]
        while last + 1 < len(units) and total + units[last + 1][2] <= room:
            last += 1
            total += units[last][2]
        # tokens of the joined span can differ from the sum of its sentences' (a piece merging across a space):
        # give back whole sentences until the span itself fits
        while last > first and _token_counts(tokenizer, [text[units[first][0]:units[last][1]]])[0] > room:
            last -= 1
        passages.append((units[first][0], units[last][1]))
        if last + 1 >= len(units):
            break
        first = max(first + 1, last + 1 - overlap)  # repeat `overlap` sentences, always moving on
    return passages


Passages = namedtuple("Passages", "texts ids metadata")
Passages.__doc__ = ("Parallel lists for `SearchIndex.build(texts, ids=, metadata=)`: each passage's text, its id "
                    "(\"document id#k\") and its metadata ({\"document\", \"passage\", \"start\", \"end\"} and the "
                    "document's own).")


def split_documents(documents: Iterable[str], model, max_tokens: Optional[int] = None, overlap: int = 1,
                    ids: Optional[Sequence] = None, metadata: Optional[Sequence[Optional[dict]]] = None,
                    splitter="rules", prompt: Optional[str] = None) -> Passages:
    """`split_passages` over a collection: every document's passages as texts, ids and metadata for a
    `kbert.SearchIndex`, whose `search(..., group_by="document")` then ranks documents by their best passage.

    Args:
        documents: the texts (statutes, decisions, articles).
        model: the `kbert.Embedder` the index will use (its tokenizer and max_length; its document prompt is
            counted unless `prompt` says otherwise), or a `kbert.Tokenizer` with `max_tokens`.
        ids: one id per document (default: positions 0, 1, ...); a passage's id is "<document id>#<k>".
        metadata: one dict (or None) per document, copied into each of its passages' metadata.
        max_tokens, overlap, splitter: as `split_passages`.

    Example:
        >>> parts = kbert.split_documents(decisions, emb, max_tokens=128, ids=case_numbers)
        >>> index = kbert.SearchIndex.build("my-bi-encoder", parts.texts, "cases", ids=parts.ids,
        ...                                 metadata=parts.metadata)
        >>> index.search("해고의 정당한 이유", top_k=5, group_by="document")
    """
    if isinstance(documents, (str, bytes)):
        raise TypeError("`documents` must be a collection of texts, not one string")
    documents = list(documents)
    ids = list(range(len(documents))) if ids is None else list(ids)
    metadata = [None] * len(documents) if metadata is None else list(metadata)
    if len(ids) != len(documents) or len(metadata) != len(documents):
        raise ValueError(f"`ids` and `metadata` need one entry per document: {len(documents)} documents, "
                         f"{len(ids)} ids, {len(metadata)} metadata")
    if prompt is None:
        prompt = model.role_prompt("document") if hasattr(model, "role_prompt") else ""
    out = Passages([], [], [])
    for doc_id, text, meta in zip(ids, documents, metadata):
        for k, (start, end) in enumerate(split_passages(text, model, max_tokens, overlap, splitter, prompt)):
            out.texts.append(text[start:end])
            out.ids.append(f"{doc_id}#{k}")
            out.metadata.append(dict(meta or {}, document=doc_id, passage=k, start=start, end=end))
    return out
