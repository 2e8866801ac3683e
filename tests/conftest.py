import os
from contextlib import ExitStack

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


@pytest.fixture
def exit_stack():
    """Context managers a test enters, exited after it: in-process workers and model threads shut down, so their
    threads (and OpenMP teams) do not outlive the test (deployments/runtime/model_threads.py says why that matters)."""
    with ExitStack() as stack:
        yield stack


# Markers from what a test uses, so none is forgotten: `real` for the real offline models (docs/models.md),
# `serve` for a private Ray instance with the Serve app. `-m "not real and not serve"` is the fast loop.
REAL_MODEL_FIXTURES = {"gemma", "smollm"}
RAY_FIXTURES = {"served_app", "limited_app", "running",  # tests/serve_fixtures.py, test_limits_serve, test_multinode
                "autoscaling_app", "two_pipelines_app"}  # test_autoscaling_serve


def pytest_collection_modifyitems(items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & REAL_MODEL_FIXTURES:
            item.add_marker(pytest.mark.real)
        if used & RAY_FIXTURES:
            item.add_marker(pytest.mark.serve)
            item.add_marker(pytest.mark.real)  # every served app loads the real small pair
