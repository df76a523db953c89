"""Blocking mlx work on an OS thread of its own, never one of Trio's cached worker threads.

mlx keeps per-thread streams, which a thread that ran mlx work releases before it ends
(``models.loader.release_thread_streams``: streams that outlive their thread can abort the
process at exit). Trio hands a finished worker thread to the next ``to_thread.run_sync`` call,
and a thread whose streams were released cannot run mlx again ("There is no Stream(cpu, N) in
current thread"). A model that can be unloaded and loaded again (router mode) therefore runs
each time on a thread made for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import trio


async def run_on_own_thread(
    main: Callable[[trio.lowlevel.TrioToken], None],
    *,
    name: str,
    on_cancel: Callable[[], None],
) -> None:
    """Run ``main(token)`` on a new thread and wait for it to end; what it raises is raised
    here. ``main`` reaches Trio with ``trio.from_thread.*(..., trio_token=token)``.

    Cancellation calls ``on_cancel`` (which must make the thread's next wait on Trio return,
    e.g. by closing the channel it receives from), then waits, shielded, for the thread to
    end: mlx work in progress cannot be interrupted, and the model's memory is released only
    once the thread is done with it.
    """
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    failure: list[BaseException] = []

    def body() -> None:
        try:
            main(token)
        except BaseException as exc:  # handed to the Trio side, raised there
            failure.append(exc)
        finally:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

    threading.Thread(target=body, name=name, daemon=True).start()
    try:
        await done.wait()
    except trio.Cancelled:
        on_cancel()
        with trio.CancelScope(shield=True):
            await done.wait()
        raise
    if failure:
        raise failure[0]
