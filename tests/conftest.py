import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_policy():
    """Every test starts (and ends) under the float32 policy, whatever the previous test set."""
    import keras

    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
