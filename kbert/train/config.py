"""Pretraining settings: nested dataclasses read from YAML/JSON with `--set a.b=value` overrides.

Unknown keys fail with the key named; the resolved config is written next to the checkpoints, and
`kbert pretrain --print-config` prints it (every key with its default) without training.

    model: bert-tiny                # a preset name, or a full ModelConfig mapping, or a model to continue
                                    # pretraining from: a model/run dir, a Hugging Face dir, a cached hub name
                                    # ({from: klue/bert-base, dropout: 0.0} to change its dropouts;
                                    # {preset: albert-base, hidden_size: 256} to change a preset's fields,
                                    # or --set model.hidden_size=256 beside --model albert-base)
    data: {source: [kolaw, kobill], tokenizer: out/tokenizer, objective: mlm+nsp, max_length: 128}
                                    # objective: mlm | mlm+nsp (BERT) | mlm+sop (ALBERT) | electra;
                                    # unset: the records' own, else nsp for BERT and sop for ALBERT
    optimizer: {name: adamw, learning_rate: 1e-4, warmup_steps: 100}
    trainer: {steps: 1000, batch_size: 32}
    runtime: {strategy: auto, precision: auto}   # compilation_cache: auto | none | a dir (JAX)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, List, Optional, Union


@dataclasses.dataclass
class DataConfig:
    RENAMED = {"max_seq_len": "max_length"}  # old key -> new key, accepted with a warning for one release
    source: Any = None  # corpus (paths / recipe names), a records dir, or "dummy"
    # raw-text sources: kbert.data.corpus.FORMATS, None to detect each file's from its name; "lines" (a text per
    # line: reviews, comments) is never detected, and a plain-text file without blank lines is otherwise read in
    # documents of 1,000 lines
    format: Optional[str] = None
    tokenizer: Optional[str] = None  # tokenizer dir / vocab.txt / .model
    # mlm | mlm+nsp | mlm+sop | electra (replaced-token detection, MLM data); None: a records dir's own, else the
    # architecture's (BERT's next-sentence prediction, ALBERT's sentence-order prediction, as each was published)
    objective: Optional[str] = None
    max_length: int = 128
    max_predictions: Optional[int] = None
    mask_rate: float = 0.15
    whole_word: bool = True
    ngram: Optional[int] = None  # mask runs of 1..n whole words; None: the architecture's (BERT 1, ALBERT 3)
    short_seq_prob: float = 0.1
    shuffle_buffer: int = 10_000
    workers: Optional[int] = None
    # join consecutive documents shorter than a sequence until each fills one (raw text: reviews, comments)
    join_documents: bool = False


@dataclasses.dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw | lamb
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-6
    clip_norm: Optional[float] = 1.0  # global-norm clipping
    warmup_steps: int = 0
    decay: str = "linear"  # linear | polynomial | constant
    power: float = 1.0  # for polynomial decay
    end_learning_rate: float = 0.0


@dataclasses.dataclass
class TrainerConfig:
    steps: int = 1000
    batch_size: Union[int, str] = 32  # global batch (all replicas, all micro-batches), or "auto"
    accumulation: int = 1  # micro-batches per optimizer step
    log_every: int = 10
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    memory: Optional[str] = None  # device memory for batch_size="auto" when it cannot be read ("12GB")
    oom_fallback: bool = True  # on out-of-memory: halve the micro-batch, double accumulation, resume
    # token embeddings to start from: "random" (BERT's), or "cooccurrence": PPMI + SVD vectors of the raw-text
    # source, computed in about a minute (kbert/train/embedding_init.py); pays off most when compute is short
    embedding_init: str = "random"
    # raw text to count those co-occurrences on instead of `data.source` (paths or corpus names, as data.source
    # takes): a run on prepared records, or a table of other text than the one pretrained on
    embedding_init_text: Optional[Any] = None


@dataclasses.dataclass
class ElectraConfig:  # used with data.objective = "electra" (replaced-token detection)
    generator_size: float = 0.25  # generator width / discriminator width
    rtd_weight: float = 50.0  # loss = generator MLM loss + rtd_weight x replaced-token loss


@dataclasses.dataclass
class RuntimeConfig:
    strategy: str = "auto"  # auto | tpu | mirrored | multiworker | cpu
    tpu: Optional[str] = None
    precision: str = "auto"  # auto | float32 | mixed_float16 | mixed_bfloat16
    jit: Union[bool, str] = "auto"  # XLA for the train step ("auto": on one device; TPUs compile anyway)
    seed: int = 0
    # JAX: where compiled steps are kept between runs, so that a resumed or repeated run reads its step
    # instead of compiling it again ("auto": $JAX_COMPILATION_CACHE_DIR, else ~/.cache/kbert/jax; "none": off)
    compilation_cache: Optional[str] = "auto"


@dataclasses.dataclass
class PretrainConfig:
    model: Any = "bert-tiny"  # preset name, ModelConfig fields, or a model to continue from (see above)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    electra: ElectraConfig = dataclasses.field(default_factory=ElectraConfig)
    output_dir: str = "kbert-pretrain"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, ensure_ascii=False)

    @classmethod
    def from_dict(cls, values: dict) -> "PretrainConfig":
        return build_dataclass(cls, values or {}, "")

    @classmethod
    def load(cls, path: Optional[str] = None, overrides: Optional[List[str]] = None) -> "PretrainConfig":
        """Reads YAML or JSON (None: defaults) and applies `key.sub=value` overrides (values parsed as YAML)."""
        return cls.from_dict(load_mapping(path, overrides, model_fields=True))


def load_mapping(path: Optional[str] = None, overrides: Optional[List[str]] = None, base: Optional[dict] = None,
                 model_fields: bool = False) -> dict:
    """The mapping of a YAML/JSON config file (None: `base` or empty) with `key.sub=value` overrides applied
    (values parsed as YAML, so `--set trainer.steps=100` is an int). `model_fields`: pretraining's `model`, a
    name, takes `model.<field>` overrides by turning into its mapping form."""
    values = dict(base or {})
    if path is not None:  # "" too: `--config "$CFG"` with CFG unset trained on the defaults without a word
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Config file not found: {path!r}")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        loaded = _parse(text, path)
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the config must be a mapping, got {type(loaded).__name__}")
        values.update(loaded)
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"Override {item!r} must look like key.subkey=value")
        key, raw = item.split("=", 1)
        import yaml

        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ValueError(f"Override {item!r}: its value is not valid YAML ({_yaml_problem(e)})") from None
        node = values
        parts = key.strip().split(".")
        if model_fields and len(parts) > 1 and parts[0] == "model" and isinstance(values.get("model"), str):
            values["model"] = _model_mapping(values["model"])
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"Override {item!r}: {p!r} is not a section")
        node[parts[-1]] = value
    return _expand_home(values)


def _expand_home(value):
    """`~/corpus.txt` in a config file (or a --set value, which no shell expands) as the home dir's path: kbert's
    file operations, like Python's, take `~` literally, and `output_dir: ~/runs/bert` wrote to ./~/runs/bert."""
    if isinstance(value, dict):
        return {k: _expand_home(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_home(v) for v in value]
    if isinstance(value, str) and (value == "~" or value.startswith(("~/", "~" + os.sep))):
        return os.path.expanduser(value)
    return value


def _model_mapping(name: str) -> dict:
    """`model: albert-base` refined by `--set model.hidden_size=256`: the same choice in the mapping form that
    takes field overrides (`preset:` for a preset, `from:` for a model to continue pretraining from)."""
    from kbert.models.config import PRESETS

    return {"preset" if name in PRESETS else "from": name}


def _parse(text: str, path: str):
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None


def _yaml_problem(error) -> str:
    """PyYAML's error in one line: what it expected and where (1-based line and column)."""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(error, 'problem', None) or error}{where}"


def _coerce(field, value, key: str):
    """YAML reads `3e-4` as a string: numbers are converted by the field's type, with the key in the error."""
    kind = str(field.type)
    if isinstance(value, str) and ("float" in kind or "int" in kind) and not kind.startswith("Union[int, str]"):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"`{key}` must be a number. Received: {value!r}") from None
        return int(number) if "int" in kind and "float" not in kind and number.is_integer() else number
    return value


def build_dataclass(cls, values: dict, prefix: str = ""):
    """`cls(**values)` for nested dataclasses, unknown keys refused by name and numbers read from strings."""
    if not isinstance(values, dict):
        raise ValueError(f"`{prefix.rstrip('.') or 'config'}` must be a mapping. Received: {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old in values:
            import warnings

            if new in values:
                raise ValueError(f"`{prefix}{old}` is the old name of `{prefix}{new}`: give only `{prefix}{new}`")
            warnings.warn(f"config key `{prefix}{old}` is deprecated: use `{prefix}{new}`", DeprecationWarning)
            values = {(new if k == old else k): v for k, v in values.items()}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        import difflib

        # a flag's name as a key (`out` for --out's `out_dir`) or a typo: name the key meant first
        close = difflib.get_close_matches(unknown[0], list(fields), n=1, cutoff=0.6)
        hint = f" (did you mean `{prefix}{close[0]}`?)" if close else ""
        raise ValueError(f"Unknown config key `{prefix}{unknown[0]}`{hint}; valid keys under "
                         f"`{prefix.rstrip('.') or 'the top level'}`: {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        default = fields[name].default_factory() if fields[name].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            kwargs[name] = build_dataclass(type(default), value or {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(fields[name], value, f"{prefix}{name}")
    return cls(**kwargs)
