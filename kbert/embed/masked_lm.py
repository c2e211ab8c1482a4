"""Masked-token prediction with a pretrained model's own masked-LM head: what `transformers.pipeline("fill-mask")`
gives, and the pseudo-log-likelihood scores of Salazar et al. (2020), "Masked Language Model Scoring".

    lm = kbert.MaskedLM.load("klue/bert-base")                   # any checkpoint saved with its MLM head
    lm.fill_mask("대한민국의 수도는 [MASK]이다.")                   # [{"score", "token", "token_str", "sequence"}, ...]
    lm.pseudo_log_likelihood(["나는 학교에 간다.", "나는 학교를 간다."])   # higher: more natural to the model
    lm.pseudo_perplexity(held_out_lines)                          # one figure for a text collection

Why: predicting a masked word is the first look practitioners take at a Korean checkpoint, and at their own
pretraining; pseudo-perplexity compares checkpoints (or vocabularies) on held-out text with no task head, and
pseudo-log-likelihood ranks candidate sentences (spelling and spacing variants, a recognizer's n-best list).

`score`, `token` and `token_str` are the fill-mask pipeline's (tested against transformers). `sequence` differs
on purpose: the pipeline decodes the whole row, which for Korean puts a space between the predicted token and
the particle written after the mask ("한국의 수도 이다."); here it is the input text with that mask replaced by
the token's spelling ("한국의 수도이다."), the other masks left as they are.

Text around a mask is tokenized piece by piece, as transformers splits text at special tokens: the text after a
mask starts a new word.
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional, Sequence, Union

import numpy as np

from kbert.compiled import backend, compiled, signature
from kbert.utils import softmax
from kbert.data.features import bucket, bucketed, features, str_list

# masked positions per row round up to these for XLA (one compile per bucket; padding positions read [CLS])
_POSITION_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class MaskedLM:
    """A pretrained model with its masked-LM head, and its tokenizer.

    Args:
        model: a `kbert.Pretrainer` whose masked-LM head is trained (`kbert.load_model(dir, require_heads=True)`).
        tokenizer: its `kbert.Tokenizer`; its mask token (`tokenizer.special_tokens["mask"]`, "[MASK]" for BERT
            vocabularies, "<mask>" for RoBERTa ones) marks what to predict.
        max_length: tokens per row, [CLS] and [SEP] included (default and limit: the model's positions). A
            longer text is read in a window of this many tokens around its masks.
        jit_compile: predict through XLA (rows and widths padded to a few bucketed shapes); always so on JAX.

    Example:
        >>> lm = kbert.MaskedLM.load("my-pretraining-run")
        >>> [p["token_str"] for p in lm.fill_mask("오늘 날씨가 정말 [MASK].", top_k=3)]
    """

    def __init__(self, model, tokenizer, max_length: Optional[int] = None, jit_compile: bool = False):
        self.model, self.tokenizer = model, tokenizer
        # refused past the positions, as Embedder does: a clamp would read a smaller window than asked, unsaid
        self.max_length = (model.config.max_position if max_length is None  # [CLS], a mask, [SEP] at least
                           else model.config.check_length(max_length, minimum=3))
        self.mask_token = tokenizer.special_tokens["mask"]
        self.jit_compile = bool(jit_compile) or backend() == "jax"  # JAX compiles every (bucketed) shape
        self._fn = None

    @classmethod
    def load(cls, model_dir: str, max_length: Optional[int] = None, dtype: Optional[str] = None,
             jit_compile: bool = False) -> "MaskedLM":
        """A model dir saved with its masked-LM head (a `kbert pretrain` output or run dir, a Hugging Face
        BertForPreTraining / BertForMaskedLM / AlbertForMaskedLM / RobertaForMaskedLM dir, an ELECTRA generator
        such as KoELECTRA's `*-generator`, a TF1 checkpoint) or a
        Hugging Face Hub name ("klue/bert-base"). A dir without the head (an encoder, a fine-tuned model) is a
        ValueError that says so."""
        from kbert.models.convert import check_vocabulary, load_model
        from kbert.models.locate import model_dir_of, resolve_hub_name
        from kbert.text.tokenizer import Tokenizer

        model_dir = model_dir_of(resolve_hub_name(model_dir))  # a hub name: its snapshot; a run dir: its model
        model = load_model(model_dir, require_heads=True, dtype=dtype)
        tokenizer = Tokenizer.from_model_dir(model_dir)
        check_vocabulary(model.config, tokenizer.vocab_size)
        return cls(model, tokenizer, max_length=max_length, jit_compile=jit_compile)

    # ------------------------------------------------------------------ fill-mask
    def fill_mask(self, texts: Union[str, Sequence[str]], top_k: int = 5, targets: Optional[Sequence[str]] = None,
                  batch_size: int = 32):
        """The `top_k` likeliest tokens at each mask token of each text, best first.

        Returns, as the fill-mask pipeline: for a text with one mask, a list of `{"score", "token", "token_str",
        "sequence"}` (probability, token id, the token as the tokenizer decodes it alone, the text with the mask
        replaced by it); with several masks, one such list per mask (each mask predicted on its own, the others
        left masked); for a list of texts, a list of those.

        Args:
            targets: tokens to choose among instead of the whole vocabulary (e.g. ["은", "는"]); a target that is
                not one token is replaced by its first token, with a warning, as the pipeline does.
            batch_size: texts per forward pass.
        """
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"`top_k` must be an int >= 1. Received: top_k={top_k!r}")
        single = isinstance(texts, (str, bytes))
        items = str_list(texts)
        target_ids = None if targets is None else self._target_ids(targets)
        rows = [self._masked_row(t, i) for i, t in enumerate(items)]
        logits = self._logits_of([r[0] for r in rows], [r[1] for r in rows], batch_size)
        out = []
        for text, (ids, positions), z in zip(items, rows, logits):
            parts = text.split(self.mask_token)
            probs = softmax(z.astype(np.float64)).astype(np.float32)  # [p, v]
            if target_ids is not None:
                probs = probs[:, target_ids]
            k = min(top_k, probs.shape[1])
            per_mask = []
            for m, p in enumerate(probs):
                best = np.argsort(-p, kind="stable")[:k]
                per_mask.append([self._proposal(parts, m, float(p[j]),
                                                int(j if target_ids is None else target_ids[j])) for j in best])
            out.append(per_mask[0] if len(per_mask) == 1 else per_mask)
        return out[0] if single else out

    def _proposal(self, parts: List[str], mask: int, score: float, token: int) -> dict:
        """One prediction: `parts` is the text split at its masks, `mask` the one filled."""
        token_str = self.tokenizer.decode([token], skip_special_tokens=False)
        spelling = token_str[2:] if self.tokenizer.kind == "wordpiece" and token_str.startswith("##") else token_str
        sequence = "".join(part + (spelling if k == mask else self.mask_token if k < len(parts) - 1 else "")
                           for k, part in enumerate(parts))
        return {"score": score, "token": token, "token_str": token_str, "sequence": sequence}

    def _target_ids(self, targets) -> np.ndarray:
        targets = [targets] if isinstance(targets, str) else list(targets)
        index = {piece: i for i, piece in enumerate(self.tokenizer.vocab)}
        ids = []
        for target in targets:
            if not isinstance(target, str):
                raise TypeError(f"`targets` must be strings. Received: {target!r}")
            if target in index:
                ids.append(index[target])
                continue
            pieces = self.tokenizer.encode(target, add_special_tokens=False)
            if not pieces.ids:
                warnings.warn(f"target {target!r} has no token in the vocabulary; it is left out", stacklevel=3)
                continue
            warnings.warn(f"target {target!r} is not one token of the vocabulary; its first token "
                          f"{pieces.tokens[0]!r} stands for it", stacklevel=3)
            ids.append(pieces.ids[0])
        if not ids:
            raise ValueError(f"`targets` must hold at least one token of the vocabulary. Received: {targets!r}")
        return np.array(sorted(set(ids)), np.int64)

    def _masked_row(self, text: str, i: int):
        """(ids with [CLS] and [SEP], the masks' positions in it) of text `i`, cut to a window of `max_length`
        around its masks when longer."""
        if not isinstance(text, str):
            raise TypeError(f"text {i} must be a string. Received: {type(text).__name__}")
        parts = text.split(self.mask_token)
        if len(parts) == 1:
            raise ValueError(f"text {i} has no mask token {self.mask_token!r}: write {self.mask_token} where a "
                             f"token is to be predicted. Received: {text[:60]!r}")
        ids, masks = [], []
        for k, piece in enumerate(self.tokenizer.ids_batch(parts)):
            if k:
                masks.append(len(ids))
                ids.append(self.tokenizer.mask_id)
            ids += piece
        room = self.max_length - 2
        start = 0
        if len(ids) > room:
            span = masks[-1] - masks[0] + 1
            if span > room:
                raise ValueError(f"text {i}: its first and last mask are {span} tokens apart, more than the {room} "
                                 f"a row of max_length={self.max_length} holds; predict them in separate texts")
            start = min(max(0, (masks[0] + masks[-1] + 1) // 2 - room // 2), len(ids) - room)
            warnings.warn(f"text {i} has {len(ids)} tokens, more than max_length={self.max_length} holds: it is "
                          f"read in a window of {room} tokens around its masks", stacklevel=4)
        window = ids[start:start + room]
        return ([self.tokenizer.cls_id] + window + [self.tokenizer.sep_id], [m - start + 1 for m in masks])

    # ------------------------------------------------------------------ scores
    def pseudo_log_likelihood(self, texts: Union[str, Sequence[str]], batch_size: int = 64,
                              per_token: bool = False):
        """Each text's pseudo-log-likelihood: the sum over its tokens of log P(token | the text with that token
        masked), one forward pass per token (Salazar et al. 2020). Higher is likelier; compare texts of the
        same length, or use `per_token=True` for the mean per token. A text longer than `max_length` is
        scored on its first `max_length - 2` tokens; an empty text scores 0 over 0 tokens.

        Returns a float64 array `[n]` (a float for one text)."""
        single = isinstance(texts, (str, bytes))
        sums, counts = self._token_log_likelihoods(texts, batch_size)
        out = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0) if per_token else sums
        return float(out[0]) if single else out

    def pseudo_perplexity(self, texts: Sequence[str], batch_size: int = 64) -> float:
        """exp(-(sum of the texts' pseudo-log-likelihoods) / (their tokens)): one figure for a collection of
        held-out text, lower is better (Salazar et al.'s PPPL). Comparable between models with the same
        vocabulary only: finer tokens are easier to guess."""
        sums, counts = self._token_log_likelihoods(texts, batch_size)
        if counts.sum() == 0:
            raise ValueError("pseudo_perplexity needs at least one token: every text is empty")
        return math.exp(-sums.sum() / counts.sum())

    def _token_log_likelihoods(self, texts, batch_size: int):
        """(sum of log P(token | rest) per text, tokens per text): every token of every text masked in turn,
        each masked copy one row of the batches."""
        items = str_list(texts)
        for i, t in enumerate(items):
            if self.mask_token in t:
                raise ValueError(f"text {i} holds the mask token {self.mask_token!r}; pseudo-log-likelihood scores "
                                 "whole texts (fill_mask predicts masks)")
        pieces = [p[:self.max_length - 2] for p in self.tokenizer.ids_batch(items)]
        rows, positions, owner, truth = [], [], [], []
        for i, p in enumerate(pieces):
            row = [self.tokenizer.cls_id] + p + [self.tokenizer.sep_id]
            for j in range(1, len(row) - 1):
                masked = list(row)
                masked[j] = self.tokenizer.mask_id
                rows.append(masked)
                positions.append([j])
                owner.append(i)
                truth.append(row[j])
        sums = np.zeros(len(items), np.float64)
        if rows:
            logits = self._logits_of(rows, positions, batch_size)
            for i, t, z in zip(owner, truth, logits):
                z = z[0].astype(np.float64)  # [v]
                top = z.max()
                sums[i] += z[t] - top - math.log(np.exp(z - top).sum())
        return sums, np.array([len(p) for p in pieces], np.int64)

    # ------------------------------------------------------------------ the model
    def _forward(self, x):  # a method, not a lambda: AutoGraph reads its source
        return self.model(x, training=False)["mlm_logits"]

    def _logits_of(self, rows: List[List[int]], positions: List[List[int]], batch_size: int) -> List[np.ndarray]:
        """Float32 logits `[masks of row i, vocab]` per row, batches of rows of similar length."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be an int >= 1. Received: batch_size={batch_size!r}")
        if self._fn is None:
            self._fn = compiled(self._forward, self.model.variables,
                                signature({"token_ids": 2, "segment_ids": 2, "padding_mask": 2, "mask_positions": 2}),
                                jit_compile=self.jit_compile)
        pad_id = self.tokenizer.pad_id
        out = [None] * len(rows)
        order = np.argsort([len(r) for r in rows], kind="stable")
        for start in range(0, len(rows), batch_size):
            index = order[start:start + batch_size]
            width = max(len(rows[i]) for i in index)
            ids = np.full((len(index), width), pad_id, np.int32)
            p = max(len(positions[i]) for i in index)
            where = np.zeros((len(index), p), np.int32)  # padding positions read [CLS]; their logits are dropped
            for k, i in enumerate(index):
                ids[k, :len(rows[i])] = rows[i]
                where[k, :len(positions[i])] = positions[i]
            if self.jit_compile:
                ids = bucketed(ids, pad_id, self.max_length, rows=True)
                where = np.pad(where, ((0, len(ids) - len(where)), (0, bucket(p, _POSITION_BUCKETS) - p)))
            feats = features(ids, np.zeros_like(ids), pad_id)
            feats["mask_positions"] = where
            logits = np.asarray(self._fn(feats), np.float32)  # [rows, positions, v]
            for k, i in enumerate(index):
                out[i] = logits[k, :len(positions[i])]
        return out
