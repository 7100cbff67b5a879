"""A stop signal is heard wherever in its wait the main thread is (smoltorrent/signal_event.py).

A threading.Event set from a signal handler deadlocks when the signal lands while the main
thread holds the Event's lock, inside wait() or clear(): a few bytecodes of each cycle, so
`smoltorrent up` stayed up after a Ctrl-C once in CI. Here the signal is sent at each
bytecode in turn of the waiting machinery, by a trace function, so every interleaving is
tried rather than waited for by chance.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from smoltorrent.signal_event import SignalEvent

# For each waiter, run in a child process (a deadlock must not hang the test): `make()`
# gives what waits, its signal handler and the events it waits on; `wait(what)` waits
# until the signal stops it.
WAITERS = {
    "up": """
        from coordinator.local.stack import Stack
        defaults.UP_POLL_S = 0.0005
        def make():
            stack = Stack(say=lambda _: None)
            return stack, stack.request_stop, [stack._stop]
        def wait(stack):
            assert stack.wait() == 0
    """,
    "watch": """
        import tempfile
        from coordinator.watcher import Watcher
        def make():
            watcher = Watcher(tempfile.mkdtemp(), lambda *_: None, recheck_s=0.0005)
            return watcher, lambda *_: watcher.stop(), [watcher._wake, watcher._stop]
        def wait(watcher):
            watcher.run()
    """,
    "cli": """
        from tasks import requests
        defaults.CLI_POLL_INTERVAL_S = 0.0005
        def make():
            return None, None, [requests._CTRL_C]  # ctrl_c_stops_waiting has its handler
        def wait(_):
            try:
                with requests.ctrl_c_stops_waiting():
                    while True:
                        requests._pause()
            except KeyboardInterrupt:
                return
            raise AssertionError("no KeyboardInterrupt")
    """,
}

DRIVER = """
import faulthandler, os, signal, sys
from smoltorrent import defaults
{waiter}
faulthandler.dump_traceback_later(20, exit=True)  # a deadlock: its stack, and exit 1
# Only the bytecodes of the waiter's events are counted (a threading.Event's and its
# Condition's, or a SignalEvent's): that is where their locks are held.
count = target = 0
def tracer(frame, event, arg):
    global count
    frame.f_trace_opcodes = True
    if event == "opcode" and frame.f_code.co_filename.endswith(("threading.py", "signal_event.py")):
        if id(frame.f_locals.get("self")) in watched:
            count += 1
            if count == target:
                os.kill(os.getpid(), signal.SIGINT)
    return tracer
for target in range(1, {bytecodes}):
    count = 0
    what, handler, events = make()
    watched = {{id(e) for e in events}} | {{id(getattr(e, "_cond", None)) for e in events}}
    if handler is not None:
        signal.signal(signal.SIGINT, handler)
    sys.settrace(tracer)
    try:
        wait(what)
    finally:
        sys.settrace(None)
print("stopped", target)
"""


@pytest.mark.parametrize("waiter", sorted(WAITERS))
def test_a_stop_signal_at_any_bytecode_of_the_wait_stops_it(waiter: str, tmp_path: Path):
    script = DRIVER.format(waiter=textwrap.dedent(WAITERS[waiter]), bytecodes=160)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0 and "stopped 159" in done.stdout, done.stdout + done.stderr


def test_a_set_before_the_wait_or_from_another_thread_is_not_lost():
    event = SignalEvent()
    assert not event.is_set() and not event.wait(0.01)
    event.set()
    assert event.is_set() and event.wait(0) and event.wait(None)
    event.clear()
    assert not event.is_set() and not event.wait(0.01)
    setter = threading.Timer(0.05, event.set)
    setter.start()
    assert event.wait(30)  # woken well before the timeout
    setter.join()
    for _ in range(100_000):  # more than a pipe holds: set() never blocks
        event.set()
    event.clear()
    assert not event.wait(0)
