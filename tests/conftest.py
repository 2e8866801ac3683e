import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gemma():
    from hetspec import load_model
    return load_model("gemma3-270m", dtype="float32")


@pytest.fixture(scope="session")
def smollm():
    from hetspec import load_model
    return load_model("smollm2-135m", dtype="float32")
