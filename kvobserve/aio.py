"""Small asyncio helpers every layer uses."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel the tasks (None: skipped) and wait until each has ended; their errors are dropped."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    await asyncio.gather(*live, return_exceptions=True)
