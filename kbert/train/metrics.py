"""Evaluation metrics of fine-tuning, in numpy: entity-level F1 of BIO tags (correlations, accuracy and macro-F1
live in kbert.utils, shared with `kbert predict`); and `read_scalars`, a run's training curves from its
TensorBoard logs.

The metrics are small enough to write out (scikit-learn is not a dependency of kbert); `rank` matches
`scipy.stats.rankdata`'s average ranks, which the tests check on ties.
"""

from __future__ import annotations

from typing import Dict, Sequence

from kbert.utils import entity_scores
from kbert.utils import pair_classification_figures, pearson, rank, spearman  # noqa: F401  (for fine-tuning)


def entity_runs(tags) -> set:
    """The entities of one sequence of BIO tags, as {(first token, last token + 1, type)}: "B-" starts one, "I-"
    (or a tag without a prefix) continues one of its type and starts one after another type, "O" is none (the
    grouping of transformers' token-classification pipeline, which `TaskModel.entities` follows)."""
    runs, current = set(), None
    for t, tag in enumerate(list(tags) + ["O"]):
        bi, kind = (tag[0], tag[2:]) if tag[:2] in ("B-", "I-") else ("I", tag)
        if current is not None and (tag == "O" or bi == "B" or kind != current[2]):
            runs.add((current[0], t, current[2]))
            current = None
        if tag != "O" and current is None:
            current = (t, None, kind)
    return runs


def entity_figures(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]) -> Dict[str, float]:
    """Entity-level precision, recall and F1 over sequences of BIO tags: an entity counts when its span and type
    are both exact (CoNLL's and seqeval's scoring)."""
    return entity_scores([entity_runs(g) for g in gold], [entity_runs(p) for p in predicted])


def scalar_writer(logdir: str, enabled: bool = True):
    """`write(step, {tag: value})`: TensorBoard scalars in `logdir` through `tensorboard`'s own event writer, which
    needs no TensorFlow (the JAX backend and fine-tuning on either backend; `read_scalars` reads them back), or
    `logdir/scalars.jsonl` where tensorboard is missing. `write.flush()` writes out what is buffered and
    `write.close()` ends the event file and its writer thread (one a run: a process may run many). `enabled`
    False (a process other than the chief) gives a writer that writes nothing."""
    import json
    import os
    import time

    os.makedirs(logdir, exist_ok=True)
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        path = os.path.join(logdir, "scalars.jsonl")

        def write(step: int, scalars: dict):
            if enabled:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": step, **{k: float(v) for k, v in scalars.items()}}) + "\n")

        write.flush = write.close = lambda: None
        return write
    events = EventFileWriter(logdir) if enabled else None

    def write(step: int, scalars: dict):
        if events is not None:
            summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()])
            events.add_event(Event(step=step, wall_time=time.time(), summary=summary))

    write.flush = (lambda: events.flush()) if events is not None else (lambda: None)
    write.close = (lambda: events.close()) if events is not None else (lambda: None)
    return write


def read_scalars(logdir: str) -> dict:
    """{tag: {step: value}} of the scalars a run logged (`OUT/logs` of `kbert.pretrain` and `kbert.finetune`),
    through tensorboard's event reader, without TensorFlow. Both ways kbert writes them are read: TensorFlow's
    `tf.summary` tensors and the JAX backend's simple values (or its `scalars.jsonl` where tensorboard is
    missing). A step logged twice (a resumed run repeats the steps after its last checkpoint) keeps the
    last value written."""
    import glob
    import json
    import os

    if not os.path.isdir(logdir):
        raise FileNotFoundError(f"no log directory {logdir!r} (a run writes its scalars to OUTPUT_DIR/logs)")
    curves: dict = {}
    jsonl = os.path.join(logdir, "scalars.jsonl")
    if os.path.isfile(jsonl):
        with open(jsonl, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                step = row.pop("step")
                for tag, value in row.items():
                    curves.setdefault(tag, {})[step] = float(value)
    files = sorted(glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True))
    if files:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.util import tensor_util

        for path in sorted(files, key=os.path.getmtime):  # later files (a resumed run) overwrite earlier steps
            events = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
            events.Reload()
            tags = events.Tags()
            for tag in tags.get("scalars", []):
                for e in events.Scalars(tag):
                    curves.setdefault(tag, {})[e.step] = float(e.value)
            for tag in tags.get("tensors", []):
                for e in events.Tensors(tag):
                    value = tensor_util.make_ndarray(e.tensor_proto)
                    if value.size == 1:
                        curves.setdefault(tag, {})[e.step] = float(value.reshape(()))
    return {tag: dict(sorted(steps.items())) for tag, steps in curves.items()}
