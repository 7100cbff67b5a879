"""Readable task arguments (what Flower shows), built into every message by the app's
AMQP class; the Flower test (tests/coordinator/cli/test_flower.py) reads them back."""

from __future__ import annotations

from celery import Celery

from tasks.readable import describe, transfer_repr


def test_each_task_reads_as_its_checkpoint_shard_node_and_bytes() -> None:
    transfer = {"vkey": "ab" * 16, "name": "run1/step_100.safetensors", "shard": 3}
    transfer |= {"replica": 1, "node_id": "0123456789abcdef" * 2, "digest": "ff" * 32}
    assert describe("smoltorrent.transfer", (), transfer) == (
        "run1/step_100.safetensors",
        "shard 3 -> node 0123456789ab (copy 2)",
    )
    assert transfer_repr("a.safetensors", 0, 0, "n" * 32, 12_345_678) == (
        "a.safetensors",
        "shard 0 -> node nnnnnnnnnnnn (copy 1), 12.3 MB",
    )
    chain = {**transfer, "replicas": [0, 1], "node_ids": ["a" * 32, "b" * 32]}
    assert describe("smoltorrent.chain", (), chain)[1] == (
        "shard 3 -> nodes aaaaaaaaaaaa -> bbbbbbbbbbbb (copies 1, 2)"
    )
    more = [{**chain, "shard": s} for s in (7, 11, 15, 19)]  # a batch of chunks
    assert describe("smoltorrent.chain", (), {**chain, "more": more})[1] == (
        "5 chunks (3, 7, 11, 15, …) -> nodes aaaaaaaaaaaa -> bbbbbbbbbbbb (copies 1, 2)"
    )
    store = ("/ckpt/step_100.safetensors", "step_100.safetensors", 2, None)
    assert describe("smoltorrent.store", store, {"request_id": "r"}) == (
        "step_100.safetensors",
        "from /ckpt/step_100.safetensors, 2 copies",
    )
    assert describe("smoltorrent.commit", ("cd" * 16,), {}) == (
        "version cdcdcdcdcdcd",
        "version cdcdcdcdcdcd",
    )
    assert describe("smoltorrent.gather", ("cd" * 16, "/out/x"), {})[1] == "into /out/x"
    assert describe("smoltorrent.sweep.reconcile", (), {}) == ("reconcile", "")
    assert describe("smoltorrent.transfer", (), {"vkey": "x"}) is None  # another shape
    assert describe("celery.ping", (), {}) is None
    long = describe("smoltorrent.store", ("/" + "d" * 500, "n", 2, None), {})
    assert len(long[1]) == 200 and long[1].endswith("…")


def test_the_app_puts_them_in_every_message_it_builds() -> None:
    app = Celery("readable-test", amqp="tasks.readable:ReadableAMQP", set_as_current=False)
    message = app.amqp.create_task_message(
        "commit-x", "smoltorrent.commit", ("cd" * 16,), {}, create_sent_event=True
    )
    assert message.headers["argsrepr"] == "version cdcdcdcdcdcd"
    assert message.sent_event["args"] == "version cdcdcdcdcdcd"  # Flower's first sight of it
    given = app.amqp.create_task_message(
        "commit-y", "smoltorrent.commit", ("cd" * 16,), {}, argsrepr="a", kwargsrepr="b"
    )
    assert (given.headers["argsrepr"], given.headers["kwargsrepr"]) == ("a", "b")
