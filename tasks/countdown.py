"""A countdown (a retry's backoff, a request sent again for when its lease lapses) kept by
the worker that receives it, on its monotonic clock, whatever its wall clock says.

Celery writes a countdown into the message as an ETA on the sender's wall clock, and the
receiving worker holds the message until its own wall clock reaches it: a retry sent
before a worker's clock stepped back (NTP after a boot without a clock, a VM restored)
was held for as long as the step, minutes or hours, by that worker or by one whose clock
is behind the sender's. The message now also carries its countdown in seconds, and the
worker holds it until the ETA or that long after it received it, whichever comes
first: never longer than asked (a message received late was due already), never less
than the countdown since it arrived.
"""

from __future__ import annotations

import time

from kombu.asynchronous.timer import to_timestamp

from tasks.readable import ReadableAMQP

# The message header carrying the countdown: {"s": seconds, "eta": the ETA it was sent
# with}. The ETA ties it to its own message: a retry is built from the running task's
# request, whose headers (this one with them) Celery copies over the new message's.
HEADER = "smoltorrent_countdown"


class CountdownAMQP(ReadableAMQP):
    """Celery's task messages, readable (ReadableAMQP), with their countdown in HEADER."""

    def as_task_v2(self, task_id, name, args=None, kwargs=None, countdown=None, *rest, **options):
        message = super().as_task_v2(task_id, name, args, kwargs, countdown, *rest, **options)
        if countdown:
            message.headers[HEADER] = {"s": float(countdown), "eta": message.headers["eta"]}
        return message


def strategy(task, app, consumer, **kwargs):
    """Celery's default strategy for `task` (its Task.Strategy), holding a message with a
    countdown at most that long after it arrived."""
    from celery.worker.strategy import default

    handle = default(task, app, consumer, **kwargs)

    def handler(message, body, ack, reject, callbacks, **options):
        headers = message.headers or {}
        hold = headers.get(HEADER)
        if not isinstance(hold, dict) or not hold.get("eta") or hold["eta"] != headers.get("eta"):
            return handle(message, body, ack, reject, callbacks, **options)
        # The timer runs on the monotonic clock: kombu's to_timestamp turns the ETA into
        # it through this worker's wall clock, which is what a step makes wrong.
        due = time.monotonic() + float(hold["s"])

        def held_until(eta, *args, **kwargs) -> float:
            return min(to_timestamp(eta, *args, **kwargs), due)

        return handle(message, body, ack, reject, callbacks, to_timestamp=held_until)

    return handler
