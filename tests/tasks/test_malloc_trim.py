"""The worker gives malloc's free pages back after every task (tasks/malloc_trim.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
from celery import signals

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


def test_the_worker_app_trims_malloc_after_every_task():
    """Connected by tasks/app.py itself, so every worker and every pool child has it; held
    strongly (a weak receiver of a module function would do, but is one gc away from
    silence if the module is ever reloaded)."""
    import tasks.app  # noqa: F401
    from tasks import malloc_trim

    receivers = [receiver for _, receiver in signals.task_postrun.receivers]
    assert malloc_trim._after_task in receivers


@glibc_only
def test_release_freed_memory_calls_malloc_trim_on_glibc():
    from tasks.malloc_trim import release_freed_memory

    assert release_freed_memory() is True


def test_without_malloc_trim_the_hook_does_nothing(monkeypatch):
    from tasks import malloc_trim

    monkeypatch.setattr(malloc_trim, "_malloc_trim", None)
    assert malloc_trim.release_freed_memory() is False
    malloc_trim._after_task(task=None, state="SUCCESS")  # no error: tasks end as before


@glibc_only
def test_memory_a_thread_freed_can_be_reused_after_a_trim():
    """Harmless: blocks freed in a thread's arena, trimmed, then allocated and written
    again, hold what was written (the trim only gives back pages of free blocks)."""
    probe = """
import threading
from tasks.malloc_trim import release_freed_memory
def work():
    held = [bytearray(b"x" * 200_000) for _ in range(64)]
    del held[::2]
    assert release_freed_memory()
    again = [bytearray(b"y" * 200_000) for _ in range(32)]
    assert all(b == bytearray(b"x" * 200_000) for b in held)
    assert all(b == bytearray(b"y" * 200_000) for b in again)
t = threading.Thread(target=work)
t.start()
t.join()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_readers_gather_gives_freed_memory_back_without_celery():
    """A gather trims once the manifest is parsed (read_manifest, tasks/context.py: what
    its read freed stayed resident under the engine's buffers); a reader's own gather
    imports it without Celery, so the trim does not bring Celery in."""
    probe = """
import sys
import tasks.context
import tasks.gathering
from tasks.malloc_trim import release_freed_memory
assert tasks.gathering.read_manifest is tasks.context.read_manifest
assert tasks.context.release_freed_memory is release_freed_memory
print("celery" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
