"""The event loop the load-test harness runs on: uvloop when installed (as the proxy under test
does through uvicorn), so that the harness takes as little of the shared cores as it can."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
