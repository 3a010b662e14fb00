"""An adapter zip is measured from its end records before zipfile parses its central directory: an
archive whose directory lists too many entries, or takes too many bytes, is refused unparsed (a
directory of millions of entries costs gigabytes and a minute of CPU to parse)."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from core.errors import InvalidRequestError
from inference.models import LoraAdapter
from inference.services import adapter_files
from inference.services.adapters import adapter_upload
from inference.services.zip_directory import ZipDirectory, zip_directory
from tests.inference.peft_adapters import files_on_disk, zip_bytes

pytestmark = pytest.mark.django_db(transaction=True)

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
EOCD = struct.Struct("<4s4H2LH")
LOCATOR = struct.Struct("<4sLQL")
EOCD64 = struct.Struct("<4sQ2H2L4Q")


def as_zip64(archive: bytes, *, entries: int | None = None, size: int | None = None) -> bytes:
    """The archive with zip64 end records (what writers emit past 65535 entries or 4 GiB), the zip64
    record declaring `entries` and `size` where given, its own figures otherwise."""
    at = len(archive) - EOCD.size
    _, _, _, _, count, cd_size, cd_offset, _ = EOCD.unpack(archive[at:])
    entries, size = count if entries is None else entries, cd_size if size is None else size
    zip64 = EOCD64.pack(b"PK\x06\x06", EOCD64.size - 12, 45, 45, 0, 0, entries, entries, size, cd_offset)
    locator = LOCATOR.pack(b"PK\x06\x07", 0, at, 1)
    end = EOCD.pack(b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return archive[:at] + zip64 + locator + end


def _good_entries(adapters_dir) -> dict[str, bytes]:
    return {n: (adapters_dir["good"] / n).read_bytes() for n in (CONFIG, WEIGHTS)}


def _refusal(world, data: bytes) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as refused:
        adapter_upload(
            tenant=world.tenant_a,
            name="tone",
            base_model=world.model,
            files=[SimpleUploadedFile("a.zip", data)],
        )
    return refused.value


def test_the_end_records_say_what_zipfile_will_parse(adapters_dir):
    archive = zip_bytes({**_good_entries(adapters_dir), "README.md": b"hello"})
    listed = zipfile.ZipFile(io.BytesIO(archive)).infolist()

    plain = zip_directory(io.BytesIO(archive))
    zip64 = zip_directory(io.BytesIO(as_zip64(archive)))

    assert plain.entries == zip64.entries == len(listed) == 3
    assert (
        plain.size == zip64.size == sum(46 + len(i.filename) + len(i.extra) + len(i.comment) for i in listed)
    )
    # The zip64 form is one zipfile reads as the same archive.
    assert [i.filename for i in zipfile.ZipFile(io.BytesIO(as_zip64(archive))).infolist()] == [
        i.filename for i in listed
    ]
    # A comment after the end record is passed over, as zipfile does.
    commented = io.BytesIO()
    with zipfile.ZipFile(commented, "w") as writer:
        writer.comment = b"an archive comment " * 1000
        writer.writestr("a", b"x")
    assert zip_directory(io.BytesIO(commented.getvalue())) == ZipDirectory(entries=1, size=47)


def test_a_zip64_directory_of_millions_of_entries_is_refused_unread(world, adapters_dir, media_root):
    archive = as_zip64(zip_bytes(_good_entries(adapters_dir)), entries=5_000_000, size=5_000_000 * 80)

    refused = _refusal(world, archive)

    assert refused.code == "unsafe_archive" and refused.param == "file"
    assert "directory lists 5000000 entries" in refused.message and "at most 16" in refused.message
    assert files_on_disk(media_root) == [] and not LoraAdapter.objects.exists()


def test_an_archive_of_thousands_of_entries_is_refused_from_its_end_record(world, adapters_dir, media_root):
    entries = {f"j/{i}": b"" for i in range(3000)}
    entries.update(_good_entries(adapters_dir))

    refused = _refusal(world, zip_bytes(entries))

    assert refused.code == "unsafe_archive"
    assert "directory lists 3002 entries" in refused.message
    assert files_on_disk(media_root) == [] and not LoraAdapter.objects.exists()


def test_a_few_entries_with_a_huge_directory_are_refused(world, adapters_dir, media_root):
    # Three entries, within the count, whose directory records carry 60 KiB comments each.
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as writer:
        for name, data in {**_good_entries(adapters_dir), "README.md": b"hi"}.items():
            info = zipfile.ZipInfo(name)
            info.comment = b"c" * 60_000
            writer.writestr(info, data)

    refused = _refusal(world, buffer.getvalue())

    assert refused.code == "unsafe_archive"
    assert f"at most {adapter_files.MAX_ARCHIVE_DIRECTORY_BYTES}" in refused.message
    assert files_on_disk(media_root) == [] and not LoraAdapter.objects.exists()
