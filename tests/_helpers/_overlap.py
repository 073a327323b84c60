"""Two overlapping calls of a stubbed TE Linear forward impl on two threads: thread ``b``'s call
starts and returns while thread ``a``'s is still inside the impl body (the race the amax-group
and usage-flag wrappers must survive); :func:`stand_in_impls` puts the stubbed impls in place."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable


def b_runs_inside_a(body: dict, call: Callable[[str], Any], observe: Callable[[], Any]) -> Any:
    """Install ``body["fwd"]`` (the stub impl body: ``args.who`` says the thread), run ``call("a")``
    and ``call("b")`` on two threads with ``b`` entirely inside ``a``'s body, and return what
    ``observe()`` saw in ``a``'s body after ``b`` returned. Raises what either thread raised."""
    a_set, b_done = threading.Event(), threading.Event()
    seen, errors = [], []

    def fwd(args):
        if args.who == "a":
            a_set.set()
            assert b_done.wait(10)
            seen.append(observe())
        return args
    body["fwd"] = fwd

    def run(who):
        try:
            if who == "b":
                assert a_set.wait(10)
            call(who)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
        finally:
            if who == "b":
                b_done.set()
    threads = [threading.Thread(target=run, args=(w,)) for w in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert len(seen) == 1, seen
    return seen[0]


@contextlib.contextmanager
def stand_in_impls(monkeypatch, linear, forward, backward):
    """``forward`` / ``backward`` in place of TE's ``linear._linear_forward_impl`` /
    ``_linear_backward_impl``, wrapped by te_passes' real hook install (its result asserted); on
    exit the hooks come off, the monkeypatches are undone and the hooks go back on TE's real impls."""
    import _rows
    from te_passes.compat.autocast import amax_groups

    monkeypatch.setattr(linear, "_linear_forward_impl", forward)
    monkeypatch.setattr(linear, "_linear_backward_impl", backward)
    assert _rows.on(amax_groups.ROW)
    try:
        yield
    finally:
        _rows.off(amax_groups.ROW)
        monkeypatch.undo()
        _rows.on(amax_groups.ROW)
