"""Named corpora (`kolaw`, `kobill`, `movie-reviews`, `korsts`, `kornli`, `wikipedia-ko`): where their files
are, how `Corpus` reads them, and the one explicit download (`kbert corpus download NAME`).

Nothing is downloaded implicitly: a recipe's files come from konlpy's bundled corpora, `path=...`, or
`$KBERT_DATA/NAME` (default ~/.cache/kbert/corpora/NAME). `movie_review_sentiment` builds the labelled
sentiment set of the tutorials and benchmarks from the movie-review recipe; `nli_triplets` the (anchor, positive,
hard negative) rows of a bi-encoder's NLI stage from the KorNLI recipe.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
from typing import Callable, List, Optional, Sequence

from kbert.utils import open_text


def _konlpy_files(name: str) -> List[str]:
    try:
        import konlpy
    except ImportError as e:
        raise ImportError(f"The {name!r} corpus ships with konlpy: pip install konlpy") from e
    folder = os.path.join(os.path.dirname(konlpy.__file__), "data", "corpus", name)
    files = sorted(glob.glob(os.path.join(folder, "*.txt")))
    if not files:
        raise FileNotFoundError(f"konlpy's {name!r} corpus is missing from {folder}")
    return files


def data_home() -> str:
    """Where `kbert corpus download` puts data: $KBERT_DATA, else ~/.cache/kbert/corpora."""
    return os.environ.get("KBERT_DATA") or os.path.join(os.path.expanduser("~"), ".cache", "kbert", "corpora")


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    files: Callable[[Optional[str]], List[str]]  # path override -> files
    options: dict
    urls: Sequence[str] = ()

    def readme(self) -> str:
        return f"corpora/{self.name}/README.md"


def find_files(name: str, filenames: Sequence[str], path: Optional[str]) -> List[str]:
    """The recipe's files under `path` (a file or dir), else under data_home()/name."""
    candidates = [path] if path else [os.path.join(data_home(), name)]
    for base in candidates:
        if base and os.path.isfile(base):
            return [base]
        if base and os.path.isdir(base):
            found = [os.path.join(base, f) for f in filenames if os.path.exists(os.path.join(base, f))]
            if found:
                return found
    recipe = RECIPES.get(name)
    fetch = (f"run `kbert corpus download {name}`" if recipe is not None and recipe.urls else
             f"put the files at {os.path.join(data_home(), name)} ($KBERT_DATA/{name}): it has no download URL")
    raise FileNotFoundError(
        f"Corpus {name!r} not found at {candidates[0]!r}: pass path=... (a file or the folder holding "
        f"{', '.join(filenames)}), or {fetch}; see corpora/{name}/README.md")


RECIPES = {
    "kolaw": Recipe("kolaw", "Korean constitution (konlpy, offline)", lambda p: _konlpy_files("kolaw"),
                    {"format": "text", "file_is_document": True}),
    "kobill": Recipe("kobill", "Korean National Assembly bills (konlpy, offline)",
                     lambda p: _konlpy_files("kobill"), {"format": "text", "file_is_document": True}),
    "movie-reviews": Recipe(
        "movie-reviews", "Naver movie reviews, one document per movie",
        lambda p: find_files("movie-reviews", ["reviews.tsv.gz", "reviews.tsv"], p),
        {"format": "tsv", "column": "text", "group_by": "movie_id"}),
    "korsts": Recipe(
        "korsts", "KorSTS sentence pairs (each sentence a one-sentence document)",
        lambda p: find_files("korsts", ["sts-train.tsv", "sts-dev.tsv"], p),
        {"format": "tsv", "column": ["sentence1", "sentence2"], "dedupe": "sentence"},
        urls=tuple(f"https://raw.githubusercontent.com/kakaobrain/KorNLUDatasets/master/KorSTS/{f}"
                   for f in ("sts-train.tsv", "sts-dev.tsv", "sts-test.tsv"))),
    "kornli": Recipe(
        "kornli", "KorNLI premises and hypotheses (each sentence a one-sentence document)",
        lambda p: find_files("kornli", ["multinli.train.ko.tsv", "snli_1.0_train.ko.tsv", "xnli.dev.ko.tsv"], p),
        {"format": "tsv", "column": ["sentence1", "sentence2"], "dedupe": "sentence"},
        urls=tuple(f"https://raw.githubusercontent.com/kakaobrain/KorNLUDatasets/master/KorNLI/{f}"
                   for f in ("multinli.train.ko.tsv", "snli_1.0_train.ko.tsv", "xnli.dev.ko.tsv",
                             "xnli.test.ko.tsv"))),
    "wikipedia-ko": Recipe(
        "wikipedia-ko", "Korean Wikipedia articles from a pages-articles dump",
        lambda p: find_files("wikipedia-ko", ["kowiki-latest-pages-articles.xml.bz2"], p),
        {"format": "wiki"},
        urls=("https://dumps.wikimedia.org/kowiki/latest/kowiki-latest-pages-articles.xml.bz2",)),
}


def download(name: str, directory: Optional[str] = None, progress: bool = True) -> List[str]:
    """Downloads a recipe's files (only ever called explicitly: `kbert corpus download NAME`)."""
    import shutil
    import urllib.request

    recipe = recipe_named(name)
    if not recipe.urls:
        raise ValueError(f"Corpus {name!r} has no download URL ({recipe.description}): pass its files with "
                         f"path=... (--path), or put them at {os.path.join(data_home(), name)}; see {recipe.readme()}")
    directory = directory or os.path.join(data_home(), name)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for url in recipe.urls:
        target = os.path.join(directory, url.rsplit("/", 1)[-1])
        if os.path.exists(target):
            paths.append(target)
            continue
        partial = target + ".part"
        from kbert.utils import progress_bar

        with urllib.request.urlopen(url) as response, open(partial, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            bar = progress_bar(total, desc=os.path.basename(target), unit="B", enabled=progress)
            while True:
                chunk = response.read(1 << 20)
                if not chunk:
                    break
                out.write(chunk)
                bar.update(len(chunk))
            bar.close()
        os.replace(partial, target)
        if target.endswith(".zip"):
            shutil.unpack_archive(target, directory)
        paths.append(target)
    return paths


def recipe_named(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"Unknown corpus {name!r}; named corpora are {sorted(RECIPES)} (or pass a path)")
    return RECIPES[name]


def movie_review_sentiment(path: Optional[str] = None, split: str = "train", limit: Optional[int] = None,
                           dev_fraction: float = 0.1, seed: int = 0) -> List[dict]:
    """A balanced binary sentiment set built from the movie-review recipe the way NSMC was: non-empty
    reviews of at most 140 characters, ratings 1-4 labelled "0" (negative), 9-10 labelled "1" (positive).

    Movies (not reviews) are split between `split="train"` and `"dev"` by a hash of the movie id, so no
    movie's reviews leak across; the majority class is down-sampled to the minority's size, and rows come
    shuffled with `seed`. Returns dicts with `text` and `label` (what `kbert.finetune` reads).
    """
    import csv
    import random

    if split not in ("train", "dev"):
        raise ValueError(f"`split` must be 'train' or 'dev'. Received: split={split!r}")
    files = find_files("movie-reviews", ["reviews.tsv.gz", "reviews.tsv"], path)
    by_label = {"0": [], "1": []}
    for file in files:
        with open_text(file) as f:
            for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
                text = (row.get("text") or "").strip()
                try:
                    rating = int(row.get("rating") or 0)
                except ValueError:
                    continue
                if not text or len(text) > 140 or 5 <= rating <= 8 or rating < 1:
                    continue
                digest = hashlib.md5(str(row.get("movie_id")).encode()).digest()[0] / 256.0
                if (digest < dev_fraction) != (split == "dev"):
                    continue
                by_label["1" if rating >= 9 else "0"].append(text)
    rng = random.Random(seed)
    size = min(len(v) for v in by_label.values())
    if limit is not None:
        size = min(size, limit // 2)
    rows = [{"text": t, "label": label} for label, texts in by_label.items() for t in rng.sample(texts, size)]
    rng.shuffle(rows)
    return rows


KORNLI_TRAIN_FILES = ("multinli.train.ko.tsv", "snli_1.0_train.ko.tsv")


def nli_triplets(path: Optional[str] = None, limit: Optional[int] = None) -> List[dict]:
    """KorNLI as the rows of a bi-encoder's NLI stage: `{"anchor": premise, "positive": an entailed hypothesis,
    "negative": a contradicting one}`, the contradiction a hard negative for in-batch training (the recipe behind
    sentence-transformers' NLI models and the Korean ones trained like them).

    `path`: a KorNLI TSV (`sentence1`, `sentence2`, `gold_label`, as kakaobrain's files) or a folder holding the
    training files (multinli, snli), else the recipe's download dir. A premise gives a row per entailed hypothesis,
    each with one of its contradictions in turn (SNLI writes several of each for one premise); a premise without
    both labels gives none. Rows keep the files' order; `limit` keeps the first ones."""
    import csv

    files = find_files("kornli", KORNLI_TRAIN_FILES, path)
    by_premise = {}  # insertion-ordered: premise -> {label: [hypotheses]}
    for file in files:
        with open_text(file) as f:
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            missing = {"sentence1", "sentence2", "gold_label"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{file} is not a KorNLI TSV: no column {sorted(missing)[0]!r}; its columns are "
                                 f"{reader.fieldnames}")
            for row in reader:
                premise, hypothesis = (row["sentence1"] or "").strip(), (row["sentence2"] or "").strip()
                label = (row["gold_label"] or "").strip()
                if premise and hypothesis:
                    by_premise.setdefault(premise, {}).setdefault(label, []).append(hypothesis)
    rows = []
    for premise, labels in by_premise.items():
        positives, negatives = labels.get("entailment", []), labels.get("contradiction", [])
        for i, positive in enumerate(positives if negatives else []):
            rows.append({"anchor": premise, "positive": positive, "negative": negatives[i % len(negatives)]})
            if limit is not None and len(rows) >= limit:
                return rows
    return rows

