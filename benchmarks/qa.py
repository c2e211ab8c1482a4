"""Question-answering throughput (questions/s) on Korean statutes: kbert's `TaskModel.answer` beside the same
reader run the way transformers' own pieces run it (the fast tokenizer's overflowing windows, the model in
torch, `select_starts_ends` per window, the best span over the windows), in one run.

The reader is a bert-mini (4 layers, 256 hidden) with random weights (its head scaled up: random weights score
spans nearly alike, and rounding would then decide) and a unigram vocabulary learned on the statutes, written by
kbert as a `BertForQuestionAnswering` dir (`kbert.export_transformers`), which both sides read. Each context is
one statute article of at least `--min-chars` characters (they run over several 384-token windows, neighbours
sharing 128 tokens, as KorQuAD readers are run); each question names the article's title. The script prints how
many best answers agree (the same windows, logits and decoding; answers are compared without surrounding spaces).

    python benchmarks/qa.py --statutes ../shared/data/korean-statutes/documents.jsonl.gz --questions 300
    KERAS_BACKEND=jax python benchmarks/qa.py ...
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from embed import timed  # noqa: E402  (best-of-N timing)

ARTICLE = re.compile(r"^#+ 제\d+조(?:의\d+)? \((.+?)\)\s*$", re.M)


def articles(path: str, n: int, min_chars: int = 40):
    """(title, body) of statute articles, at most `n`, each body as plain text (Markdown marks removed)."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            heads = list(ARTICLE.finditer(text))
            for head, nxt in zip(heads, heads[1:] + [None]):
                body = text[head.end():nxt.start() if nxt else len(text)]
                body = " ".join(re.sub(r"[*#\\]", "", body).split())
                if len(body) >= min_chars:
                    out.append((head.group(1), body))
                    if len(out) >= n:
                        return out
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--statutes", default=os.path.join("..", "shared", "data", "korean-statutes",
                                                           "documents.jsonl.gz"))
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--doc-stride", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--min-chars", type=int, default=600, help="the shortest article used as a context")
    parser.add_argument("--repeats", type=int, default=2, help="best of N timed passes per side")
    args = parser.parse_args()

    import keras
    import numpy as np
    import torch
    import transformers
    from transformers.pipelines.document_question_answering import select_starts_ends

    import kbert
    from kbert.data.features import build_network
    from kbert.data.qa import strip_span
    from kbert.models.tasks import TaskNetwork

    tests = articles(args.statutes, args.questions, min_chars=args.min_chars)
    vocab_text = [b for _, b in articles(args.statutes, args.questions + 3000)[args.questions:]]
    questions = [f"{title}에 관하여 무엇을 정하는가?" for title, _ in tests]
    contexts = [body for _, body in tests]
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    root = scratch_dir(prefix="kbert-qa-bench-")
    tok = kbert.Tokenizer.train(vocab_text, vocab_size=8000, progress=False)
    keras.utils.set_random_seed(0)
    config = kbert.ModelConfig.preset("bert-mini", vocab_size=tok.vocab_size, max_position=512)
    network = TaskNetwork(kbert.BertBackbone(config, output_hidden_states=True), "question-answering", 2, 0.0)
    build_network(network, tok)
    # random weights give nearly flat span scores, where float rounding decides between near-equal spans: a
    # sharper head makes the two sides' best answers comparable
    network.head.kernel.assign(network.head.kernel * 30.0)
    meta = {"task": "question-answering", "labels": None, "max_length": args.max_length,
            "doc_stride": args.doc_stride, "max_query_length": 64, "max_answer_length": 30, "impossible": False}
    kbert.TaskModel(network, tok, meta).save(os.path.join(root, "kbert"))
    model = kbert.TaskModel.load(os.path.join(root, "kbert"))
    hf_dir = kbert.export_transformers(model, os.path.join(root, "hf"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf = transformers.AutoModelForQuestionAnswering.from_pretrained(hf_dir).eval()

    def reference():
        answers = []
        for start in range(0, len(questions), args.batch_size):
            q, c = questions[start:start + args.batch_size], contexts[start:start + args.batch_size]
            enc = hf_tok(q, c, truncation="only_second", max_length=args.max_length, stride=args.doc_stride,
                         return_overflowing_tokens=True, return_offsets_mapping=True, padding=True,
                         return_tensors="np")
            starts, ends = [], []
            with torch.no_grad():
                for w in range(0, len(enc["input_ids"]), args.batch_size):
                    part = slice(w, w + args.batch_size)
                    out = hf(input_ids=torch.from_numpy(enc["input_ids"][part]),
                             token_type_ids=torch.from_numpy(enc["token_type_ids"][part]),
                             attention_mask=torch.from_numpy(enc["attention_mask"][part]))
                    starts.append(out.start_logits.numpy())
                    ends.append(out.end_logits.numpy())
            starts, ends = np.concatenate(starts), np.concatenate(ends)
            best = [(-1.0, 0, 0)] * len(q)
            for w, i in enumerate(enc["overflow_to_sample_mapping"]):
                p_mask = np.array([0 if t == 0 or s == 1 else 1 for t, s in enumerate(enc.sequence_ids(w))])
                s, e, score, _ = select_starts_ends(starts[w:w + 1], ends[w:w + 1], p_mask[None],
                                                    enc["attention_mask"][w:w + 1], max_answer_len=30)
                if len(score) and s[0] > 0 and score[0] > best[i][0]:
                    offsets = enc["offset_mapping"][w]  # a lone `▁` token's offsets cover its space: stripped
                    span = strip_span(c[i], int(offsets[s[0]][0]), int(offsets[e[0]][1])) or (0, 0)
                    best[i] = (float(score[0]),) + span
            answers.extend(best)
        return answers

    def ours():
        return model.answer(questions, contexts, batch_size=args.batch_size, doc_stride=args.doc_stride)

    windows = hf_tok(questions, contexts, truncation="only_second", max_length=args.max_length,
                     stride=args.doc_stride, return_overflowing_tokens=True)["input_ids"]
    print(f"{len(questions)} questions over statute articles of {np.mean([len(c) for c in contexts]):.0f} chars on "
          f"average: {len(windows)} windows of at most {args.max_length} tokens (stride {args.doc_stride}); batch "
          f"{args.batch_size}; CPU threads: torch {torch.get_num_threads()}, os {os.cpu_count()}; kbert on "
          f"{keras.backend.backend()}")
    ours()  # first calls: tracing / compiling, the tokenizers' first use
    reference()
    t_ours, got = timed(ours, args.repeats)
    t_ref, expected = timed(reference, args.repeats)
    agree = sum((g["start"], g["end"]) == (e[1], e[2]) for g, e in zip(got, expected))
    # the same span by score and end but another start: transformers gives every byte piece of a run of
    # characters outside the vocabulary the whole run's offsets, kbert each piece its own character's
    byte_runs = sum((g["start"], g["end"]) != (e[1], e[2]) and g["end"] == e[2] and abs(g["score"] - e[0]) < 1e-5
                    for g, e in zip(got, expected))
    gap = max(abs(g["score"] - e[0]) for g, e in zip(got, expected))
    print(f"{'':46s} {'questions/s':>12s}")
    print(f"{'kbert TaskModel.answer':46s} {len(questions) / t_ours:12.1f}")
    print(f"{'transformers (tokenizer windows, torch, decode)':46s} {len(questions) / t_ref:12.1f}")
    print(f"kbert / transformers: {t_ref / t_ours:.2f}x; best answers agree on {agree} of {len(questions)} "
          f"(+{byte_runs} the same span starting inside a run of out-of-vocabulary characters, whose byte pieces "
          f"transformers gives the whole run's offsets); largest score difference {gap:.1e}")


if __name__ == "__main__":
    main()
