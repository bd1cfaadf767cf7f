"""The tokenizer as the worker protocol's GetTokenizer streams it: a zip, in chunks.

A gateway that cannot read the directory GetModelInfo names (another host, another pod)
asks the worker for the files instead. SMG's contract (smg-grpc-proto 0.4.28, smg 1.13):
the stream's ``data`` concatenated is one zip archive with the files at its root, which
the gateway extracts and loads as a Hugging Face tokenizer directory; the last chunk
carries ``sha256``, the lowercase hex digest of the whole zip, and earlier ones none.

The archive holds exactly the files ``headrace export-tokenizer`` writes
(services/worker/tokenizer_export.py), byte for byte, with fixed timestamps and
permissions so the same tokenizer always gives the same zip and digest.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

CHUNK_BYTES = 1024 * 1024  # below every gateway's default message limit (4 MiB)
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can carry


@dataclass(frozen=True)
class TokenizerBundle:
    data: bytes  # the zip archive
    sha256: str  # lowercase hex digest of ``data``

    @classmethod
    def of(cls, files: Mapping[str, str]) -> TokenizerBundle:
        data = zip_files(files)
        return cls(data, hashlib.sha256(data).hexdigest())

    def chunks(self, size: int = CHUNK_BYTES) -> Iterator[tuple[bytes, str]]:
        """(data, sha256) per message: the digest on the last one only."""
        starts = range(0, len(self.data), size)
        for start in starts:
            last = start == starts[-1]
            yield self.data[start : start + size], self.sha256 if last else ""


def zip_files(files: Mapping[str, str]) -> bytes:
    """A deterministic zip of ``files`` (name -> UTF-8 text), names sorted."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(files):
            entry = zipfile.ZipInfo(name, date_time=_EPOCH)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = 0o644 << 16  # a regular file, rw-r--r--
            archive.writestr(entry, files[name].encode("utf-8"))
    return buffer.getvalue()
