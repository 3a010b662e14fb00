"""Uploaded adapter files: the checks that refuse an upload outright (HTTP 400) and the copy into a
staging directory.

What is refused here leaves nothing behind: the caller stages into a fresh directory and removes it
when this raises. Whether the files fit a base model is the validation task's question, not this.
"""

from __future__ import annotations

import re
import stat
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol

from core.errors import InvalidRequestError
from engine.rules import ADAPTER_CONFIG_FILE as CONFIG_NAME
from engine.rules import ADAPTER_WEIGHTS_FILE as WEIGHTS_NAME
from inference.services.zip_directory import NotAZipError, zip_directory

# Loading any of these runs pickle, which executes code chosen by whoever wrote the file.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
_CHUNK = 1024 * 1024
# An adapter archive holds two files; a few more (a README, a folder) are tolerated, thousands are not.
MAX_ARCHIVE_ENTRIES = 16
# Sixteen entries' directory records (46 bytes and a name each) take a few KiB. The declared size is
# checked from the archive's end records before zipfile reads and parses the directory.
MAX_ARCHIVE_DIRECTORY_BYTES = 64 * 1024
# A LoRA's safetensors header lists a few hundred tensors (tens of KiB); it is refused, unparsed,
# beyond this.
MAX_SAFETENSORS_HEADER_BYTES = 8 * 1024 * 1024
_DRIVE = re.compile(r"^[A-Za-z]:")


class Upload(Protocol):
    """What Django's UploadedFile offers and the checks use."""

    name: str | None
    size: int | None

    def chunks(self, chunk_size: int | None = None) -> Iterable[bytes]: ...

    def seek(self, offset: int, whence: int = 0) -> int: ...

    def read(self, size: int = -1) -> bytes: ...


class AdapterUploadError(InvalidRequestError):
    code = "invalid_adapter_upload"
    default_message = "The adapter upload is invalid."


class AdapterTooLargeError(AdapterUploadError):
    code = "adapter_too_large"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: str  # safetensors' names: F32, F16, BF16, I8, ...
    shape: tuple[int, ...]


def adapter_too_large(max_bytes: int) -> AdapterTooLargeError:
    limit = f"{max_bytes / 2**20:g} MiB" if max_bytes >= 2**20 else f"{max_bytes} bytes"
    return AdapterTooLargeError(f"The adapter is larger than the limit of {limit}.", param="file")


def _refuse_pickle(name: str) -> None:
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise AdapterUploadError(
            f"`{name}` is a pickle file, which is never loaded here. Save the adapter as safetensors: "
            "PEFT's save_pretrained(...) writes adapter_model.safetensors by default.",
            param="file",
            code="pickle_refused",
        )


def _usage_hint() -> str:
    return f"Upload {CONFIG_NAME} and {WEIGHTS_NAME} (two files), or one .zip holding them."


def stage_upload(*, files: Sequence[Upload], target: Path, max_bytes: int) -> int:
    """Write the adapter's two files into `target` (an empty directory). Returns their total size."""
    if not files:
        raise AdapterUploadError(f"No file was uploaded. {_usage_hint()}", param="file")
    names = [PurePosixPath((f.name or "").replace("\\", "/")).name for f in files]
    for name in names:
        _refuse_pickle(name)
    if sum(f.size or 0 for f in files) > max_bytes:
        raise adapter_too_large(max_bytes)
    if len(files) == 1 and names[0].lower().endswith(".zip"):
        total = _extract_zip(files[0], target=target, max_bytes=max_bytes)
    else:
        if sorted(names) != sorted([CONFIG_NAME, WEIGHTS_NAME]):
            got = ", ".join(f"`{n}`" for n in names) or "none"
            raise AdapterUploadError(f"Unexpected files ({got}). {_usage_hint()}", param="file")
        budget = max_bytes
        total = 0
        for upload, name in zip(files, names, strict=True):
            written = _copy(upload.chunks(_CHUNK), target / name, budget=budget, max_bytes=max_bytes)
            budget -= written
            total += written
    read_safetensors_header(target / WEIGHTS_NAME)
    return total


def _copy(chunks: Iterable[bytes], dest: Path, *, budget: int, max_bytes: int) -> int:
    """Copy, counting bytes as they come: declared sizes (multipart, zip headers) can lie."""
    written = 0
    with dest.open("xb") as out:
        for chunk in chunks:
            written += len(chunk)
            if written > budget:
                raise adapter_too_large(max_bytes)
            out.write(chunk)
    return written


def _entry_escapes(info: zipfile.ZipInfo) -> bool:
    name = info.filename
    parts = PurePosixPath(name.replace("\\", "/")).parts
    is_link = stat.S_ISLNK(info.external_attr >> 16)
    return (
        name.startswith(("/", "\\")) or "\\" in name or bool(_DRIVE.match(name)) or ".." in parts or is_link
    )


def _check_zip_directory(upload: Upload) -> None:
    """Refuse, from the archive's end records alone, a directory too large to be parsed."""
    try:
        directory = zip_directory(upload)
    except (NotAZipError, OSError) as exc:
        raise AdapterUploadError(f"The archive is not a valid zip file ({exc}).", param="file") from exc
    if directory.entries > MAX_ARCHIVE_ENTRIES:
        raise AdapterUploadError(
            f"The archive's directory lists {directory.entries} entries; an adapter archive may hold at "
            f"most {MAX_ARCHIVE_ENTRIES}. {_usage_hint()}",
            param="file",
            code="unsafe_archive",
        )
    if directory.size > MAX_ARCHIVE_DIRECTORY_BYTES:
        raise AdapterUploadError(
            f"The archive's directory takes {directory.size} bytes; an adapter archive's may take at "
            f"most {MAX_ARCHIVE_DIRECTORY_BYTES}. {_usage_hint()}",
            param="file",
            code="unsafe_archive",
        )


def _extract_zip(upload: Upload, *, target: Path, max_bytes: int) -> int:
    _check_zip_directory(upload)
    upload.seek(0)
    try:
        archive = zipfile.ZipFile(upload)  # type: ignore[arg-type]
    except (zipfile.BadZipFile, OSError) as exc:
        raise AdapterUploadError(f"The archive is not a valid zip file ({exc}).", param="file") from exc
    with archive:
        if len(archive.infolist()) > MAX_ARCHIVE_ENTRIES:
            raise AdapterUploadError(
                f"The archive holds {len(archive.infolist())} entries; an adapter archive may hold at most "
                f"{MAX_ARCHIVE_ENTRIES}. {_usage_hint()}",
                param="file",
                code="unsafe_archive",
            )
        entries = [info for info in archive.infolist() if not info.is_dir()]
        for info in archive.infolist():
            if _entry_escapes(info):
                raise AdapterUploadError(
                    f"The archive entry `{info.filename}` points outside the archive's folder "
                    "(an absolute path, `..`, or a link); the archive is refused.",
                    param="file",
                    code="unsafe_archive",
                )
        for info in entries:
            _refuse_pickle(PurePosixPath(info.filename).name)
        wanted = {
            name: [i for i in entries if PurePosixPath(i.filename).name == name]
            for name in (CONFIG_NAME, WEIGHTS_NAME)
        }
        if any(len(found) != 1 for found in wanted.values()):
            raise AdapterUploadError(
                f"The archive must hold exactly one {CONFIG_NAME} and one {WEIGHTS_NAME}. {_usage_hint()}",
                param="file",
            )
        config, weights = wanted[CONFIG_NAME][0], wanted[WEIGHTS_NAME][0]
        if PurePosixPath(config.filename).parent != PurePosixPath(weights.filename).parent:
            raise AdapterUploadError(
                f"{CONFIG_NAME} and {WEIGHTS_NAME} must be in the same folder of the archive.", param="file"
            )
        if config.flag_bits & 0x1 or weights.flag_bits & 0x1:
            raise AdapterUploadError("Encrypted archives are not supported.", param="file")
        if config.file_size + weights.file_size > max_bytes:
            raise adapter_too_large(max_bytes)
        budget, total = max_bytes, 0
        for info, name in ((config, CONFIG_NAME), (weights, WEIGHTS_NAME)):
            with archive.open(info) as member:
                written = _copy(_read_chunks(member), target / name, budget=budget, max_bytes=max_bytes)
            budget -= written
            total += written
        return total


def _read_chunks(stream: BinaryIO) -> Iterable[bytes]:
    while chunk := stream.read(_CHUNK):
        yield chunk


def _check_safetensors_header_length(path: Path) -> None:
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            size = path.stat().st_size
    except OSError as exc:
        raise AdapterUploadError(f"{WEIGHTS_NAME} cannot be read.", param="file") from exc
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if length < 2 or length > size - 8:
        raise AdapterUploadError(
            f"{WEIGHTS_NAME} is not a valid safetensors file (its header length is wrong). Only "
            "safetensors weights are accepted.",
            param="file",
            code="invalid_safetensors",
        )
    if length > MAX_SAFETENSORS_HEADER_BYTES:
        raise AdapterUploadError(
            f"{WEIGHTS_NAME} declares a header of {length} bytes; at most {MAX_SAFETENSORS_HEADER_BYTES} "
            "are accepted.",
            param="file",
            code="invalid_safetensors",
        )


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes and shapes from a safetensors header, without loading any tensor.

    The safetensors library checks that the header is well-formed and that every tensor's byte
    range lies inside the file; anything else (a pickle under the wrong name) is refused. The
    header's declared length is checked first, so an oversized header is never parsed."""
    from safetensors import safe_open

    _check_safetensors_header_length(path)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            return {
                name: TensorInfo(
                    dtype=handle.get_slice(name).get_dtype(), shape=tuple(handle.get_slice(name).get_shape())
                )
                for name in handle.keys()  # noqa: SIM118 - safe_open is not a mapping
            }
    except Exception as exc:  # the library raises its own error types, and OSError, for bad files
        raise AdapterUploadError(
            f"{WEIGHTS_NAME} is not a valid safetensors file ({exc}). Only safetensors weights are accepted.",
            param="file",
            code="invalid_safetensors",
        ) from exc
