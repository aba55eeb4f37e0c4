"""Shared fixtures: every test leaves torch as it found it (default dtype, process groups)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_state():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Profiles timed in a test never land in (or come from) the user's cache."""
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path / "cache"))
