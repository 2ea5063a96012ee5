"""Shared test setup: every MindSpore test runs in GRAPH_MODE on CPU (the production mode)."""
import mindspore as ms

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
