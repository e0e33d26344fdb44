"""Fresh topic names, for tests and benchmarks that share a broker with earlier runs.

A test that reuses a topic reads what an earlier test (or an earlier run against the same
``KAFKA_BOOTSTRAP``) left there. The helper lives here rather than in ``tests/conftest.py``
because ``from conftest import ...`` breaks as soon as a test subdirectory has its own conftest.
"""

from __future__ import annotations

import uuid


def unique_topic(purpose: str = "test") -> str:
    """``<purpose>-<12 hex digits>``: a name no other test or run has used."""
    return f"{purpose}-{uuid.uuid4().hex[:12]}"
