"""`.safetensors` reader: 8-byte little-endian header length, JSON header, raw little-endian data.

Files saved by MindSpore with `crc_check=True` carry `__metadata__.crc_num`:
the zlib CRC-32 chained over (name as UTF-8, then its bytes) for every tensor
in sorted-name order. When present it is verified after the last tensor.
"""
import json
import zlib

from .. import dtypes
from ..errors import DuplicateKey, unique_keys
from .checks import name_problem, shape_problem, shown
from .source import CheckpointReader, buffer

HEADER_LIMIT = 100 << 20   # the safetensors format's own cap on the JSON header


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


class SafetensorsCheckpoint(CheckpointReader):
    """Iterator of (name, shape, numpy dtype, memoryview) over a .safetensors file.

    The header is validated entirely on open (StagingError naming the file,
    the tensor and the field); `tensors` and `nbytes` give the totals.
    """

    @property
    def nbytes(self):
        return sum(end - start for _, _, _, start, end in self._entries)

    @property
    def names(self):
        return [name for name, *_ in self._entries]

    @property
    def shapes(self):
        """{name: shape} of every tensor, from the structure (no data read)."""
        return {name: shape for name, shape, *_ in self._entries}

    def _read_structure(self):
        self._entries, self._expected_crc = self._scan()

    def _scan(self):
        src = self._file
        if len(src) < 8:
            self._fail(f"{len(src)} bytes is too short for a safetensors header")
        n = int.from_bytes(src[:8], "little")
        if n > len(src) - 8 or n > HEADER_LIMIT:
            self._fail(f"header length {n} runs past the end of the file ({len(src)} bytes)")
        header = self._parse_header(src[8:8 + n])
        if not isinstance(header, dict):
            self._fail(f"header is a JSON {type(header).__name__}, not an object")
        base, size = 8 + n, len(src)
        meta = header.get("__metadata__", {})
        if not isinstance(meta, dict):
            self._fail(f"__metadata__ is a JSON {type(meta).__name__}, not an object")
        entries = [self._entry(name, spec, base, size) for name, spec in header.items()
                   if name != "__metadata__"]
        if not entries:
            self._fail("holds no tensors")
        self._refuse_overlaps(entries, base)
        crc = meta.get("crc_num")
        if crc is not None:
            # MindSpore writes it as a decimal string (metadata values are strings); a
            # JSON integer is taken too. Not a bool, a float, Infinity or out of range.
            if isinstance(crc, str) and crc.isascii() and crc.isdigit():
                crc = int(crc)
            if not _int(crc) or not 0 <= crc < 1 << 32:
                self._fail(f"__metadata__.crc_num {shown(crc)} is not a CRC-32 (an integer in [0, 2**32))")
            entries.sort(key=lambda e: e[0])    # the order the CRC was chained in
        else:
            entries.sort(key=lambda e: e[3])    # file order: sequential reads
        return entries, crc

    def _parse_header(self, raw):
        """The header's JSON, in time linear in its size; StagingError for anything but UTF-8 JSON
        without duplicate keys (json.loads would keep the last of two entries of one tensor)."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._fail(f"header is not UTF-8 (byte {8 + e.start} is {raw[e.start]:#04x})")
        try:
            return json.loads(text, object_pairs_hook=unique_keys)
        except DuplicateKey as e:
            self._fail(f"header names {shown(e.key)} twice")
        except RecursionError:
            self._fail("header nests too deeply to be a safetensors header")
        except ValueError as e:                 # JSONDecodeError, and ints of over 4300 digits
            self._fail(f"header is not JSON: {e}")

    def _entry(self, name, spec, base, size):
        """(name, shape, dtype, start, end) of one header entry, every field checked."""
        problem = name_problem(name)
        if problem:
            self._fail(f"tensor {shown(name)}: {problem}")
        where = f"tensor {shown(name)}"
        if not isinstance(spec, dict):
            self._fail(f"{where}: header entry is not an object")
        code = spec.get("dtype")
        dtype = dtypes.SAFETENSORS.get(code) if isinstance(code, str) else None
        if dtype is None:
            self._fail(f"{where}: dtype {shown(code)} has no numpy equivalent; "
                       f"prefetchd stages {', '.join(dtypes.SAFETENSORS)}")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(_int(d) for d in shape):
            self._fail(f"{where}: shape {shown(shape)} is not a list of integers")
        for i, d in enumerate(shape):
            if d < 0:
                self._fail(f"{where}: shape[{i}] is {d} (negative)")
        problem = shape_problem(shape, dtypes.itemsize(dtype))
        if problem:
            self._fail(f"{where}: {problem}")
        offsets = spec.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(o) for o in offsets)):
            self._fail(f"{where}: data_offsets {shown(offsets)} is not a pair of integers")
        start, end = offsets
        if start < 0 or end < start:
            self._fail(f"{where}: data_offsets {offsets} is not a range (negative or reversed)")
        if base + end > size:
            self._fail(f"{where}: data_offsets {offsets} run past the end of the file "
                       f"({size - base} data bytes; truncated?)")
        need = dtypes.nbytes(shape, dtype)
        if end - start != need:
            self._fail(f"{where}: data_offsets {offsets} span {end - start} bytes, "
                       f"shape {shape} of {dtype} needs {need}")
        return name, tuple(shape), dtype, base + start, base + end

    def _refuse_overlaps(self, entries, base):
        """Two tensors sharing bytes would be staged twice from one range (a 16-byte file
        could claim gigabytes of store): refused, naming both."""
        ranges = sorted((e for e in entries if e[4] > e[3]), key=lambda e: e[3])
        for prev, e in zip(ranges, ranges[1:]):
            if e[3] < prev[4]:
                self._fail(f"tensor {shown(e[0])}: data_offsets {[e[3] - base, e[4] - base]} overlap those "
                           f"of tensor {shown(prev[0])}, {[prev[3] - base, prev[4] - base]}")

    def _stream(self):
        crc = 0
        for name, shape, dtype, start, end in self._entries:
            data = buffer(end - start)
            self._file.read_into(data, start)
            if self._expected_crc is not None:
                crc = zlib.crc32(data, zlib.crc32(name.encode(), crc))
            yield name, shape, dtypes.numpy_dtype(dtype), data
        if self._expected_crc is not None and crc != self._expected_crc:
            self._fail(f"__metadata__.crc_num is {self._expected_crc}, the tensors' CRC-32 is {crc}: "
                       f"the file is damaged")
