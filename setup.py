from setuptools import find_packages, setup

setup(
    name="kbert",
    version="0.1.0",
    description="Korean BERT/ALBERT pretraining and embedding SDK on TensorFlow 2 + Keras 3",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["kbert", "kbert.*"]),
    # The core runs on either Keras backend; pick one with an extra: `.[tf]` (TensorFlow: tf.data raw-text
    # pipelines, in-graph tokenization, SavedModel export, the default) or `.[jax]` (JAX: GPUs and TPU VMs,
    # every command but `kbert export` with no TensorFlow installed).
    install_requires=[
        "keras>=3.8,<4",
        # sentencepiece 0.2.2 changed how unigram ties between equal-score segmentations are broken
        # (`..` + `...` vs `...` + `..`); kbert's in-graph unigram path (tensorflow-text's fast op) follows
        # 0.2.2-0.2.3 exactly, so Python ids equal `ds.map(tok)`'s on every review (tests check it).
        "sentencepiece>=0.2.2,<0.2.4",
        "konlpy>=0.6,<0.7",
        "numpy>=1.26,<3",
        # Sparse products of the co-occurrence embedding start (kbert/train/embedding_init.py); JAX needs it too.
        "scipy>=1.10",
        "safetensors>=0.4",
        "pyyaml>=6",
        "tqdm>=4.60",
        "tensorboard>=2.16",
        # Model names such as "klue/bert-base": the Hub's own client, with its cache and offline mode.
        "huggingface_hub>=0.20",
        # TFRecord checksums for `kbert data prepare` without TensorFlow (kbert/data/records.py).
        "google-crc32c>=1.5",
        # One writer per output dir (kbert.utils.writing_to); huggingface_hub installs it already.
        "filelock>=3.12",
    ],
    extras_require={
        "tf": ["tensorflow>=2.21,<2.22", "tensorflow-text>=2.21,<2.22"],
        "jax": ["jax>=0.4.30"],
        "mecab": ["mecab-ko>=1.0"],
        "kiwi": ["kiwipiepy>=0.17"],
        "faiss": ["faiss-cpu>=1.8"],
        # Embedder.search(..., lexical=w): character n-gram TF-IDF through scikit-learn's vectorizer.
        "search": ["scikit-learn>=1.4", "faiss-cpu>=1.8"],
        # `kbert serve`: Starlette on uvicorn (the ASGI stack under FastAPI) and Prometheus metrics.
        "serve": ["starlette>=0.37", "uvicorn>=0.29", "httptools>=0.6", "uvloop>=0.19; sys_platform != 'win32'",
                  "prometheus-client>=0.20", "orjson>=3.9"],
        # benchmarks/embed.py compares against sentence-transformers on the same weights.
        "bench": ["sentence-transformers>=3", "torch==2.13.0", "transformers>=4.40,<6", "scikit-learn>=1.4",
                  "keybert>=0.8"],
        # kbert.export_onnx / OnnxEmbedder: tf2onnx traces the Keras graph (Keras' own ONNX exporter), onnx renames
        # the dynamic axes and checks the file, ONNX Runtime runs it (and quantizes it to int8).
        "onnx": ["tf2onnx>=1.16", "onnx>=1.15", "onnxruntime>=1.17"],
        # Opening and editing the tutorial notebooks (running them needs only [test]'s nbclient).
        "tutorials": ["jupyterlab>=4", "nbconvert>=7", "nbclient>=0.10", "ipykernel>=6", "matplotlib>=3.8"],
        "test": [
            "tensorflow>=2.21,<2.22",
            "tensorflow-text>=2.21,<2.22",
            "pytest>=8",
            # pytest.ini runs the suite on two workers (`-n 2 --dist loadfile`): compiling, tracing and the
            # subprocess tests leave a core idle that a second worker fills.
            "pytest-xdist>=3.5",
            "mecab-ko>=1.0",
            "kiwipiepy>=0.17",
            # The independent numerical reference: transformers on CPU torch (2.13.0 is the local CPU wheel).
            "torch==2.13.0",
            "transformers>=4.40,<6",
            # kbert.export_sentence_transformers is checked by loading its dirs with sentence-transformers.
            "sentence-transformers>=3",
            # kbert.distill_static is checked against Model2Vec's own distillation and loading (the base package;
            # its [distill] extra pins transformers, and the tests need only its torch inference helpers).
            "model2vec>=0.7",
            # model2vec 0.10 imports skeletoken for its distillation (its [distill] extra would also pin
            # transformers below 5.4, which the rest of the suite is past)
            "skeletoken>=0.6",
            # kbert.keywords is checked against KeyBERT's own extraction on the same candidates and vectors.
            "keybert>=0.8",
            # The JAX backend tests run the same model code and the pretraining loop under KERAS_BACKEND=jax.
            "jax>=0.4.30",
            # kbert's LAMB is checked step by step against optax's transforms (the paper's update, ALBERT's masks).
            "optax>=0.2",
            "faiss-cpu>=1.8",
            # hybrid search, and benchmarks/quality.py's helpers (its TF-IDF baselines and pair sampling).
            "scikit-learn>=1.4",
            # The tutorial notebooks run end to end in the test suite.
            "nbclient>=0.10",
            "nbformat>=5",
            # the server's tests and benchmark (loopback only)
            "starlette>=0.37",
            "uvicorn>=0.29",
            "httptools>=0.6",
            "uvloop>=0.19; sys_platform != 'win32'",
            "prometheus-client>=0.20",
            "orjson>=3.9",
            "httpx>=0.27",
            "ipykernel>=6",
            "matplotlib>=3.8",
            # kbert.export_onnx is checked by running its files in ONNX Runtime against the Keras model.
            "tf2onnx>=1.16",
            "onnx>=1.15",
            "onnxruntime>=1.17",
        ],
    },
    entry_points={"console_scripts": ["kbert=kbert.cli:main"]},
)
