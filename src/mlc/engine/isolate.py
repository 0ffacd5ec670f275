"""After a batch failed: run its items one at a time, so that only the requests whose items fail alone are dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def one_by_one(request_ids: list[str], run_one: Callable[[int], T]) -> tuple[dict[int, T], dict[str, Exception]]:
    """`run_one(i)` for each item (whose request is `request_ids[i]`): the results by index, and the first error of
    each request with an item that failed. When every item fails, that error is raised: nothing is left to run."""
    done: dict[int, T] = {}
    failed: dict[str, Exception] = {}
    for i, rid in enumerate(request_ids):
        try:
            done[i] = run_one(i)
        except Exception as e:
            failed.setdefault(rid, e)
    if not done:
        raise next(iter(failed.values()))
    return done, failed
