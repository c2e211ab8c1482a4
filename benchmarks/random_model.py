"""The stand-in model of benchmarks run without `--model`: a bert-mini with random weights over a 2,000-piece
vocabulary learned on konlpy's statutes (kolaw, kobill), the same every run. Its figures measure speed and
agreement with the reference only; a trained model gives results worth reading."""

from __future__ import annotations


def random_model(out: str, heads: bool = False) -> str:
    """Writes the model dir at `out` (with masked-LM and NSP heads when `heads`) and returns `out`."""
    import keras

    import kbert
    from kbert.data.corpus import corpus

    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=2000, progress=False)
    keras.utils.set_random_seed(0)
    config = kbert.ModelConfig.preset("bert-mini", vocab_size=tok.vocab_size, max_position=512)
    backbone = kbert.BertBackbone(config)
    kbert.save_model(kbert.Pretrainer(backbone) if heads else backbone, out, tokenizer=tok)
    return out
