"""The README's code runs as printed, against the real API."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[3] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_embedding_example_round_trips_a_handle_through_json(tmp_path: Path) -> None:
    (block,) = _python_blocks()
    assert "json.dumps(handle.to_dict())" in block and "from_dict" in block
    got: list[tuple[int, bytes]] = []

    def process(channel_id: int, data: memoryview) -> None:
        got.append((channel_id, bytes(data)))

    code = block.replace('"/ckpt/17/task-3"', repr(str(tmp_path / "ckpt" / "17" / "task-3")))
    namespace: dict[str, Any] = {
        "network_buffer": bytearray(b"in flight" * 100),
        "process": process,
    }
    exec(compile(code, str(README), "exec"), namespace)
    assert got == [(2, b"in flight" * 100)]
    assert namespace["saved"].startswith("{")  # what json.dumps made of the handle
