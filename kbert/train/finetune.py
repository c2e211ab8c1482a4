"""`kbert.finetune`: task heads (or a bi-encoder) on a pretrained backbone, trained with AdamW + warm-up and
early stopping on a dev score.

A run is a `FinetuneConfig` (flat settings, loadable from YAML/JSON with `key=value` overrides like `kbert
pretrain`'s config), a task from `kbert.train.finetune_tasks.TASKS` (its examples, batches, loss and dev
scores), and one loop, `run`. `kbert.finetune(...)` is the keyword front end.

The best checkpoint on the dev set is written to `out_dir` as a kbert model dir (backbone weights +
tokenizer, so `kbert.Embedder.load` and `kbert export` read it) plus `kbert_task.json` and
`kbert_task.safetensors` (the head). `kbert.TaskModel.load(out_dir).predict(texts)` runs it. An interrupted
run keeps its whole state in `out_dir/checkpoints` (`kbert.train.checkpoints`) and the same call resumes it.

Data: a TSV (header row, no quoting), CSV, or JSONL file (gzip allowed), or a list of dicts.

Devices (`strategy`): on Keras' JAX backend a GPU box's GPUs or a TPU VM's cores train data-parallel through
Keras' own distribution API (`keras.distribution.DataParallel`, what `kbert pretrain` on JAX uses): the
weights are replicated, each batch is split along its rows, and XLA partitions the one compiled step and adds
the gradient all-reduce. The step is the single-device program, so the loss is the whole batch's (in-batch
negatives span every device) and a run is the one-device run of the same seed to float rounding.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, List, Optional, Sequence, Union

import numpy as np

from kbert.data.features import bucketed, bucketed_features, build_network
from kbert.data.features import features as model_inputs
from kbert.data.rows import read_rows
from kbert.compiled import STRATEGIES, backend, cached_training_step, compiled, data_parallel, place, replicate
from kbert.compiled import training_step
from kbert.models.st_dir import check_prompts
from kbert.models.tasks import default_pooling
from kbert.train.checkpoints import CHECKPOINT_DIR, FinetuneCheckpoint, data_fingerprint
from kbert.train.cards import write_finetune_card
from kbert.train.finetune_tasks import SIMILARITY_LOSSES, batch_text_ids, task_for
from kbert.train.lora import check_lora, enable_lora, is_factor, lora_trainable
from kbert.train.metrics import scalar_writer
from kbert.utils import check_seed, positive_int

LOG_DIR = "logs"  # OUT/logs: TensorBoard scalars (kbert.read_scalars reads them)
LOG_EVERY = 10  # steps between train-loss points
LOWER_IS_BETTER = ("mse",)  # dev figures a better model makes smaller (`metric`)
IN_BATCH_TASKS = ("sentence-embedding", "sparse-embedding")  # tasks with in-batch negatives (guide, symmetric)
# dev figures that rank nothing: the cosine at which a bi-encoder's F1 peaks, a sparse model's active tokens
NOT_SCORES = ("f1_threshold", "active_dims")


@dataclasses.dataclass
class FinetuneConfig:
    """Every setting of a fine-tuning run; the fields are `kbert.finetune`'s keyword arguments (documented
    there). `FinetuneConfig.load("ft.yaml", ["epochs=5"])` reads a file with overrides."""
    model: Any = None
    task: Optional[str] = None
    train: Any = None
    dev: Any = None
    out_dir: str = "finetuned"
    text_column: str = "text"
    pair_column: Optional[str] = None
    label_column: Optional[str] = "label"
    columns: Optional[List[str]] = None  # a header-less TSV/CSV's column names, in order (train and dev)
    labels: Optional[List[str]] = None
    multi_label: bool = False  # classification: each row any number of the labels (a sigmoid each)
    class_weights: Any = None  # classification: "balanced" or {label: weight}; a rare class counts more
    epochs: float = 3
    batch_size: int = 32
    learning_rate: float = 5e-5
    warmup: float = 0.1
    weight_decay: float = 0.01
    max_length: Optional[int] = None
    dropout: float = 0.1
    patience: Optional[int] = 2
    metric: Optional[str] = None  # the dev figure that picks the best checkpoint (None: the task's own)
    eval_every: Optional[int] = None
    max_steps: Optional[int] = None
    seed: int = 0
    progress: bool = True
    dtype: Optional[str] = None
    group_by_length: bool = True
    similarity_loss: str = "cosine"
    pooling: Optional[str] = None
    layers: Any = -1  # an int, a list of ints, or "all"
    backbone_dropout: Optional[float] = None
    resume: bool = True
    checkpoint_every: Optional[int] = 1000
    stop_after: Optional[int] = None
    objective: Optional[str] = None  # sentence-embedding: None (pairs) or "simcse" (single texts)
    negative_column: Optional[str] = None  # sentence-embedding: a hard negative per (anchor, positive) row
    temperature: float = 0.05  # sentence-embedding: in-batch and SimCSE losses divide cosines by it
    matryoshka_dims: Optional[List[int]] = None  # sentence-embedding: also train vectors cut to these widths
    datasets: Optional[List[dict]] = None  # sentence-embedding from several datasets (finetune_tasks.py)
    mix: str = "proportional"  # how datasets' batches are ordered: proportional | round_robin
    mini_batch_size: Optional[int] = None  # sentence-embedding: rows per forward pass (gradient caching)
    prompts: Any = None  # sentence-embedding: a text put before every text, or {column: text}
    model_prompts: Optional[dict] = None  # sentence-embedding: the output's prompts for inference {name: text}
    guide: Optional[str] = None  # sentence-embedding: a model dir whose vectors filter in-batch false negatives
    guide_margin: float = 0.0  # ... those it scores above the anchor's positive less this
    symmetric: bool = False  # sentence-embedding in-batch losses: also rank each positive's anchor among the anchors
    query_regularizer_weight: float = 5e-5  # sparse-embedding: the FLOPS penalty on the anchors' vectors
    document_regularizer_weight: float = 3e-5  # ... and on the positives' and hard negatives'
    inference_free: bool = False  # sparse-embedding: queries read a trained per-token table, not the model
    query_learning_rate: float = 1e-3  # ... that table's learning rate (sentence-transformers' recipe)
    strategy: str = "auto"  # devices: auto | cpu | mirrored | tpu (several: Keras' JAX backend only)
    doc_stride: int = 128  # question-answering: context tokens shared by neighbouring windows
    max_query_length: int = 64  # question-answering: question tokens kept
    max_answer_length: int = 30  # question-answering: the longest answer decoded, in tokens
    lora_rank: Optional[int] = None  # LoRA: the rank of each adapted projection's update (None: full fine-tuning)
    lora_alpha: Optional[float] = None  # LoRA: the update is scaled by lora_alpha / lora_rank (default 1)
    lora_targets: str = "all"  # LoRA: the projections adapted: all | attention (kbert.train.lora)

    @classmethod
    def from_dict(cls, values: dict) -> "FinetuneConfig":
        from kbert.train.config import build_dataclass

        return build_dataclass(cls, values or {})

    @classmethod
    def load(cls, path: Optional[str] = None, overrides: Optional[Sequence[str]] = None,
             base: Optional[dict] = None) -> "FinetuneConfig":
        """A YAML/JSON file (over `base`, e.g. command-line flags) with `key=value` overrides."""
        from kbert.train.config import load_mapping

        return cls.from_dict(load_mapping(path, list(overrides or []), base))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Refuses bad settings by name before anything is loaded."""
        if self.datasets is not None and not self.datasets:
            raise ValueError("`datasets` is empty: give one mapping per dataset, or leave it out and give `train`")
        for name in ("model", "task", "train"):
            if getattr(self, name) is None and not (name == "train" and self.datasets):
                raise ValueError(f"`{name}` is required (a config key, or the --{name} flag)")
        if not isinstance(self.out_dir, (str, os.PathLike)) or not os.fspath(self.out_dir):
            raise ValueError(f"`out_dir` must name a directory. Received: out_dir={self.out_dir!r}")
        from kbert.utils import check_local_path

        check_local_path(self.out_dir, "`out_dir`")  # before the model and data load, not at the first write
        if not isinstance(self.multi_label, bool) or (
                self.multi_label and self.task not in ("classification", "pair-classification")):
            raise ValueError(f"`multi_label` (True or False) goes with task='classification' or "
                             f"'pair-classification'. Received: multi_label={self.multi_label!r}, task={self.task!r}")
        if self.class_weights is not None and self.task not in ("classification", "pair-classification"):
            raise ValueError(f"`class_weights` goes with task='classification' or 'pair-classification'. "
                             f"Received: task={self.task!r}")
        if self.class_weights is not None and not (self.class_weights == "balanced"
                                                   or isinstance(self.class_weights, dict)):
            raise ValueError(f"`class_weights` must be 'balanced' or a mapping of label to weight. "
                             f"Received: {self.class_weights!r}")
        if self.metric is not None and not isinstance(self.metric, str):
            raise ValueError(f"`metric` must be the name of a dev figure, e.g. 'macro_f1'. Received: {self.metric!r}")
        if self.similarity_loss not in SIMILARITY_LOSSES:
            raise ValueError(f"`similarity_loss` must be one of {SIMILARITY_LOSSES}. "
                             f"Received: {self.similarity_loss!r}")
        for name in ("epochs", "learning_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"`{name}` must be a positive number. Received: {name}={value!r}")
        for name in ("batch_size", "max_length"):  # a batch of 2.5 rows failed deep in the input pipeline
            value = getattr(self, name)
            if not (name == "max_length" and value is None):
                positive_int(value, name)
        check_seed(self.seed)
        rate = self.backbone_dropout
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0):
            raise ValueError(f"`backbone_dropout` must be None or a rate in [0, 1). Received: {rate!r}")
        if (self.prompts or self.model_prompts) and self.task != "sentence-embedding":
            raise ValueError(f"`prompts` / `model_prompts` go with task='sentence-embedding'. "
                             f"Received: task={self.task!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"`strategy` must be one of {STRATEGIES}. Received: strategy={self.strategy!r}")
        for name, ok, rule in (("warmup", lambda v: 0 <= v <= 1, "a fraction of the steps, in [0, 1]"),
                               ("weight_decay", lambda v: v >= 0, "0 or more"),
                               ("dropout", lambda v: 0 <= v < 1, "a rate in [0, 1)")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"`{name}` must be {rule}. Received: {name}={value!r}")
        if self.guide is not None and (self.task not in IN_BATCH_TASKS
                                       or not isinstance(self.guide, (str, os.PathLike))):
            raise ValueError(f"`guide` (a model dir whose vectors filter in-batch negatives) goes with "
                             f"task='sentence-embedding' or 'sparse-embedding'. Received: guide={self.guide!r}, "
                             f"task={self.task!r}")
        margin = self.guide_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not -2 < margin < 2:
            raise ValueError(f"`guide_margin` must be a number in (-2, 2) (a cosine difference). "
                             f"Received: guide_margin={margin!r}")
        if not isinstance(self.inference_free, bool) or (self.inference_free and self.task != "sparse-embedding"):
            raise ValueError(f"`inference_free` (True or False) goes with task='sparse-embedding'. "
                             f"Received: inference_free={self.inference_free!r}, task={self.task!r}")
        rate = self.query_learning_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
            raise ValueError(f"`query_learning_rate` must be a number > 0. Received: query_learning_rate={rate!r}")
        if not isinstance(self.symmetric, bool) or (self.symmetric and self.task not in IN_BATCH_TASKS):
            raise ValueError(f"`symmetric` (True or False) goes with task='sentence-embedding' or 'sparse-embedding'. "
                             f"Received: symmetric={self.symmetric!r}, task={self.task!r}")
        for name in ("doc_stride", "max_query_length", "max_answer_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
        check_lora(self.lora_rank, self.lora_alpha, self.lora_targets)
        for name in ("checkpoint_every", "stop_after", "mini_batch_size", "patience", "eval_every", "max_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be None or a positive integer. Received: {name}={value!r}")


def finetune(model: str, task: str, train, dev=None, out_dir: str = "finetuned", text_column: str = "text",
             pair_column: Optional[str] = None, label_column: Optional[str] = "label",
             columns: Optional[Sequence[str]] = None, labels: Optional[Sequence[str]] = None,
             multi_label: bool = False, class_weights=None, epochs: float = 3, batch_size: int = 32,
             learning_rate: float = 5e-5, warmup: float = 0.1, weight_decay: float = 0.01,
             max_length: Optional[int] = None, dropout: float = 0.1, patience: Optional[int] = 2,
             metric: Optional[str] = None, eval_every: Optional[int] = None, max_steps: Optional[int] = None,
             seed: int = 0,
             progress: bool = True, dtype: Optional[str] = None, group_by_length: bool = True,
             similarity_loss: str = "cosine", pooling: Optional[str] = None,
             layers: Union[int, Sequence[int], str] = -1, backbone_dropout: Optional[float] = None,
             resume: bool = True, checkpoint_every: Optional[int] = 1000, stop_after: Optional[int] = None,
             objective: Optional[str] = None, negative_column: Optional[str] = None, temperature: float = 0.05,
             matryoshka_dims: Optional[Sequence[int]] = None, datasets: Optional[Sequence[dict]] = None,
             mix: str = "proportional", mini_batch_size: Optional[int] = None, prompts=None,
             model_prompts: Optional[dict] = None, guide: Optional[str] = None, guide_margin: float = 0.0,
             symmetric: bool = False, strategy: str = "auto", doc_stride: int = 128, max_query_length: int = 64,
             max_answer_length: int = 30, lora_rank: Optional[int] = None, lora_alpha: Optional[float] = None,
             lora_targets: str = "all", query_regularizer_weight: float = 5e-5,
             document_regularizer_weight: float = 3e-5, inference_free: bool = False,
             query_learning_rate: float = 1e-3) -> dict:
    """Fine-tunes the model dir `model` on `train`; returns a summary with the dev history.

    Args:
        model: a model dir (`kbert.load_model` formats) with its tokenizer.
        task: one of `kbert.train.finetune_tasks.TASKS` (see that module's docstring).
        train, dev: TSV / CSV / JSONL paths (UTF-8; a .json file may be one array) or lists of dicts. Without
            `dev`, the last model is saved.
        out_dir: the model dir written: the best model, and when the run ends a model card (README.md, the
            Hugging Face Hub's form: what the model is, how to load it, the data, loss, settings and dev figures
            of the run; a README.md not written by kbert is left as it is), and `logs/`, the run's TensorBoard
            curves (train loss every LOG_EVERY steps, dev metrics at each evaluation; `kbert.read_scalars`).
        text_column, pair_column, label_column: column names (`pair_column` for pair tasks and bi-encoders;
            `label_column=None` for a bi-encoder trained on (anchor, positive) pairs).
        columns: for TSV/CSV files without a header line (3i4k's `label<TAB>text`, google-research/bert's
            GLUE files), their columns' names in order, e.g. ["label", "text"]; the first line is then a row.
        labels: class names in order (default: the sorted labels of `train`).
        multi_label: for classification and pair-classification, each row holds any number of the labels (a list,
            a JSON list or a comma-separated cell; empty: none): a sigmoid a label trained with binary
            cross-entropy (transformers' problem_type "multi_label_classification"), a label predicted when its
            probability is over 0.5. The dev figures are micro-F1 (picks the best checkpoint), macro-F1 and subset
            accuracy; `TaskModel.predict` gives each label's own probability.
        class_weights: for classification and pair-classification, how much each class's rows count in the
            loss: "balanced" (scikit-learn's n / (k * n_c), so a class of 1% weighs as much in all as one of
            50%; for multi-label, each label's positives n_neg / n_pos, torch's pos_weight) or {label: weight}
            (others 1). The batch loss is the weighted mean (torch's CrossEntropyLoss(weight=...)). For classes
            of very different sizes (3i4k's, hate speech's); pair it with `metric="macro_f1"`.
        epochs, batch_size, learning_rate, warmup (fraction of steps), weight_decay, max_length (tokens per
            input; default 128, or the model's limit when lower; beyond the model's positions is an error).
        dropout: dropout on the head's input (classification, pair-classification, regression, tagging).
        backbone_dropout: dropout inside the backbone (embeddings, attention probabilities, attention and
            feed-forward outputs) while fine-tuning. None: 0.0 for a sentence-embedding task with scores
            (a regression of cosines onto scores, which dropout's noise only blurs; benchmarks/README.md has
            the comparison), the model's own rates otherwise (in-batch-negative bi-encoders and the heads keep
            dropout as a regularizer). The model dir written keeps the rate it was tuned with.
        patience: stop after this many evaluations without a better dev score (None: never).
        metric: the dev figure that picks the best checkpoint and counts for `patience`, any the evaluation
            prints, e.g. "macro_f1" for classes of very different sizes (as KLUE's topic and hate-speech
            benchmarks rank) instead of classification's "accuracy"; "mse" is better lower. Default: the task's
            (accuracy, spearman, entity_f1, f1 for question answering, recall@1 or ap for bi-encoder pairs).
        eval_every: evaluate every N steps (default: once per epoch).
        max_steps: cap on optimizer steps.
        dtype: dtype policy for the backbone (e.g. "mixed_bfloat16").
        group_by_length: build each batch from examples of similar length (sorted within shuffled windows of
            64 batches; the batch order is shuffled), so batches carry little padding and short texts train
            faster. False: plain shuffled batches.
        similarity_loss: for a sentence-embedding task with scores: "cosine" (default: regression of the
            cosine onto score / max score, Sentence-BERT's CosineSimilarityLoss), "cosent" (CoSENT: a
            ranking loss over the pairs of each batch, every pair scored higher should have the higher cosine;
            the two are compared in benchmarks/README.md), or for pairs labelled 1 (paraphrase, duplicate) / 0
            (not) "contrastive" (sentence-transformers' OnlineContrastiveLoss, its recipe for duplicate
            questions: of each batch, the pairs farther apart than the closest non-pair are pulled together and
            the non-pairs closer than the farthest pair pushed to a cosine distance of at least 0.5). A dev set
            labelled 1 / 0 is scored by the average precision of its pairs ranked by cosine ("ap"; F1, accuracy
            and the F1 threshold beside it, as BinaryClassificationEvaluator), whatever the loss.
        pooling, layers: how token vectors become the one vector a sentence-embedding task outputs or a
            classification / pair-classification / regression head reads: one of "mean", "cls", "max",
            "first_last_avg" over `layers` as in `Embedder.encode` (`layers="all"` averages every layer, the
            embedding output included, before pooling), or for the heads "pooler" (BERT's tanh layer over
            the last layer's [CLS], with `layers=-1`). Defaults: "mean" for sentence-embedding (or, from a
            sentence-transformers dir, its own pooling and layers), "pooler" for the heads; tagging reads
            every token and takes neither. Saved with the model, so
            `Embedder.load(out_dir).encode`, `TaskModel.predict` and `kbert export` pool the same way
            (benchmarks/README.md compares the choices).
        resume: continue an interrupted run from `out_dir/checkpoints` (the default). A run stopped by SIGINT or
            SIGTERM (or by a crash after a checkpoint) saves its whole state there: weights, optimizer, dropout
            seeds, batch order, dev history and the best score so far, so the same call picks up at that step
            and ends as an uninterrupted run would. The checkpoint must come from the same settings and data
            (else a ValueError names what differs); `resume=False` deletes it and starts over. Removed when
            the run ends.
        checkpoint_every: steps between checkpoints (besides one after each dev evaluation and one at a
            stop); None: only those.
        stop_after: stop (with a checkpoint) after this many steps in this call, as a preemption would.
        objective: for sentence-embedding, "simcse": unsupervised SimCSE on `text_column` alone (each text
            twice through dropout is its own positive, the batch the negatives); `pair_column` and
            `label_column` then describe the dev set. None: pairs, as above.
        negative_column: for sentence-embedding with unscored (anchor, positive) pairs: a hard negative per
            row, scored against every anchor besides the batch's positives (NLI contradictions, non-paraphrases).
        temperature: in-batch and SimCSE losses divide cosines by it (0.05, SimCSE's and Sentence-BERT's scale 20).
            In those losses a candidate that is not a negative of a row (the same text as its positive or its
            anchor, or the positive of another row with the same anchor) is left out of that row's softmax,
            so repeated texts in a batch are never false negatives (sentence-transformers' "no_duplicates"
            batch sampler, without skipping rows).
        matryoshka_dims: for sentence-embedding, e.g. [64, 128]: the loss also trains the vectors cut to those
            widths (renormalized), so they can be truncated and still rank well.
        datasets: for sentence-embedding, several training sets in one run, each a mapping with `data` (a file
            or rows), its columns, `objective`, `similarity_loss`, `weight` (how many times an epoch sees
            it) and `name` (default: its number from 1); `train` is then unused. Every batch comes from one
            dataset and gets that dataset's loss, and each evaluation also records each dataset's own mean
            train loss as `train_loss_<name>` (the overall `train_loss` mixes losses of different scales).
        mix: how the datasets' batches are ordered: "proportional" (shuffled together) or "round_robin".
        mini_batch_size: for sentence-embedding, the texts that go through the network at a time (gradient
            caching, as sentence-transformers' Cached losses): the batch's vectors are computed a chunk at a
            time without activations, then each chunk runs again with its share of the loss's gradient. The
            update equals the whole batch's, in one chunk's activation memory, for about a third more compute:
            a large contrastive batch (more in-batch negatives) on a small GPU. None: the whole batch at once.
        prompts: for sentence-embedding, text put before the texts while training, as sentence-transformers'
            training `prompts`: one string for every text column, or {column: string} (E5-style: {"anchor":
            "query: ", "positive": "passage: ", "negative": "passage: "}); a `datasets` entry may have its own.
            The dev set's columns get the same.
        model_prompts: for sentence-embedding, the prompts the output keeps for inference ({"query": "query: ",
            "document": "passage: "}: `Embedder.encode_query` / `encode_document`, `search`, a
            sentence-transformers export). Default: the starting model's own (a sentence-transformers dir's).
        guide: for sentence-embedding with in-batch negatives (pairs, hard negatives, SimCSE; in `datasets`,
            each such dataset): a model dir or Hub name (a sentence-embedding task dir, a sentence-transformers
            dir, any kbert-loadable checkpoint: mean pooling) whose unit vectors of every distinct training text are
            computed once before training (then the guide leaves memory). A candidate the guide scores closer
            to an anchor than the anchor's own positive, less `guide_margin`, is then no negative of it
            (GISTEmbed; sentence-transformers' GISTEmbedLoss): paraphrases that are other rows' positives stop
            being pushed away. None: only exact repeats are left out.
        guide_margin: the cosine margin above (0: anything the guide ranks above the positive; more leaves
            out more, a negative value only what the guide ranks clearly above it).
        symmetric: for sentence-embedding with in-batch negatives (in `datasets`, a key of each): the loss is
            the mean of the usual direction (each anchor picks its positive among the batch's positives and
            hard negatives) and the reverse (each positive picks its anchor among the batch's anchors), as
            sentence-transformers' MultipleNegativesSymmetricRankingLoss and GTE's bidirectional loss. The
            reverse direction leaves out the same non-negatives (repeats, and the guide's when there is one).
            For pairs that are the same kind of text both ways (paraphrases); False: one direction.
        strategy: the devices, by `kbert pretrain --strategy`'s names: "auto" (every local device), "cpu",
            "mirrored" (the GPUs), "tpu". On Keras' JAX backend several devices train data-parallel: the
            weights replicated, each batch split along its rows, and XLA all-reduces the gradients.
            `batch_size` stays the whole batch, so results do not depend on the device count, and an in-batch
            loss scores every anchor against the whole batch's candidates, not one device's (what
            sentence-transformers calls gathering across devices). A batch whose rows do not divide among the
            devices (an epoch's last) runs on each of them whole. On TensorFlow fine-tuning runs on one device:
            "auto" only.
        doc_stride, max_query_length, max_answer_length: for question-answering (SQuAD, KorQuAD, KLUE-MRC
            rows: `question`, `context`, `answers` as `{"text": [...], "answer_start": [...]}`, the default
            columns; a SQuAD-format .json file is read as such): a context longer than `max_length` (default
            384 for this task) is cut into windows sharing `doc_stride` tokens, the question keeps its first
            `max_query_length` tokens, and dev answers are decoded up to `max_answer_length` tokens. Dev
            figures: KorQuAD's exact match and character F1 ("f1" picks the best checkpoint).
        lora_rank, lora_alpha, lora_targets: LoRA (`kbert.train.lora`): the encoder stays frozen and each
            adapted projection ("all": every linear one of each block; "attention": query/key/value and the
            attention output) learns a rank-`lora_rank` update scaled by `lora_alpha / lora_rank` (default
            alpha = rank); the task head (and the pooler where the head reads it) trains in full. The optimizer
            holds state for a few percent of the weights, so large checkpoints fit small GPUs. LoRA usually
            wants a larger `learning_rate` than full fine-tuning (1e-4 to 1e-3). The model dir written has
            the update merged into each kernel: a plain model, loaded, exported and served as any other.
        query_regularizer_weight, document_regularizer_weight: sparse-embedding (SPLADE) only: the weights of
            the FLOPS penalty on the anchors' and on the positives' (and hard negatives') vectors, what makes
            them sparse (sentence-transformers' SpladeLoss defaults, for heads of long pretraining). A weak head
            (a short CPU pretraining) starts with thousands of active tokens, whose large dot products saturate
            the in-batch softmax, and wants them far larger: choose them on a selection split (benchmarks/splade.py).
        inference_free, query_learning_rate: sparse-embedding only: inference-free SPLADE (OpenSearch's doc-only
            sparse models; sentence-transformers' Router of SparseStaticEmbedding and SPLADE). Documents (the
            positives and hard negatives) go through the model; a query (the anchor) is a trained weight per
            vocabulary token, given to each token it holds, so searching runs no model at all. The table starts
            as the training documents' BM25 IDF of each token (or as the starting model's table, when it is an
            inference-free model itself) and trains at `query_learning_rate` (sentence-transformers' 1e-3),
            beside the model's `learning_rate`. sentence-transformers' recipe puts no FLOPS penalty on such
            queries: set `query_regularizer_weight=0` to follow it. The output is an inference-free
            SparseEncoder dir that sentence-transformers and `kbert.SparseEncoder` read (`encode_query` reads
            the table).

    Example:
        >>> kbert.finetune("my-model", "classification", "train.tsv", "dev.tsv", out_dir="sentiment",
        ...                text_column="document", label_column="label")
    """
    settings = dict(locals())
    return run(FinetuneConfig(**settings))


def losses_by_key(names: Sequence[str], losses: Sequence[float], keys: Sequence[int]) -> dict:
    """{names[k]: the mean of the `losses` whose loss key is k} over a window of steps (a key with no step in
    the window is left out; no names: {})."""
    out = {}
    for k, name in enumerate(names):
        own = [loss for loss, key in zip(losses, keys) if key == k]
        if own:
            out[name] = float(np.mean(own))
    return out


def _check_head_pooling(task, pooling, layers, num_hidden):
    """Validated `(pooling, layers)` for a task; `layers="all"` becomes the list of every hidden state."""
    from kbert.models.pooling import POOLINGS, check_pooling

    if pooling == "pooler":
        if task == "sentence-embedding":
            raise ValueError(f"`pooling` for task='sentence-embedding' must be one of {POOLINGS} (the pooler "
                             f"is a classification head's input). Received: pooling='pooler'")
        if layers != -1:
            raise ValueError(f"pooling='pooler' reads the last layer's [CLS]; `layers` must be -1 with it. "
                             f"Received: layers={layers!r}")
        return pooling, -1
    if pooling not in POOLINGS:
        choices = POOLINGS if task == "sentence-embedding" else ("pooler",) + POOLINGS
        raise ValueError(f"`pooling` must be one of {choices}. Received: pooling={pooling!r}")
    if isinstance(layers, str) and layers == "all":
        layers = list(range(num_hidden))
    layers = layers if isinstance(layers, int) else list(layers)
    check_pooling(pooling, layers, num_hidden)
    return pooling, layers


def _load(config: FinetuneConfig, task):
    """(backbone with hidden states, tokenizer, max_length, backbone dropout, the sentence-transformers dir's
    settings or None, the model dir's kbert_task.json or None) of `config.model`."""
    from kbert.models.convert import check_vocabulary
    from kbert.models.locate import model_dir_of, read_task_meta, resolve_hub_name
    from kbert.models.io import with_dropout
    from kbert.models.st_dir import read_sentence_transformers, read_sparse_encoder
    from kbert.text.tokenizer import Tokenizer

    model_dir = model_dir_of(resolve_hub_name(os.fspath(config.model)))  # a hub name: its snapshot; a run dir: its model
    meta = read_task_meta(model_dir)
    if task.sparse:  # SPLADE: a masked-LM dir, or a SparseEncoder dir (its transformer's folder)
        st = None
        found = read_sparse_encoder(model_dir) or {"model_dir": model_dir}
        if found.get("query_weights") is not None and not config.inference_free:
            raise ValueError(f"{model_dir} is an inference-free SPLADE model (its queries read a weight table, not the "
                             f"model); give inference_free=True (--inference-free) to train it on, table and all, or "
                             f"start from its document model, {found['model_dir']}, to train SPLADE on both sides")
        task.start_query_weights = found.get("query_weights")  # the inference-free table to go on from
        weights_dir = found["model_dir"]
    else:
        st = None if meta else read_sentence_transformers(model_dir)
        weights_dir = st["model_dir"] if st else model_dir  # a sentence-transformers dir: its transformer's folder
    backbone = task.load_backbone(weights_dir, config.dtype)
    tokenizer = Tokenizer.from_model_dir(weights_dir)  # sentence-transformers keep it beside the weights
    check_vocabulary(backbone.config, tokenizer.vocab_size)
    # 128 tokens by default (question answering: 384, SQuAD's windows), or the model's limit when it has fewer
    # positions; beyond them is an error
    default_length = 384 if config.task == "question-answering" else 128
    max_length = (min(default_length, backbone.config.max_position) if config.max_length is None
                  else backbone.config.check_length(config.max_length))
    rate = config.backbone_dropout
    if (rate is None and config.task == "sentence-embedding" and config.label_column and not config.objective
            and not config.datasets):
        rate = 0.0  # a regression of cosines onto scores: dropout's noise only blurs it
    if rate is not None:
        backbone = with_dropout(backbone, float(rate), config.dtype)
    simcse = config.objective == "simcse" or any(d.get("objective") == "simcse" for d in config.datasets or []
                                                 if isinstance(d, dict))
    if simcse and not (backbone.config.dropout > 0 or backbone.config.attention_dropout > 0):
        raise ValueError("objective='simcse' learns from two dropout masks of the same text, and this backbone "
                         "has no dropout: set backbone_dropout (SimCSE uses 0.1)")
    return backbone, tokenizer, max_length, rate, st, meta


def _optimizer(config: FinetuneConfig, total: int, variables):
    from kbert.train.optimizers import NO_DECAY, AdamW, WarmupDecay

    optimizer = AdamW(
        learning_rate=WarmupDecay(config.learning_rate, total, int(config.warmup * total)),
        weight_decay=config.weight_decay, epsilon=1e-6, global_clipnorm=1.0)
    optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY))
    optimizer.build(variables)
    return optimizer


# How far below zero the untrained model's dev Spearman must be to suggest inverted labels: any backbone's cosine
# rises with word overlap, which rises with similarity, so a clear negative figure before training means the
# higher label marks the less similar pair (question-pair's `is_duplicate` marks paraphrases 0), and training
# would learn the data's convention backwards while the dev figures look like a hard task.
INVERTED_SPEARMAN = -0.1


def _warn_if_labels_look_inverted(baseline: Optional[dict], task_name: str, label_column: Optional[str]) -> None:
    rho = (baseline or {}).get("spearman")
    if task_name == "sentence-embedding" and rho is not None and rho < INVERTED_SPEARMAN:
        import warnings

        warnings.warn(f"before training, the model's cosine falls as the dev label `{label_column}` rises (Spearman "
                      f"{rho:.2f}): a higher label is read as more similar. If your data marks a matching pair with "
                      f"the lower value (question-pair's is_duplicate marks paraphrases 0), invert the labels "
                      f"first", stacklevel=3)


def _say_devices(c: FinetuneConfig, distribution, total: int) -> None:
    """Where the run trains, as pretraining says it; a batch that does not divide among several devices is
    warned about: `place` then puts every batch whole on each device, so they all repeat one device's work."""
    devices = int(distribution.device_mesh.devices.size) if distribution is not None else 1
    if devices > 1 and c.batch_size % devices:
        import warnings

        lower = c.batch_size - c.batch_size % devices
        warnings.warn(f"batch_size {c.batch_size} does not divide among the {devices} devices, so every batch runs "
                      f"whole on each of them (no speed-up); use a multiple of {devices}: "
                      f"{lower or devices} or {lower + devices}", stacklevel=4)
    if c.progress:
        split = "" if devices == 1 or c.batch_size % devices else f" = {devices} devices x {c.batch_size // devices}"
        print(f"training {c.task}: {total} steps, batch {c.batch_size}{split} on {backend()}", flush=True)


def run(config: FinetuneConfig, task=None, before_training=None) -> dict:
    """Fine-tunes as `config` says; returns the summary `kbert.finetune` documents.

    task: a `FinetuneTask` built by the caller (distillation's tasks carry a teacher) instead of the one
    `config.task` names; before_training: called once the examples are encoded (a teacher leaves memory)."""
    import contextlib

    config.validate()
    distribution = data_parallel(config.strategy)
    with contextlib.ExitStack() as held, \
            distribution.scope() if distribution is not None else contextlib.nullcontext():
        return _run(config, task, before_training, distribution, held)


def _guide_dir(c: FinetuneConfig) -> Optional[str]:
    """The guide's model dir (a Hub name: its snapshot; a run dir: its model), checked before any loading."""
    from kbert.models.locate import model_dir_of, resolve_hub_name

    if c.guide is None:
        return None
    path = model_dir_of(resolve_hub_name(os.fspath(c.guide)))
    if not os.path.isdir(path):
        raise ValueError(f"`guide` must be a model dir (kbert, sentence-transformers or Hugging Face) or a Hub "
                         f"name in the local cache; {os.fspath(c.guide)!r} is neither")
    return path


def _guide_vectors(c: FinetuneConfig, guide_dir: str, train_ex, max_length: int) -> None:
    """Sets `guide` `[distinct texts, h_g]` on every in-batch training set: the guide model's unit vectors of
    its distinct texts (on the guide's own tokenizer), computed once, then the guide's weights dropped."""
    from kbert.train.teacher import Teacher

    parts = [ex for ex in (getattr(train_ex, "parts", None) or [train_ex]) if ex.texts is not None]
    if not parts:
        raise ValueError("`guide` filters in-batch negatives, and no training set here has them (scored pairs "
                         "only): leave `guide` out, or train (anchor, positive) pairs or SimCSE")
    guide = Teacher(guide_dir, "embedding", dtype=c.dtype, progress=c.progress, role="guide")
    length = min(max_length, guide.config.max_position)
    for ex in parts:
        ex.guide = guide.vectors(ex.texts, length)
    guide.release()
    if c.progress:  # what share of the negatives the margin leaves out: the figure to tune `guide_margin` by
        shares = ", ".join(f"{guide_left_out(ex, c.batch_size, c.guide_margin):.1%}" for ex in parts)
        print(f"guide {c.guide}: vectors of {sum(len(ex.texts) for ex in parts)} distinct training texts; at "
              f"margin {c.guide_margin:g} it leaves out {shares} of the in-batch negatives "
              f"({'per dataset, ' if len(parts) > 1 else ''}random batches of {c.batch_size})", flush=True)


def guide_left_out(examples, batch_size: int, margin: float, batches: int = 20, seed: int = 0) -> float:
    """The share of in-batch negatives (candidates other than a row's own positive) that a guide's vectors
    (`examples.guide`) leave out at `margin`, over `batches` random batches: the numpy twin of
    `in_batch_loss`'s guide filter, for reporting only."""
    rng = np.random.default_rng(seed)
    t, g = examples.text_ids, examples.guide
    left = total = 0
    for _ in range(batches):
        rows = t[rng.choice(len(t), size=min(batch_size, len(t)), replace=False)]
        b = len(rows)
        candidates = batch_text_ids(rows)[b:]
        sim = g[rows[:, 0]] @ g[candidates].T  # [b, c]
        drop = sim > np.diagonal(sim)[:, None] - margin
        drop[np.arange(b), np.arange(b)] = False
        left, total = left + int(drop.sum()), total + drop.size - b
    return left / max(total, 1)


def _run(c: FinetuneConfig, task, before_training, distribution, held) -> dict:
    """`held`: the ExitStack that holds the output dir's lock from the first write to `run`'s return."""
    import keras

    from kbert.utils import StopSignals, progress_bar, writing_to

    task = task or task_for(c)
    task.check()
    guide_dir = _guide_dir(c)
    keras.utils.set_random_seed(c.seed)
    backbone, tokenizer, max_length, backbone_dropout, st, start_meta = _load(c, task)
    task.check_model(backbone)
    own = st or start_meta or {}  # the starting model's prompts, kept unless `model_prompts` replaces them
    model_prompts, default_prompt = check_prompts(
        own.get("prompts") if c.model_prompts is None else c.model_prompts,
        own.get("default_prompt_name") if c.model_prompts is None else None)
    pooling, layers = c.pooling, c.layers
    if st and task.name == "sentence-embedding" and pooling is None and layers == -1:
        pooling, layers = st["pooling"], st["layers"]  # a sentence-transformers model goes on with its own pooling
    if not task.token_head:
        pooling, layers = _check_head_pooling(task.name, pooling or default_pooling(task.name), layers,
                                              backbone.config.num_layers + 1)
    train_rows = task.read_train()
    dev_rows = read_rows(c.dev, task.columns, names=c.columns) if c.dev is not None else None
    task.labels = task.label_set(train_rows, c.progress)
    train_ex = task.encode(train_rows, tokenizer, max_length, "train")
    dev_ex = task.encode(dev_rows, tokenizer, max_length, "dev") if dev_rows else None
    task.fit(train_ex)
    if guide_dir is not None:
        _guide_vectors(c, guide_dir, train_ex, max_length)
    if before_training is not None:
        before_training()

    network = task.network(backbone, c.dropout, pooling, layers)
    build_network(network, tokenizer)
    steps_per_epoch = task.batches_per_epoch(train_ex, c.batch_size)
    total = max(1, int(math.ceil(steps_per_epoch * c.epochs)))
    if c.max_steps:
        total = min(total, int(c.max_steps))
    eval_every = int(c.eval_every or steps_per_epoch)
    if c.lora_rank:  # after the network is built (the factors' shapes) and before a checkpoint is restored
        enable_lora(backbone, c.lora_rank, c.lora_alpha, c.lora_targets)
    # The pooler feeds only the [CLS] heads: bi-encoders, taggers and heads on other poolings leave it untouched
    # (else JAX's zero gradients would still let weight decay shrink it).
    reads_pooler = task.trains_pooler and pooling == "pooler"
    variables = [v for v in network.trainable_variables if reads_pooler or not v.path.startswith("pooler/")]
    if c.lora_rank:
        variables = lora_trainable(variables, backbone)
        if c.progress:
            trained = sum(int(np.prod(v.shape)) for v in variables)
            total_weights = sum(int(np.prod(v.shape)) for v in network.weights
                                if "seed" not in v.path and not is_factor(v))
            print(f"LoRA rank {c.lora_rank} on {c.lora_targets} projections: {trained:,} of {total_weights:,} "
                  f"weights train ({100 * trained / total_weights:.2f}%)", flush=True)
    optimizer = _optimizer(c, total, variables)

    # one update: tf.function + GradientTape on TensorFlow, jax.jit of the stateless update on JAX; the batch's
    # split point n and the loss key are static (a compiled step per value: full and last batches, few keys)
    if c.mini_batch_size:  # gradient caching: the vectors a chunk at a time, then each chunk's backward pass
        if not hasattr(task, "embedding_loss") or task.other_variables():
            raise ValueError(f"`mini_batch_size` (gradient caching) applies to task='sentence-embedding'. "
                             f"Received: task={task.name!r}")
        train_step = cached_training_step(lambda feats: task.embed(network, feats),
                                          lambda v, y, n, key: task.embedding_loss(v, y, n, key), network,
                                          variables, optimizer, c.mini_batch_size)
    else:
        train_step = training_step(lambda feats, y, n, key: task.loss(network, feats, y, n, key), network,
                                   variables, optimizer, read=task.other_variables())
    if distribution is not None:  # a teacher built before this scope: its weights onto every device too
        replicate(distribution, task.other_variables())
    _say_devices(c, distribution, total)

    def finetune_inference(feats):  # named: kbert.compiled quiets TensorFlow's retracing alarm for this name
        return network(feats, training=False)

    infer = compiled(finetune_inference, network.variables, distribution=distribution)
    # JAX compiles each shape: batches are padded to a few widths (and, to evaluate, row counts)
    on_jax, limit = backend() == "jax", backbone.config.max_position

    def evaluate(examples):
        def outputs(ids, segs):
            rows = len(ids)
            if on_jax:
                ids, segs = (bucketed(x, v, limit, rows=True) for x, v in ((ids, tokenizer.pad_id), (segs, 0)))
            return np.asarray(infer(model_inputs(ids, segs, tokenizer.pad_id)), np.float32)[:rows]

        return task.evaluate(outputs, examples, c.batch_size, tokenizer.pad_id)

    key = task.dev_metric(dev_ex)
    higher_is_better = task.higher_is_better
    if c.metric is not None:
        if dev_ex is None:
            raise ValueError(f"`metric` ({c.metric!r}) picks the best checkpoint by a dev figure; give `dev`")
        key, higher_is_better = c.metric, c.metric not in LOWER_IS_BETTER
    base_model = os.path.abspath(c.model) if isinstance(c.model, str) else None
    meta = {"task": task.name, "labels": task.labels, "max_length": max_length, "text_column": c.text_column,
            "pair_column": c.pair_column, "label_column": c.label_column, "pooling": pooling,
            "layers": None if task.token_head else layers, "base_model": base_model,
            "target": list(task.target) if task.name == "regression" else None, **getattr(task, "extra_meta", {})}
    if task.name == "sentence-embedding" and model_prompts:
        meta.update(prompts=model_prompts, default_prompt_name=default_prompt)
    # what a resumed run must share with the interrupted one (not its devices: a run is the same on any number)
    settings = {k: v for k, v in c.to_dict().items() if k not in ("model", "train", "dev", "out_dir", "progress",
                                                                   "resume", "checkpoint_every", "stop_after",
                                                                   "max_steps", "labels", "strategy")}
    settings.update(model=base_model or repr(c.model), data=data_fingerprint(train_ex, dev_ex), labels=task.labels,
                    max_length=max_length, eval_every=eval_every, total_steps=total, pooling=pooling, layers=layers,
                    backbone_dropout=backbone_dropout)
    # One writer per dir: a second run on it would resume from, and overwrite, this one's checkpoints. Taken
    # here, before the first read or write of the dir, not at the start: a call that fails on its model or
    # data takes no lock (and leaves no dir)
    held.enter_context(writing_to(c.out_dir, "kbert finetune"))
    saver = FinetuneCheckpoint(os.path.join(c.out_dir, CHECKPOINT_DIR), network, optimizer, settings, c.resume)
    saved = saver.restore()
    rng = np.random.default_rng(c.seed)
    if saved is None:
        history, best, best_step, bad, losses, loss_keys, step = [], None, 0, 0, [], [], 0
        baseline = evaluate(dev_ex) if dev_ex is not None else None
        if baseline is not None and c.progress:
            print("before training: dev " + " ".join(f"{k} {v:.4f}" for k, v in baseline.items()), flush=True)
        _warn_if_labels_look_inverted(baseline, task.name, c.label_column)
        if baseline is not None and (key not in baseline or key in NOT_SCORES):
            raise ValueError(f"`metric` must be a dev figure of {task.name}: one of "
                             f"{[k for k in baseline if k not in NOT_SCORES]}. Received: {key!r}")
    else:
        history, best, best_step, bad, losses, step, baseline = (
            saved[k] for k in ("history", "best", "best_step", "bad", "losses", "step", "baseline"))
        loss_keys = saved.get("loss_keys") or [-1] * len(losses)  # -1: a checkpoint that did not keep them
        for _ in range(step // steps_per_epoch):  # the batch order of the finished epochs, drawn again
            task.epoch_batches(rng, train_ex, c.batch_size, c.group_by_length)
        if c.progress:
            print(f"resumed at step {step} of {total} from {saver.path}", flush=True)
    keep = max(eval_every, 50)
    skip = step % steps_per_epoch  # batches of the current epoch that were trained before the restart
    # TensorBoard curves in OUT/logs, as kbert.pretrain writes them (`tensorboard --logdir OUT/logs`): the train
    # loss every LOG_EVERY steps (each dataset's too), the dev metrics at each evaluation
    write_scalars = scalar_writer(os.path.join(c.out_dir, LOG_DIR))
    end = total if c.stop_after is None else min(total, step + c.stop_after)
    bar = progress_bar(total=total, desc=f"finetune {task.name}", unit="step", enabled=c.progress, initial=step)
    stopped, start_time, saved_at = "steps", time.time(), step
    with StopSignals() as signals:
        while step < end and stopped == "steps":
            for batch in task.epoch_batches(rng, train_ex, c.batch_size, c.group_by_length)[skip:]:
                feats, y, n, loss_key = task.training_batch(train_ex, batch, tokenizer.pad_id)
                if on_jax:
                    feats, y = bucketed_features(feats, y, tokenizer.pad_id, limit, task.label_pad)
                if distribution is not None:
                    feats, y = place(distribution, (feats, y))
                loss = train_step(feats, y, static=(n, loss_key))
                if not math.isfinite(loss):
                    raise FloatingPointError(f"Fine-tuning diverged at step {step + 1} (loss {loss}); lower "
                                             f"`learning_rate` (now {c.learning_rate})"
                                             + (f"; the checkpoint of step {saved_at} is kept" if saved_at else ""))
                losses.append(loss)
                loss_keys.append(loss_key)
                if len(losses) > 2 * keep:  # the train loss is a mean over the last evaluation's window
                    del losses[:-keep], loss_keys[:-keep]
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
                if step % LOG_EVERY == 0:
                    own = losses_by_key(task.loss_names, losses[-LOG_EVERY:], loss_keys[-LOG_EVERY:])
                    write_scalars(step, {"train/loss": np.mean(losses[-LOG_EVERY:]),
                                         **{"train/" + k[len("train_"):]: v for k, v in own.items()}})
                evaluated = step % eval_every == 0 or step == total
                if evaluated:
                    entry = {"step": step, "epoch": round(step / steps_per_epoch, 3),
                             "train_loss": float(np.mean(losses[-eval_every:]))}
                    entry.update(losses_by_key(task.loss_names, losses[-eval_every:], loss_keys[-eval_every:]))
                    improved = True
                    if dev_ex is not None:
                        metrics = evaluate(dev_ex)
                        entry.update({f"dev_{k}": v for k, v in metrics.items()})
                        improved = best is None or (metrics[key] > best if higher_is_better else metrics[key] < best)
                    history.append(entry)
                    write_scalars(step, {f"dev/{k[4:]}": v for k, v in entry.items() if k.startswith("dev_")})
                    if improved:
                        best, best_step, bad = (entry.get(f"dev_{key}"), step, 0)
                        task.save(network, c.out_dir, tokenizer, meta)
                    else:
                        bad += 1
                    if c.progress:
                        shown = " ".join(f"{k} {v:.4f}" for k, v in entry.items() if k not in ("step", "epoch"))
                        bar.write(f"epoch {entry['epoch']:g} step {step}: {shown}"
                                  + ((" (best, saved)" if dev_ex is not None else " (saved)") if improved else ""))
                    if c.patience is not None and dev_ex is not None and bad >= c.patience:
                        stopped = "early_stopping"
                        break
                if step >= total:
                    break
                if signals.received or step >= end:
                    stopped = signals.received or "stop_after"
                if stopped != "steps" or evaluated or (c.checkpoint_every and step % c.checkpoint_every == 0):
                    write_scalars.flush()
                    saver.save(step, dict(history=history, best=best, best_step=best_step, bad=bad,
                                          losses=losses[-keep:], loss_keys=loss_keys[-keep:], baseline=baseline))
                    saved_at = step
                if stopped != "steps":
                    break
            skip = 0
    bar.close()
    write_scalars.close()
    finished = stopped in ("steps", "early_stopping")
    summary = {"task": task.name, "model_dir": c.out_dir, "steps": step, "stopped_by": stopped, "history": history,
               "baseline": baseline, "best_step": best_step, "metric": key if dev_ex is not None else None,
               "best": best, "labels": task.labels, "seconds": time.time() - start_time,
               "checkpoint": None if finished else saver.path}
    if finished:
        saver.remove()  # the best model is in out_dir
        summary["model_card"] = write_finetune_card(c, task, backbone.config, meta, train_ex, dev_ex,
                                                    dict(summary, max_length=max_length,
                                                         backbone_dropout=backbone_dropout))
    elif c.progress:
        print(f"fine-tuning stopped at step {step} ({stopped}); the same call resumes from {saver.path}", flush=True)
    return summary
