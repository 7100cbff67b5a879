"""The worker takes JSON task messages only (tasks/app.py's accept_content): a pickled one,
whoever puts it on the broker, is refused before it is unpickled, and dropped."""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path

import kombu

from coordinator import config
from coordinator.state.versions import COMMITTED
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt, sha
from tests.tasks.test_delivery_policy import EMBED, task_headers

# Celery's words (celery/worker/consumer/consumer.py, INVALID_TASK_ERROR, with kombu's
# ContentDisallowed from kombu/serialization.py) for a message it would not deserialize.
REFUSED = (
    "Received invalid task message: Refusing to deserialize untrusted content of type"
    " pickle (application/x-python-serialize)"
)
DISCARDED = "The message has been ignored and discarded."


class Touch:
    """Unpickled anywhere, creates `path`: the sign that a payload ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_a_pickled_task_message_is_refused_unread_dropped_and_the_worker_serves_on(
    make_cluster, tmp_path
):
    """A pickled smoltorrent.remove of a committed version, put on the control queue with
    kombu as anyone who reaches Redis could. With pickle accepted, the worker unpickled
    it (the marker file appeared) and removed the version."""
    c = make_cluster(2)
    src = make_ckpt(tmp_path / "j.safetensors", 1_000_000)
    vkey = c.cli_json("store", str(src))["vkey"]
    marker = tmp_path / "unpickled"
    task_id = str(uuid.uuid4())
    headers = task_headers("smoltorrent.remove", task_id, (vkey,), {})
    body = pickle.dumps(((vkey,), {}, EMBED | {"marker": Touch(marker)}))
    with kombu.Connection(c.redis_url) as connection:
        connection.Producer().publish(
            body,
            routing_key=config.CONTROL_QUEUE,
            content_type="application/x-python-serialize",
            content_encoding="binary",
            headers=headers,
            correlation_id=task_id,
        )

    def taken() -> bool:  # refused, or (were pickle accepted) received or unpickled
        log = c.worker_log()
        return REFUSED in log or task_id in log or marker.exists()

    wait_until(taken, timeout=60, what="the worker to take the message")
    assert not marker.exists()
    log = c.worker_log()
    assert REFUSED in log and DISCARDED in log and task_id not in log
    assert c.md.versions.state(vkey) == COMMITTED
    # Rejected, not requeued: neither the queue nor, once the reject that follows the log
    # line is done, the worker's unacked messages (which Redis would deliver again after
    # the visibility timeout) hold it.
    assert not [m for m in c.md.r.lrange(config.CONTROL_QUEUE, 0, -1) if task_id in m]
    wait_until(
        lambda: not [m for m in c.md.r.hvals("unacked") if task_id in m],
        timeout=10,
        what="the message to leave the unacked ones",
    )

    out = tmp_path / "out.safetensors"  # under the gather dirs: the worker gathers it
    c.cli("gather", "j.safetensors", "-o", str(out))
    assert sha(out) == sha(src) and "event=done task=gather" in c.worker_log()
    assert not marker.exists()
