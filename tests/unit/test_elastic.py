"""trec_pipelines.elastic.attempt_store: torchrun's store under a prefix naming the attempt."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from trec_pipelines.elastic import attempt_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_each_attempt_writes_under_its_own_prefix(monkeypatch: Any) -> None:
    # One rank, no agent: rank 0 hosts the store, as env:// would.
    port = _free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    store = attempt_store(timedelta(seconds=30))
    store.set("key", "third")
    # What another client of the same server sees: the key under attempt 3's prefix only.
    raw = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=30))
    assert raw.get("attempt_3/key") == b"third"
    assert raw.check(["attempt_3/key"]) and not raw.check(["key"])
    # The next attempt, on the same server, does not see the last one's key.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # now a client, as under torchrun
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    again = attempt_store(timedelta(seconds=30))
    assert not again.check(["key"])
    again.set("key", "fourth")
    assert raw.get("attempt_4/key") == b"fourth" and store.get("key") == b"third"


def test_outside_torchrun_it_says_what_is_missing(monkeypatch: Any) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT, WORLD_SIZE not set: launch"):
        attempt_store()
