"""Records in network buffers: framing, serializers, keys and the key-group filter.

Every record is a 4-byte little-endian length (0 .. 2**31 - 1) followed by
that many bytes of serialized payload. Buffers of one channel are a stream of
such records; a record (its length prefix included) may be cut anywhere by a
buffer boundary and continue in the channel's next buffer. See
``docs/records-and-keygroups.md`` for the byte layout.

All loops over records run natively with the GIL released; Python code here
touches buffers, never records, except in the documented slow paths
(:class:`SelectorKey`, :class:`PickleSerializer`, per-record convenience
methods such as :meth:`RecordBatch.to_list`).
"""

from __future__ import annotations

from spillover.records.demux import (
    KeyGroupDemux,
    PartitionerDemux,
    partitioner_name,
    partitions_of,
)
from spillover.records.framing import (
    DEFAULT_BUFFER_SIZE,
    MAX_RECORD_SIZE,
    Buffer,
    FrameJoiner,
    RecordBatch,
    RecordReader,
    RecordWriter,
    read_records,
    write_records,
)
from spillover.records.keys import (
    FieldKey,
    Key,
    SelectorKey,
    key_groups_of,
)
from spillover.records.serializers import (
    BytesSerializer,
    FixedWidthSerializer,
    PickleSerializer,
    Serializer,
)

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "MAX_RECORD_SIZE",
    "Buffer",
    "BytesSerializer",
    "FieldKey",
    "FixedWidthSerializer",
    "FrameJoiner",
    "Key",
    "KeyGroupDemux",
    "PartitionerDemux",
    "PickleSerializer",
    "RecordBatch",
    "RecordReader",
    "RecordWriter",
    "SelectorKey",
    "Serializer",
    "key_groups_of",
    "partitioner_name",
    "partitions_of",
    "read_records",
    "write_records",
]
