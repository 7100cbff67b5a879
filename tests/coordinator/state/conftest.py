"""The metadata on a real redis-server, started for each test on a free port in its temp dir."""

from __future__ import annotations

import os
import signal

import pytest

from coordinator.state.embedded_redis import start_redis, url_for
from coordinator.state.metadata import Metadata


@pytest.fixture
def md(tmp_path):
    pid, port = start_redis(tmp_path / "redis")
    yield Metadata(url_for(tmp_path / "redis", port))
    os.kill(pid, signal.SIGTERM)
