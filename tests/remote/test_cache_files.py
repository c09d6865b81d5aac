"""The shard cache's entry names: ``<quoted key>@<ident>``, and nothing else is read as an entry."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoker.remote._cache_files import entry_name, key_ident

IDENTS = st.text(alphabet="abcdef0123456789-", min_size=1, max_size=24)


@given(key=st.text(min_size=1, max_size=40), ident=IDENTS)
def test_an_entry_name_gives_back_its_key_and_ident(key: str, ident: str) -> None:
    name = entry_name(key, ident)
    assert "/" not in name and not name.startswith(".")
    assert key_ident(name) == (key, ident)


@pytest.mark.parametrize("name", ["shard-00000.stoker", "data%2Fshard.stoker", "notes.txt"])
def test_a_file_without_an_at_sign_is_not_an_entry(name: str) -> None:
    """No version of the cache writes such a file: it is a stray file (evicted first), not a key with an empty ident."""
    with pytest.raises(ValueError, match="not a cache entry"):
        key_ident(name)
