"""One structured line in the worker's log per task that ends, retries or fails.

    event=done task=chain name=m.safetensors vkey=1dd1929b890b shard=1 replicas=0,1
        nodes=182617d96470,7b6e1c553227 blob=67b5a05d374d how=replicated+sent seconds=0.054
    event=failed task=gather vkey=abababababab error="...: refusing to write /etc/x: ..."

(each on one line, after Celery's own prefix).

logfmt (key=value, quoted when it holds a space), so `grep name=run1/` or a log shipper
finds every event of a checkpoint, a shard or a node without parsing prose. The fields
come from the task's own arguments (checkpoint name, version, shard, replica, node,
blob) and, for a finished task, the parts of its result that say what happened.
Connected to Celery's task signals, so no task has to remember to log.
"""

from __future__ import annotations

import inspect
import time

from celery import current_app, signals
from celery._state import get_current_task
from celery.app.log import TaskFormatter
from celery.utils.log import ColorFormatter, get_task_logger

from smoltorrent import defaults

log = get_task_logger("smoltorrent.events")

# argument -> field, in the order they are written; ids cut to what tells them apart
ARGUMENT_FIELDS = {
    "name": "name",
    # The version's storage key, not the version id `ls` prints (a done store or gather
    # also says version_id=): both were called "version", and a grep for one found nothing.
    "vkey": "vkey",
    "shard": "shard",
    "replica": "replica",
    "replicas": "replicas",
    "node_id": "node",
    "node_ids": "nodes",
    "source": "source",
    "target": "target",
    "digest": "blob",
}
# result key -> field, for a task that finished
RESULT_FIELDS = {
    "name": "name",
    "vkey": "vkey",
    "version_id": "version_id",
    "how": "how",
    "size": "size",
    "new": "new",
}
SHORT = {"vkey", "node", "nodes", "source", "target", "blob", "version_id"}

_started: dict[str, float] = {}  # task id -> monotonic start, in the process running it


def _value(field: str, value: object) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_value(field, v) for v in value)
    text = str(value)
    if field in SHORT:
        text = text[: defaults.LOG_ID_CHARS]
    if not text or any(c in text for c in ' "=\n'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'
    return text


def fields_of(task, args, kwargs) -> dict[str, object]:
    """What the task was asked to do, by the fields above, from its bound arguments."""
    try:
        bound = inspect.signature(task.run).bind_partial(*(args or ()), **(kwargs or {}))
    except TypeError:
        return {}
    given = bound.arguments
    return {field: given[arg] for arg, field in ARGUMENT_FIELDS.items() if arg in given}


def line(event: str, task, fields: dict[str, object]) -> str:
    short = task.name.removeprefix("smoltorrent.")
    parts = [f"event={event}", f"task={short}"]
    parts += [f"{k}={_value(k, v)}" for k, v in fields.items() if v is not None]
    return " ".join(parts)


def _ours(task) -> bool:
    return bool(task) and getattr(task, "name", "").startswith("smoltorrent.")


@signals.task_prerun.connect
def _on_start(task_id=None, task=None, **_):
    if _ours(task):
        _started[task_id] = time.monotonic()


@signals.task_postrun.connect
def _on_end(task_id=None, task=None, args=None, kwargs=None, retval=None, state=None, **_):
    started = _started.pop(task_id, None)
    if not _ours(task) or state != "SUCCESS":
        return  # retries and failures have their own signal, with the error
    fields = fields_of(task, args, kwargs)
    if isinstance(retval, dict):
        for key, field in RESULT_FIELDS.items():
            if key in retval and not isinstance(retval[key], dict):
                fields.setdefault(field, retval[key])
        if isinstance(retval.get("nodes"), dict) and retval["nodes"]:
            fields["nodes"] = sorted(retval["nodes"])
    elif isinstance(retval, str):
        fields["result"] = retval
    if started is not None:
        fields["seconds"] = f"{time.monotonic() - started:.3f}"
    log.info(line("done", task, fields))


@signals.task_retry.connect
def _on_retry(sender=None, request=None, reason=None, **_):
    if _ours(sender) and request is not None:
        fields = fields_of(sender, request.args, request.kwargs)
        fields["attempt"] = (request.retries or 0) + 1
        fields["error"] = reason
        # INFO: a retry is planned (a file still settling, a node restarting); what fails
        # for good is the failure line, an ERROR.
        log.info(line("retry", sender, fields))


@signals.task_failure.connect
def _on_failure(sender=None, args=None, kwargs=None, exception=None, **_):
    if _ours(sender):
        fields = fields_of(sender, args, kwargs)
        fields["error"] = f"{type(exception).__name__}: {exception}"
        log.error(line("failed", sender, fields))


class TaskOrPlainFormatter(TaskFormatter):
    """A task's lines carry its name and id; a line a task logger writes outside any task
    (the boot sequence, a consumer step) gets the worker's plain format, not Celery's
    `???[???]:` in place of the name and id."""

    def __init__(self, fmt=None, use_color=True, datefmt=None, plain=None) -> None:
        super().__init__(fmt, use_color=use_color, datefmt=datefmt)
        self._plain = ColorFormatter(plain, use_color=use_color, datefmt=datefmt)

    def format(self, record):
        task = get_current_task()
        if task and task.request:
            return super().format(record)
        return self._plain.format(record)


@signals.after_setup_task_logger.connect
def _plain_outside_tasks(logger=None, format=None, colorize=None, **_):
    conf = current_app.conf
    for handler in getattr(logger, "handlers", []):
        if type(handler.formatter) is TaskFormatter:
            handler.setFormatter(
                TaskOrPlainFormatter(
                    format or conf.worker_task_log_format,
                    use_color=bool(colorize),
                    datefmt=conf.worker_task_log_datefmt,
                    plain=conf.worker_log_format,
                )
            )
