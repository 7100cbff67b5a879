"""`stored`: one small LLM-like checkpoint stored in memory, for each test module that asks."""

from __future__ import annotations

import pytest

from tests.checkpoints import write_llm_like
from tests.coordinator.plan.in_memory import store_in_memory


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    path = tmp_path_factory.mktemp("manifest") / "step_100.safetensors"
    write_llm_like(path)
    return path, *store_in_memory(path)
