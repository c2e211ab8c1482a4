import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(__file__))
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # JAX runs' compiled steps (`runtime.compilation_cache: auto`)
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    # kept for this test session (and its subprocesses) only, not in the user's ~/.cache
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="kbert-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)

import pytest  # noqa: E402

import kbert  # noqa: E402,F401  (first: where Triton is installed it then loads before TensorFlow, kbert/__init__.py)

# The longest files first (by `--durations` of a full run): under
# `--dist loadfile` each file runs on one worker, so starting the long ones together keeps either worker
# from finishing with one of them alone. The order inside a file is kept (a stable sort).
LONGEST_FIRST = ["test_train.py", "test_tutorials.py", "test_tasks_jax.py", "test_finetune.py", "test_train_jax.py",
                 "test_distill.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _float32_policy():
    """Every test starts (and ends) under the float32 policy, whatever the previous test set."""
    import keras

    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
