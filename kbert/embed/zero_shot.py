"""Zero-shot classification with a natural-language-inference model, as transformers' zero-shot-classification
pipeline does it (Yin et al., 2019): each candidate label becomes a hypothesis (`hypothesis_template` with the
label put in), the NLI model reads every (text, hypothesis) pair, and the label's score comes from the
entailment logit: a softmax over the candidates' entailment logits (one label per text), or with `multi_label`
each label on its own, entailment against contradiction. Korean NLI cross-encoders (KLUE-NLI and KorNLI
fine-tunes, or a `kbert finetune --task pair-classification` model trained on NLI) work as they are.

kbert tokenizes each text once and each hypothesis once, then joins their ids, where the pipeline tokenizes
every pair; a text too long for the model is cut, the hypothesis never (the pipeline's `only_first`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from kbert.utils import softmax  # numpy is imported where it is used: `kbert --help` reads DEFAULT_TEMPLATE

DEFAULT_TEMPLATE = "이 예시는 {}입니다."  # transformers' "This example is {}."; 입니다 follows any noun


def candidate_list(candidate_labels) -> List[str]:
    """The candidate labels as a list: a list as given, or a comma-separated string split as the pipeline
    splits it. Empty or repeated labels raise ValueError."""
    if isinstance(candidate_labels, str):
        candidate_labels = [x.strip() for x in candidate_labels.split(",") if x.strip()]
    labels = [str(x) for x in (candidate_labels or [])]
    if not labels:
        raise ValueError("zero-shot classification needs at least one candidate label")
    if len(set(labels)) != len(labels):
        raise ValueError(f"candidate labels repeat: {labels}")
    return labels


# A particle written in both forms right after `{}` takes the one the label's last syllable asks for:
# (after a final consonant, after a vowel)
_PARTICLES = {"은(는)": ("은", "는"), "는(은)": ("은", "는"), "이(가)": ("이", "가"), "가(이)": ("이", "가"),
              "을(를)": ("을", "를"), "를(을)": ("을", "를"), "과(와)": ("과", "와"), "와(과)": ("과", "와"),
              "아(야)": ("아", "야"), "야(아)": ("아", "야"), "(이)": ("이", ""), "(으)": ("으", "")}
_RIEUL = 8  # ㄹ's index among the final consonants: 로 follows it directly (서울로), as after a vowel


def with_particle(label: str, rest: str) -> str:
    """`rest` (the template after `{}`) with a particle written in both forms at its start (은(는), 이(가),
    을(를), 과(와), 아(야), (이)다, (으)로) made the one `label` takes: 스포츠는, 정치는 / 경제가, 법이 /
    서울로, 부산으로. A label not ending in a Hangul syllable (IT, 2024) keeps the written form."""
    last = label[-1:] if label else ""
    if not "\uac00" <= last <= "\ud7a3":
        return rest
    final = (ord(last) - 0xAC00) % 28  # 0: no final consonant
    for form, (after_consonant, after_vowel) in _PARTICLES.items():
        if rest.startswith(form):
            consonant = final != 0 and not (form == "(으)" and final == _RIEUL)
            return (after_consonant if consonant else after_vowel) + rest[len(form):]
    return rest


def hypotheses(candidate_labels: Sequence[str], hypothesis_template: str) -> List[str]:
    """Each label put into the template, with a particle written in both forms right after `{}` made the one
    the label takes (`with_particle`: "이 글의 주제는 {}(이)다." gives 스포츠다 and 법이다); a template
    without one `{}` raises ValueError (every hypothesis would be the same sentence)."""
    try:
        ok = isinstance(hypothesis_template, str) and hypothesis_template.format("\0") != hypothesis_template
    except (IndexError, KeyError, ValueError):  # "{label}", "{0} {1}", an unmatched brace
        ok = False
    if not ok:
        raise ValueError(f"hypothesis_template must hold one `{{}}` where a label goes (e.g. {DEFAULT_TEMPLATE!r}). "
                         f"Received: {hypothesis_template!r}")
    head, rest = hypothesis_template.split("{}", 1) if "{}" in hypothesis_template else (None, None)
    if head is None or "{" in rest.replace("{{", "") or "{" in head.replace("{{", ""):  # "{0}": format it as given
        return [hypothesis_template.format(label) for label in candidate_labels]
    unescape = lambda t: t.replace("{{", "{").replace("}}", "}")  # noqa: E731
    return [unescape(head) + label + with_particle(label, unescape(rest)) for label in candidate_labels]


def nli_indices(labels: Optional[Sequence[str]]):
    """(entailment, contradiction) indices of an NLI model's labels: the label starting with "entail"
    (case-insensitive, as the pipeline looks for it); contradiction is the label starting with "contradict",
    else the pipeline's guess (the last label when entailment is the first, else the first). Labels without
    an entailment label raise ValueError: the model is not an NLI model."""
    names = [str(x).lower() for x in (labels or [])]
    entail = next((i for i, x in enumerate(names) if x.startswith("entail")), None)
    if entail is None:
        raise ValueError(f"zero-shot classification needs a natural-language-inference model, with an "
                         f"'entailment' label; this one's labels are {list(labels or [])}")
    contradiction = next((i for i, x in enumerate(names) if x.startswith("contradict")), None)
    if contradiction is None:
        contradiction = len(names) - 1 if entail == 0 else 0
    return entail, contradiction


def pair_ids(tokenizer, text_ids: Sequence[int], hypothesis_ids: Sequence[int], max_length: int) -> List[int]:
    """`[CLS] text [SEP] hypothesis [SEP]` (XLM-RoBERTa's `<s> a </s></s> b </s>`) from ids without special
    tokens, the text cut to fit `max_length`. A hypothesis that leaves no room for the text raises ValueError."""
    middle = tokenizer.pair_separators
    room = max_length - len(hypothesis_ids) - 2 - middle
    if room < 1:
        raise ValueError(f"the hypothesis takes {len(hypothesis_ids)} tokens, leaving no room for the text in "
                         f"max_length={max_length}: use a shorter hypothesis_template or label")
    return ([tokenizer.cls_id] + list(text_ids[:room]) + [tokenizer.sep_id] * middle + list(hypothesis_ids)
            + [tokenizer.sep_id])


def label_scores(logits, entail: int, contradiction: int, multi_label: bool):
    """Scores `[texts, candidates]` from NLI logits `[texts, candidates, nli labels]`: a softmax over the
    candidates' entailment logits, or (multi_label, and always for one candidate, as the pipeline does) each
    candidate's probability of entailment against contradiction."""
    import numpy as np

    logits = np.asarray(logits, np.float64)
    if multi_label or logits.shape[1] == 1:
        return softmax(logits[..., [contradiction, entail]])[..., 1]
    return softmax(logits[..., entail], axis=-1)


def ranked(text: str, candidate_labels: Sequence[str], scores) -> dict:
    """The pipeline's result for one text: labels from the highest score down."""
    import numpy as np

    order = np.argsort(-scores, kind="stable")
    return {"sequence": text, "labels": [candidate_labels[i] for i in order],
            "scores": [float(scores[i]) for i in order]}
