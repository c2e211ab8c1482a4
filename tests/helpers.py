"""Shared test helpers: tiny reference models built with `transformers` (CPU torch), batches, Korean text."""

from __future__ import annotations

import os

import numpy as np
import pytest

# The developers' and CI's real Korean data (never copied into the repo): ../shared/data beside the checkout.
SHARED = os.environ.get("KBERT_SHARED_DATA") or os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
needs_shared = pytest.mark.skipif(not os.path.isdir(SHARED), reason=f"the shared Korean data is not at {SHARED}")

KOREAN_SENTENCES = [
    "대한민국은 민주공화국이다.",
    "학교에서 친구들과 점심을 먹었어요.",
    "이 영화 정말 재밌다 ㅋㅋㅋㅋ",
    "서울특별시 강남구 테헤란로 123번지에서 2024년 3월 1일 회의가 열렸다.",
    "BERT와 ALBERT는 Transformer 인코더를 사용합니다.",
    "옛한글 ᄒᆞᆫ글과 호환 자모 ㄱㄴㄷ도 살아남아야 한다 😀",
]


def tiny_hf_config(architecture="bert", **overrides):
    import transformers

    common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=37, max_position_embeddings=64, type_vocab_size=2,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    common.update(overrides)
    if architecture == "bert":
        return transformers.BertConfig(**common)
    common.setdefault("embedding_size", 16)
    common.setdefault("hidden_act", "gelu_new")
    common.setdefault("num_hidden_groups", 1)
    return transformers.AlbertConfig(**common)


def tiny_hf_pretraining_model(architecture="bert", seed=0, **overrides):
    """A randomly initialized BertForPreTraining / AlbertForPreTraining in eval mode.

    Weights get extra noise (LayerNorm gains and biases too) so a conversion that drops or swaps any
    tensor changes the outputs.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_hf_config(architecture, **overrides)
    cls = transformers.BertForPreTraining if architecture == "bert" else transformers.AlbertForPreTraining
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def hf_masked_lm_dir(tmp_path, texts, architecture="bert"):
    """A Hugging Face *ForPreTraining dir with a character WordPiece vocab.txt of `texts`, and transformers'
    masked-LM model and fast tokenizer on it: (dir, model, tokenizer)."""
    import transformers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = sorted({c for t in texts for c in t if not c.isspace()})
    vocab += chars + [f"##{c}" for c in chars]
    out = tmp_path / architecture
    out.mkdir()
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tiny_hf_pretraining_model(architecture, vocab_size=len(vocab)).save_pretrained(out)
    cls = transformers.BertForMaskedLM if architecture == "bert" else transformers.AlbertForMaskedLM
    hf = cls.from_pretrained(str(out)).eval()
    tok = transformers.BertTokenizerFast(str(out / "vocab.txt"), do_lower_case=False, strip_accents=False)
    return str(out), hf, tok


def inference_free_splade_dir(tmp_path, texts):
    """sentence-transformers' inference-free SPLADE (Router.for_query_document: SparseStaticEmbedding for queries,
    a masked-LM transformer + SpladePooling for documents), saved; and it."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.models import Router
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SparseStaticEmbedding, SpladePooling

    path, _, tok = hf_masked_lm_dir(tmp_path, texts)
    tok.save_pretrained(path)
    mlm = MLMTransformer(path)
    torch.manual_seed(0)
    weights = torch.rand(len(mlm.tokenizer.get_vocab())) * 3.0
    weights[weights < 0.6] = 0.0  # tokens a query keeps no weight for
    static = SparseStaticEmbedding(tokenizer=mlm.tokenizer, weight=weights)
    st = SparseEncoder(modules=[Router.for_query_document(query_modules=[static],
                                                          document_modules=[mlm, SpladePooling("max")])],
                       similarity_fn_name="dot")
    out = str(tmp_path / "inference-free")
    st.save(out)
    return out, st


def tiny_embedding_model(path: str, max_position: int = 64) -> str:
    """Saves at `path` a random bert-tiny 32 wide (2 heads) with a 1,500-piece vocabulary learned on konlpy's
    kolaw and kobill, the same weights every call; returns `path`."""
    import keras

    import kbert
    from kbert.data.corpus import corpus

    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=1500, progress=False)
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, hidden_size=32, num_heads=2,
                                   intermediate_size=64, max_position=max_position)
    keras.utils.set_random_seed(0)  # the same random model whichever tests ran before in this worker
    kbert.save_model(kbert.BertBackbone(cfg), path, tokenizer=tok)
    return path


def random_batch(vocab_size=99, lengths=(9, 5, 12, 1), seq_len=12, seed=0):
    """Padded batch of mixed lengths with two segments: dict of int32 arrays."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    token_ids = np.zeros((b, seq_len), "int32")
    segment_ids = np.zeros((b, seq_len), "int32")
    padding_mask = np.zeros((b, seq_len), "int32")
    for i, n in enumerate(lengths):
        token_ids[i, :n] = rng.integers(5, vocab_size, n)
        token_ids[i, 0] = 2
        padding_mask[i, :n] = 1
        segment_ids[i, n // 2:n] = 1
    return {"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": padding_mask}


def hf_outputs(model, batch):
    """Hidden states, MLM logits and pair logits of a transformers pretraining model, as numpy."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(batch["token_ids"], dtype=torch.long),
                    token_type_ids=torch.tensor(batch["segment_ids"], dtype=torch.long),
                    attention_mask=torch.tensor(batch["padding_mask"], dtype=torch.long),
                    output_hidden_states=True)
    pair = out.seq_relationship_logits if hasattr(out, "seq_relationship_logits") else out.sop_logits
    return ([h.numpy() for h in out.hidden_states], out.prediction_logits.numpy(), pair.numpy())


def all_positions(batch):
    b, s = batch["token_ids"].shape
    return np.tile(np.arange(s, dtype="int32")[None], (b, 1))


def max_abs_diff_valid(a, b, padding_mask):
    """Max |a - b| over non-padding positions of [b, s, ...] arrays."""
    keep = padding_mask.astype(bool)
    return float(np.max(np.abs(np.asarray(a)[keep] - np.asarray(b)[keep])))


# the first lines of a `run_on_jax` script for a host without TensorFlow: importing it (or tensorflow-text)
# fails from here on, as where it is not installed
# the same for a host with no Keras backend at all (ONNX Runtime alone): Keras, JAX and torch fail too
BLOCK_FRAMEWORKS = (
    "import builtins, json, sys\n"
    "real = builtins.__import__\n"
    "def guard(name, *a, **k):\n"
    "    if name.split('.')[0] in ('tensorflow', 'tensorflow_text', 'keras', 'jax', 'jaxlib', 'torch'):\n"
    "        raise ImportError('No module named ' + name)\n"
    "    return real(name, *a, **k)\n"
    "builtins.__import__ = guard\n")
# a script's start on a host with no Keras backend (ONNX exports, static models): kbert, its CLI and its server
NO_BACKEND_PRELUDE = BLOCK_FRAMEWORKS + (
    "import warnings; warnings.simplefilter('ignore')\n"
    "import io, contextlib\n"
    "import kbert\n"
    "from kbert.cli import main\n"
    "from kbert.server import Engine\n")
BLOCK_TENSORFLOW = (
    "import builtins, json, sys\n"
    "real = builtins.__import__\n"
    "def guard(name, *a, **k):\n"
    "    if name.split('.')[0] in ('tensorflow', 'tensorflow_text'):\n"
    "        raise ImportError('No module named ' + name)\n"
    "    return real(name, *a, **k)\n"
    "builtins.__import__ = guard\n")


def run_on_jax(script: str, timeout: int = 600, env=None):
    """Runs `script` in a fresh Python under Keras' JAX backend on CPU (Keras fixes its backend at import, and
    this process runs TensorFlow) and returns the JSON object of its last output line."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", **(env or {}))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


def xlmr_dir(tmp_path, vocab_size=800, model_class="XLMRobertaModel", **overrides):
    """A Hugging Face dir as XLM-RoBERTa's sentence models ship one (BGE-M3, KURE, multilingual E5): a unigram
    `sentencepiece.bpe.model` numbered <unk> <s> </s> by SentencePiece, which transformers renumbers as fairseq's
    dictionary, and a tiny XLMRobertaModel (or `model_class`, e.g. a reranker's
    XLMRobertaForSequenceClassification, with config `overrides`) over its 802 ids."""
    import io
    import json

    import sentencepiece as spm
    import torch
    import transformers

    from kbert.data.corpus import corpus

    lines = [line for doc in corpus(["kolaw"]) for line in doc if line.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                   model_type="unigram", normalization_rule_name="nmt_nfkc", unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, minloglevel=2)
    out = str(tmp_path / "xlmr")
    os.makedirs(out)
    open(os.path.join(out, "sentencepiece.bpe.model"), "wb").write(buf.getvalue())
    json.dump({"tokenizer_class": "XLMRobertaTokenizer", "model_max_length": 64},
              open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8"))
    config = transformers.XLMRobertaConfig(vocab_size=vocab_size + 2, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=64, max_position_embeddings=66,
                                           pad_token_id=1, type_vocab_size=1, **overrides)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(out)
    return out


class HeldDir:
    """Another process holding `path` as `kbert.utils.writing_to` does for `job` (a second kbert job running
    there) until `kill()`: SIGKILL, so nothing of the holder's own clean-up runs."""

    def __init__(self, path: str, job: str = "kbert pretrain"):
        import subprocess
        import sys

        script = ("import sys\nfrom kbert.utils import writing_to\n"
                  f"with writing_to({path!r}, {job!r}):\n    print('held', flush=True)\n    sys.stdin.read()\n")
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=30)
