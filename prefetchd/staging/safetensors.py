"""`.safetensors` reader: 8-byte little-endian header length, JSON header, raw little-endian data.

Files saved by MindSpore with `crc_check=True` carry `__metadata__.crc_num`:
the zlib CRC-32 chained over (name as UTF-8, then its bytes) for every tensor
in sorted-name order. When present it is verified after the last tensor.
"""
import json
import zlib

from .. import dtypes
from .mapped import MappedCheckpoint, close_quietly, forget

HEADER_LIMIT = 100 << 20   # the safetensors format's own cap on the JSON header


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


class SafetensorsCheckpoint(MappedCheckpoint):
    """Iterator of (name, shape, numpy dtype, memoryview) over a .safetensors file.

    The header is validated entirely on open (StagingError naming the file,
    the tensor and the field); `tensors` and `nbytes` give the totals.
    """

    @property
    def nbytes(self):
        return sum(end - start for _, _, _, start, end in self._entries)

    def _read_structure(self):
        self._entries, self._expected_crc = self._scan()

    def _scan(self):
        mm = self._mm
        if len(mm) < 8:
            self._fail(f"{len(mm)} bytes is too short for a safetensors header")
        n = int.from_bytes(mm[:8], "little")
        if n > len(mm) - 8 or n > HEADER_LIMIT:
            self._fail(f"header length {n} runs past the end of the file ({len(mm)} bytes)")
        try:
            header = json.loads(bytes(mm[8:8 + n]))
        except (ValueError, UnicodeDecodeError) as e:
            self._fail(f"header is not JSON: {e}")
        if not isinstance(header, dict):
            self._fail(f"header is a JSON {type(header).__name__}, not an object")
        base, size = 8 + n, len(mm)
        meta = header.get("__metadata__") or {}
        entries = []
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            where = f"tensor {name!r}"
            if not isinstance(spec, dict):
                self._fail(f"{where}: header entry is not an object")
            dtype = dtypes.SAFETENSORS.get(spec.get("dtype"))
            if dtype is None:
                self._fail(f"{where}: dtype {spec.get('dtype')!r} has no numpy equivalent; "
                           f"prefetchd stages {', '.join(dtypes.SAFETENSORS)}")
            shape = spec.get("shape")
            if not isinstance(shape, list) or not all(_int(d) for d in shape):
                self._fail(f"{where}: shape {shape!r} is not a list of integers")
            for i, d in enumerate(shape):
                if d < 0:
                    self._fail(f"{where}: shape[{i}] is {d} (negative)")
            offsets = spec.get("data_offsets")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(o) for o in offsets)):
                self._fail(f"{where}: data_offsets {offsets!r} is not a pair of integers")
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
            entries.append((name, tuple(shape), dtype, base + start, base + end))
        if not entries:
            self._fail("holds no tensors")
        crc = meta.get("crc_num") if isinstance(meta, dict) else None
        if crc is not None:
            try:
                crc = int(crc)
            except (TypeError, ValueError):
                self._fail(f"__metadata__.crc_num {crc!r} is not an integer")
            entries.sort(key=lambda e: e[0])    # the order the CRC was chained in
        else:
            entries.sort(key=lambda e: e[3])    # file order: sequential reads
        return entries, crc

    def _stream(self):
        mm = self._mm
        view = memoryview(mm)
        crc = 0
        try:
            for name, shape, dtype, start, end in self._entries:
                data = view[start:end]
                if self._expected_crc is not None:
                    crc = zlib.crc32(data, zlib.crc32(name.encode(), crc))
                yield name, shape, dtypes.numpy_dtype(dtype), data
                forget(mm, start, end - start)
            if self._expected_crc is not None and crc != self._expected_crc:
                self._fail(f"__metadata__.crc_num is {self._expected_crc}, the tensors' CRC-32 is {crc}: "
                           f"the file is damaged")
        finally:
            view.release()
            close_quietly(mm)
