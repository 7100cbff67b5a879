"""What `smoltorrent beat` logs while its Redis is away: a line when it goes, a line when
it is back, not a traceback per sweep.

Celery beat sends each due sweep with a result subscription it never reads; after a
Redis restart the subscription's reconnect gives up after ~20 s ("The Celery application
must be restarted"), and beat logs every failed send with its stack and traceback
(Scheduler.apply_entry): about 1,000 lines for one restart, and then it recovers by
itself. So beat sends without subscribing (it never waits on a result: the worker still
stores each one), and a filter on its log handlers turns a send that failed for want of
Redis into one line, says nothing more until a send goes through, then says so.
"""

from __future__ import annotations

import logging
import time

import redis
from celery import signals
from celery._state import _set_task_join_will_block
from celery.beat import SchedulingError
from kombu.exceptions import OperationalError

from coordinator import config

_LOST_PREFIXES = ("Connection to Redis lost", "Retry limit exceeded")  # celery's own lines
_SENDING = "Scheduler: Sending due task"
_log = logging.getLogger("smoltorrent.beat")


def _for_want_of_redis(exc: BaseException | None) -> bool:
    """Whether `exc` (a failed send) comes down to Redis not answering."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError | OperationalError | OSError):
            return True
        if isinstance(exc, RuntimeError) and "must be restarted" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class OutageFilter(logging.Filter):
    """One line for an outage, one for its end; everything else passes as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.down_since: float | None = None
        self.sending_since_error = False

    def publish_failed(self, exc: BaseException, interval: float) -> None:
        """kombu's errback for a send that failed and is tried again in `interval` s (the
        publish retry policy): the outage's line, once."""
        self.sending_since_error = False
        if self.down_since is None:
            self.down_since = time.monotonic()
            _log.warning(_lost_line(_cause(exc)))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == _log.name:
            return True  # this module's own lines
        message = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        lost = message.lstrip().startswith(_LOST_PREFIXES) or (
            isinstance(exc, SchedulingError) and _for_want_of_redis(exc)
        )
        if lost:
            self.sending_since_error = False
            if self.down_since is not None:
                return False  # said already
            self.down_since = time.monotonic()
            self._rewrite(record, logging.WARNING, _lost_line(_cause(exc) or message.strip()))
            return True
        if self.down_since is not None and message.startswith(_SENDING):
            if self.sending_since_error:  # the send before this one went through
                away = time.monotonic() - self.down_since
                self.down_since, self.sending_since_error = None, False
                record.msg = f"Redis is back (away about {away:.0f} s); {record.msg}"
                return True
            self.sending_since_error = True
        return True

    @staticmethod
    def _rewrite(record: logging.LogRecord, level: int, text: str) -> None:
        record.msg, record.args = text, ()
        record.exc_info = record.exc_text = record.stack_info = None
        record.levelno, record.levelname = level, logging.getLevelName(level)


def _lost_line(cause: str) -> str:
    url = config.redis_url_from_env()
    return (
        f"lost Redis ({config.shown_url(url) if url else 'the embedded one'}: {cause}):"
        " sweeps are not sent until it is back; beat goes on by itself, no restart needed"
    )


def _cause(exc: BaseException | None) -> str:
    """The deepest error's words: "Error 111 connecting to 127.0.0.1:6379. Connection
    refused.", not the SchedulingError wrapping it."""
    last = None
    while exc is not None:
        last, exc = exc, exc.__cause__ or exc.__context__
    words = str(last).strip() if last is not None else ""
    return words.splitlines()[0] if words else type(last).__name__ if last else ""


def install(app) -> None:
    """Called by `smoltorrent beat` before Celery starts it."""
    outage = OutageFilter()
    app.conf.task_publish_retry_policy = {
        **(app.conf.task_publish_retry_policy or {}),
        "errback": outage.publish_failed,
    }

    @signals.after_setup_logger.connect(weak=False)
    def _filter_handlers(logger: logging.Logger, **_) -> None:
        for handler in logger.handlers:
            handler.addFilter(outage)

    @signals.beat_init.connect(weak=False)
    def _no_result_subscription(**_) -> None:
        # What a worker's pool processes set: a send subscribes to no result.
        _set_task_join_will_block(True)
