"""A Ctrl-C the interpreter swallows still stops a wait (the CI flake of the Ctrl-C test:
the one SIGINT landed inside an import lock's callback, was printed as "Exception ignored"
and lost, and the CLI waited on)."""

from __future__ import annotations

import gc
import os
import signal
import weakref

import pytest

from tasks.requests import _pause, ctrl_c_stops_waiting


class _Thing:
    pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # it, on purpose
def test_a_swallowed_ctrl_c_stops_the_next_pause() -> None:
    swallowed: list[str] = []

    def interrupt_inside_a_callback(_ref) -> None:
        # The interpreter ignores what a weakref callback raises, as it does in the
        # import lock's callback where the real one landed.
        os.kill(os.getpid(), signal.SIGINT)
        swallowed.append("sent")

    with ctrl_c_stops_waiting():
        thing = _Thing()
        ref = weakref.ref(thing, interrupt_inside_a_callback)
        del thing
        gc.collect()
        assert ref() is None and swallowed == []  # the handler raised inside the callback
        with pytest.raises(KeyboardInterrupt):
            _pause()
    _pause()  # outside it, nothing is noted: a plain pause


def test_ctrl_c_outside_the_wait_is_what_it_was_again() -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a job started with `&`
    with ctrl_c_stops_waiting():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before
