"""Redis users with a password each (compose and Kubernetes: the registry's, the KV store's):
``{user}`` in ``SPLITSERVE_REDIS_PASSWORD_FILE`` picks the file of the URL's user, and a URL
that names no user (or one that could name another path) is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.store_urls import PASSWORD_FILE_ENV, with_password_file


def test_each_user_takes_the_password_in_its_own_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "redis_registry_password").write_text("registry-pw\n")
    (tmp_path / "redis_kv_password").write_text("kv/pw\n")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(tmp_path / "redis_{user}_password"))
    assert with_password_file("redis://registry@redis:6379") == "redis://registry:registry-pw@redis:6379"
    assert with_password_file("rediss://kv@redis:6380/0") == "rediss://kv:kv%2Fpw@redis:6380/0"
    assert with_password_file("redis://kv:inline@redis:6379") == "redis://kv:inline@redis:6379"  # the URL's own wins
    with pytest.raises(ValueError, match="cannot read the Redis password"):
        with_password_file("redis://lmcache@redis:6379")  # no file for that user: this process may not hold it
    for url in ("redis://redis:6379", "redis://..%2F..%2Fetc@redis:6379"):
        with pytest.raises(ValueError, match="names no user"):
            with_password_file(url)
