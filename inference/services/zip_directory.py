"""What a zip archive's end records say about its central directory, read before the archive is
parsed: zipfile.ZipFile reads and parses the whole central directory when it opens an archive, so a
directory of millions of entries costs gigabytes and a minute of CPU before any count can be
checked. This reads only the end records (at most 64 KiB and a few bytes from the end of the file),
the way zipfile finds them, and reports the largest entry count and directory size any of them
declares, so that the caller can refuse the archive unparsed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

_EOCD = struct.Struct(
    "<4s4H2LH"
)  # signature, disk, directory's disk, entries here, entries, size, offset, comment
_EOCD_SIGNATURE = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sLQL")  # signature, directory's disk, offset of the zip64 record, disks
_LOCATOR_SIGNATURE = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # signature, size, versions, disks, entries here, entries, size, offset
_EOCD64_SIGNATURE = b"PK\x06\x06"
_MAX_COMMENT = 0xFFFF


class Seekable(Protocol):
    def seek(self, offset: int, whence: int = 0) -> int: ...

    def read(self, size: int = -1) -> bytes: ...


class NotAZipError(ValueError):
    """No end of central directory record where a zip archive has one."""


@dataclass(frozen=True, slots=True)
class ZipDirectory:
    entries: int  # the most entries any end record declares
    size: int  # the largest central directory (bytes) any end record declares


def _read_at(handle: Seekable, offset: int, size: int) -> bytes:
    handle.seek(offset)
    return handle.read(size)


def zip_directory(handle: Seekable) -> ZipDirectory:
    """The central directory an archive's end records declare (the zip64 ones too). Where records
    disagree, the largest figures are reported: a reader may believe either."""
    file_size = handle.seek(0, 2)
    tail_size = min(file_size, _EOCD.size + _MAX_COMMENT)
    tail_start = file_size - tail_size
    tail = _read_at(handle, tail_start, tail_size)
    # Found as zipfile finds it: a record without a comment at the very end, else the last signature.
    if tail[-_EOCD.size : -_EOCD.size + 4] == _EOCD_SIGNATURE and tail[-2:] == b"\0\0":
        start = tail_size - _EOCD.size
    else:
        start = tail.rfind(_EOCD_SIGNATURE)
    if start < 0 or start + _EOCD.size > tail_size:
        raise NotAZipError("it has no end of central directory record")
    _, _, _, entries_here, entries, size, _, _ = _EOCD.unpack_from(tail, start)
    counts, sizes = [entries_here, entries], [size]
    zip64 = _zip64_records(handle, eocd_at=tail_start + start, file_size=file_size)
    if zip64:
        # 0xFFFF and 0xFFFFFFFF in the classic record say "see the zip64 record".
        counts = [c for c in counts if c != 0xFFFF]
        sizes = [s for s in sizes if s != 0xFFFFFFFF]
        for fields in zip64:
            counts += fields[6:8]
            sizes.append(fields[8])
    return ZipDirectory(entries=max(counts), size=max(sizes))


def _zip64_records(handle: Seekable, *, eocd_at: int, file_size: int) -> list[tuple]:
    if eocd_at < _LOCATOR.size:
        return []
    signature, _, zip64_at, _ = _LOCATOR.unpack(_read_at(handle, eocd_at - _LOCATOR.size, _LOCATOR.size))
    if signature != _LOCATOR_SIGNATURE:
        return []
    records = []
    # zipfile reads the zip64 record just before the locator; the locator names an offset.
    for at in sorted({eocd_at - _LOCATOR.size - _EOCD64.size, zip64_at}):
        if 0 <= at <= file_size - _EOCD64.size:
            record = _read_at(handle, at, _EOCD64.size)
            if record[:4] == _EOCD64_SIGNATURE:
                records.append(_EOCD64.unpack(record))
    return records
