"""What a pretrained backbone's frozen features know about sentiment: linear probes beside random init.

Takes a finished `benchmarks/quality.py` output directory and, for its pretrained model and the same model
from random initialization, encodes the NSMC-style training and dev reviews with `kbert.Embedder` (no
fine-tuning), then fits a logistic regression on standardized features for each pooling/layer and each
number of labelled reviews. Features that pretraining made useful show up here before any fine-tuning
can wash them out; pooling and layer choices can be compared without training a model per choice.

    python benchmarks/linear_probe.py --run ~/.cache/kbert/quality --shared ../shared/data --sizes 2000,10000
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from label_curve import load_run, run_arguments  # noqa: E402  (the same run layout and sentiment split)


def main():
    args = run_arguments(__doc__.splitlines()[0]).parse_args()

    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    import kbert

    _, models, sizes, train, dev = load_run(args)
    y_train = np.array([int(r["label"]) for r in train])
    y_dev = np.array([int(r["label"]) for r in dev])

    rows = {}
    for name, path in models.items():
        embedder = kbert.Embedder.load(path, max_length=64)
        layers = embedder.backbone.config.num_layers
        for pooling, layer in [("cls", layers), ("mean", 0), ("mean", layers // 2), ("mean", layers)]:
            start = time.time()
            x_train, x_dev = (embedder.encode([r["text"] for r in rows_], pooling=pooling, layers=[layer],
                                              batch_size=128, progress=False) for rows_ in (train, dev))
            scaler = StandardScaler().fit(x_train)
            for n in sizes:
                clf = LogisticRegression(max_iter=2000).fit(scaler.transform(x_train[:n]), y_train[:n])
                accuracy = float((clf.predict(scaler.transform(x_dev)) == y_dev).mean())
                rows[(pooling, layer, n, name)] = accuracy
            print(f"{name}: {pooling} pooling, layer {layer}: "
                  + ", ".join(f"{n} labels {rows[(pooling, layer, n, name)]:.4f}" for n in sizes)
                  + f" ({time.time() - start:.0f} s)", flush=True)

    print(f"\n| features | {' | '.join(f'{m}, {n:,} labels' for m in models for n in sizes)} |")
    print("|---|" + "---:|" * (len(models) * len(sizes)))
    for pooling, layer in sorted({k[:2] for k in rows}, key=lambda k: (k[0] != "cls", k[1])):
        label = "[CLS]" if pooling == "cls" else "mean pooling"
        cells = " | ".join(f"{rows[(pooling, layer, n, m)]:.4f}" for m in models for n in sizes)
        print(f"| {label}, layer {layer} | {cells} |")


if __name__ == "__main__":
    main()
