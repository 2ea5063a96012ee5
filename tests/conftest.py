"""Shared test setup: every MindSpore test runs in GRAPH_MODE on CPU (the production mode)."""

import mindspore as ms
import pytest

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenizer/MindRecord cache for the whole session, never the user's."""
    return str(tmp_path_factory.mktemp("mindmoe_cache"))
