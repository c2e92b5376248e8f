"""A URI's filesystem is opened once per scheme, authority and query: a task thread
opening file after file on ``s3://`` must not ask S3 for the bucket's region each
time. The cached answer must be the one pyarrow itself gives."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import StorageError
from spillover.storage.location import Location

QUERY = "region=eu-west-1&endpoint_override=127.0.0.1:9&scheme=http"
segment = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12
).filter(lambda s: s not in (".", ".."))


def test_every_file_of_one_bucket_shares_one_filesystem() -> None:
    a = Location.parse(f"s3://spill-bucket/chk-1/a.spill?{QUERY}")
    b = Location.parse(f"s3://spill-bucket/chk-2/op/b.spill?{QUERY}")
    assert a.filesystem is b.filesystem
    assert (a.path, b.path) == ("spill-bucket/chk-1/a.spill", "spill-bucket/chk-2/op/b.spill")
    assert a.uri == f"s3://spill-bucket/chk-1/a.spill?{QUERY}"


def test_another_bucket_or_query_opens_its_own_filesystem() -> None:
    a = Location.parse(f"s3://spill-bucket/x?{QUERY}")
    other_query = Location.parse(
        "s3://spill-bucket/x?region=us-east-1&endpoint_override=127.0.0.1:9&scheme=http"
    )
    other_bucket = Location.parse(f"s3://other-bucket/x?{QUERY}")
    assert other_query.filesystem is not a.filesystem
    assert other_bucket.path == "other-bucket/x"
    assert other_bucket.filesystem is not a.filesystem


@given(st.lists(segment, min_size=1, max_size=4))
def test_a_cached_filesystem_gives_the_path_pyarrow_gives(parts: list[str]) -> None:
    uri = f"s3://spill-bucket/{'/'.join(parts)}?{QUERY}"
    Location.parse(f"s3://spill-bucket/warm?{QUERY}")  # the filesystem is cached now
    _, expected = pafs.FileSystem.from_uri(uri)
    assert Location.parse(uri).path == expected.rstrip("/")


@settings(max_examples=25)  # pyarrow opens a filesystem for every one of them
@given(st.lists(st.sampled_from(["a", "b-1", "%20", "%2F", "x%41y", " ", "#f", "+"]), min_size=1))
def test_a_uri_pyarrow_decodes_or_refuses_is_not_served_from_the_cache(parts: list[str]) -> None:
    """With the bucket's filesystem cached, a URI with an escape (``%20``) still names
    the path pyarrow decodes it to, and one pyarrow refuses is still refused."""
    Location.parse(f"s3://spill-bucket/warm?{QUERY}")
    uri = f"s3://spill-bucket/{''.join(parts)}?{QUERY}"
    try:
        _, expected = pafs.FileSystem.from_uri(uri)
    except (OSError, ValueError):
        with pytest.raises(StorageError):
            Location.parse(uri)
        return
    assert Location.parse(uri).path == expected.rstrip("/")
