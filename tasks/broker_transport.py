"""The Redis broker transport, safe to use across a Redis restart.

After a connection error kombu 5.7 lets a channel's transport go (Connection.collect)
while the channel can still be reached: kombu closes it a second time and tries to
give back the messages it held, Celery acks on it a message it delivered, a producer
publishes on it. Each then fails with an AttributeError on the missing transport,
which no connection-error handler catches, so the worker exits ("Unrecoverable error")
or a task fails for good (a store dead-lettered while Redis restarted). Such a channel
is what it is, a lost connection: a redis ConnectionError, which kombu and Celery
already handle (publish again on a new connection; log the lost ack and go on).
Tests: tests/tasks/test_durable_requests.py, Redis killed mid-store.
"""

from __future__ import annotations

import redis
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous=False):
        transport = self.connection
        if transport is None or transport.client is None:
            raise redis.exceptions.ConnectionError("this broker channel's connection is closed")
        return super()._connparams(asynchronous=asynchronous)


class Transport(kombu_redis.Transport):
    Channel = Channel


def register() -> None:
    """Make redis:// and rediss:// broker URLs use this transport (before any connection
    is made: kombu caches a scheme's class once resolved). The URLs stay as they are, so
    Flower and the logs still show a redis:// broker."""
    for scheme in ("redis", "rediss"):
        TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
