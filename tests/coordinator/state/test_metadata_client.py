"""The metadata client's connections: what each costs before its first command."""

from __future__ import annotations

import redis
import redis.utils

from coordinator.state.metadata import Metadata


def test_a_connection_sends_no_client_setinfo(monkeypatch):
    """redis-py names itself to the server on every new connection (CLIENT SETINFO
    LIB-NAME and LIB-VER, two round trips), and for that reads its own version from the
    installed package's metadata (importlib.metadata: ~7 ms a client, the CLI makes two
    or three). Nothing reads it back: the client skips both."""

    def no_lookup() -> str:
        raise AssertionError("the client looked up redis-py's version")

    monkeypatch.setattr(redis.utils, "get_lib_version", no_lookup)
    md = Metadata("redis://127.0.0.1:1/0")
    connection = md.r.connection_pool.make_connection()
    assert getattr(connection, "driver_info", None) is None
    assert getattr(connection, "lib_name", None) is None
    md.close()
