"""Sentence pooling in `keras.ops`: one definition shared by `Embedder.encode`, the exported SavedModel and
bi-encoder fine-tuning, so the three give the same vectors.

Keras is imported inside the functions that compute: the names and checks here are also read where no Keras
backend is installed (an ONNX export's runners)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

POOLINGS = ("mean", "cls", "max", "first_last_avg")
SPLADE_POOLINGS = ("max", "sum")  # sentence-transformers' SpladePooling pooling_strategy
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")  # log(1 + relu(z)), or log(1 + log(1 + relu(z))) (OpenSearch's)


def check_pooling(pooling: str, layers: Union[int, Sequence[int]], num_hidden: int) -> List[int]:
    """Validates `pooling` and `layers` for a model with `num_hidden` hidden states (embedding output
    included); returns the layer list."""
    if pooling not in POOLINGS:
        raise ValueError(f"`pooling` must be one of {POOLINGS}. Received: pooling={pooling!r}")
    chosen = [layers] if isinstance(layers, int) else list(layers)
    if not chosen or not all(isinstance(l, int) for l in chosen):
        raise ValueError(f"`layers` must be an int or a non-empty list of ints. Received: {layers!r}")
    for l in chosen:
        if not -num_hidden <= l < num_hidden:
            raise ValueError(f"`layers` entries must be in [{-num_hidden}, {num_hidden - 1}] (0 is the "
                             f"embedding output). Received: {l}")
    return chosen


def splade_pool(logits, padding_mask, pooling: str = "max", activation: str = "relu", log1p: bool = True):
    """SPLADE vectors `[b, v]` (float32) from masked-LM logits `[b, s, v]` at every token: for each vocabulary
    token, the max (or sum) over the text's tokens of log(1 + relu(logit)), padding left out (SpladePooling's
    formula, Formal et al. 2021). log1p=False writes log(1 + x) as a log of a sum, for graphs whose runtime
    has no log1p op (ONNX); it differs from log1p only for x below float32's epsilon, by less than x."""
    from keras import ops

    log = ops.log1p if log1p else (lambda x: ops.log(x + 1.0))
    mask = ops.cast(padding_mask, "float32")[:, :, None]
    z = log(ops.relu(ops.cast(logits, "float32") * mask))  # padding: log(1 + 0) = 0, never a max
    if activation == "log1p_relu":
        z = log(z)
    return ops.max(z, axis=1) if pooling == "max" else ops.sum(z, axis=1)


def pool(hidden_states, padding_mask, pooling: str = "mean", layers: Union[int, Sequence[int]] = -1,
         normalize: bool = False):
    """Sentence vectors `[b, h]` (float32) from a backbone's `hidden_states` (list of `[b, s, h]`).

    mean: average over real tokens ([CLS]/[SEP] included, as sentence-transformers); cls: the first token;
    max: maximum over real tokens; first_last_avg: mean pooling of the first layer's and the last layer's
    outputs averaged. `layers` (for all but first_last_avg) averages those layers before pooling.
    """
    from keras import ops

    x = layer_average(hidden_states, pooling, layers)
    mask = ops.cast(padding_mask, "float32")[:, :, None]
    if pooling == "cls":
        vec = x[:, 0]
    elif pooling == "max":
        vec = ops.max(ops.where(mask > 0, x, ops.full_like(x, -3.0e38)), axis=1)
    else:
        vec = ops.sum(x * mask, axis=1) / ops.maximum(ops.sum(mask, axis=1), 1.0)
    if normalize:
        vec = vec / ops.maximum(ops.sqrt(ops.sum(vec * vec, axis=-1, keepdims=True)), 1e-12)
    return vec


# poolings that `pool_packed` computes as a weighted sum over a packed row (max has no such form)
PACKED_POOLINGS = ("mean", "cls", "first_last_avg")


def pool_packed(hidden_states, weights, pooling: str = "mean", layers: Union[int, Sequence[int]] = -1):
    """Sentence vectors `[b, t, h]` (float32) of packed rows (`Backbone.packed_hidden_states`): `weights`
    [b, t, s] holds, for text t of row b, 1/length on its tokens (mean, first_last_avg) or 1 on its first
    token (cls), 0 elsewhere; the same vectors as `pool` gives each text alone."""
    if pooling not in PACKED_POOLINGS:
        raise ValueError(f"packed rows pool with one of {PACKED_POOLINGS}. Received: pooling={pooling!r}")
    from keras import ops

    x = layer_average(hidden_states, pooling, layers)
    return ops.einsum("bts,bsh->bth", ops.cast(weights, "float32"), x)


def layer_average(hidden_states, pooling: str, layers):
    """The float32 average of the layers a pooling reads: `layers`, or the first and last for first_last_avg."""
    from keras import ops

    chosen = check_pooling(pooling, layers, len(hidden_states))
    if pooling == "first_last_avg":
        picked = [hidden_states[1], hidden_states[-1]] if len(hidden_states) > 1 else [hidden_states[-1]]
    else:
        picked = [hidden_states[l] for l in chosen]
    x = ops.cast(picked[0], "float32")
    for h in picked[1:]:
        x = x + ops.cast(h, "float32")
    return x / float(len(picked))


def parse_layers(text: Optional[str], name: str = "--layers"):
    """A command-line layer choice: None or "-1" -> -1, "all" -> "all", "0,4" -> [0, 4] (0 = embedding output)."""
    if text is None:
        return -1
    if text == "all":
        return "all"
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name}: expected all, -1 or comma-separated integers such as 0,4; got {text!r}") from None
    return values[0] if len(values) == 1 else values
