"""Walking a Ray error back to the exception a worker raised.

Ray re-raises a remote exception as a RayTaskError (a subclass of the original type when it can),
wraps UDF errors in UserCodeException, and chains causes through `.cause`, `__cause__` and
`__context__`; an actor that died in its constructor carries only the traceback text. The
start-up checks (device, target fingerprint) and the driver's input/storage errors each look for
their own error along that chain; this is the one walk they share.
"""

from __future__ import annotations

from collections.abc import Iterator


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception it leads to through Ray's `.cause`, `__cause__` and
    `__context__`, each once (depth first)."""
    pending, seen = [exc], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        pending += [getattr(e, "cause", None), e.__cause__, e.__context__]
