"""MindSpore `.ckpt` reader: protobuf values, sliced parameters, the crc_num trailer.

Layout written by `mindspore.save_checkpoint` (2.x): a `Checkpoint` message,
i.e. a run of field-1 `Value{tag=1: name, tensor=2: TensorProto{dims=1,
tensor_type=2, tensor_content=3}}` records. A parameter over 512 MiB is saved
as several consecutive values with the same tag, each repeating the full
dims and holding the next piece of the C-order bytes ("sliced parameter");
they are reassembled here. `crc_check=True` appends b"crc_num" + the
zlib CRC-32 of everything before it as 10 big-endian bytes; it is verified
after the last tensor (a consumer that must not keep unverified data, like
`stage_checkpoint`, commits only once iteration has ended cleanly).
"""
import zlib

from .. import dtypes
from .checks import name_problem, shape_problem, shown
from .source import CheckpointReader, buffer
from .protobuf import WireError, as_int64, fields, varint

CRC_MARK = b"crc_num"
CRC_TRAILER = len(CRC_MARK) + 10


class _Tensor:
    __slots__ = ("name", "shape", "dtype", "slices", "start", "end")

    def __init__(self, name, shape, dtype, content, start, end):
        self.name, self.shape, self.dtype = name, shape, dtype
        self.slices = [content]          # (offset, length) of each tensor_content, in order
        self.start, self.end = start, end

    @property
    def held(self):
        return sum(n for _, n in self.slices)

    @property
    def nbytes(self):
        return dtypes.nbytes(self.shape, self.dtype)


class MindSporeCheckpoint(CheckpointReader):
    """Iterator of (name, shape, numpy dtype, buffer) over a .ckpt, one tensor in RAM at a time.

    The whole structure is checked when it is opened (StagingError naming the
    file, the tensor and the field), so a malformed file is refused before
    anything is yielded; the crc_num trailer, when present, is checked once
    the last tensor has been consumed. `tensors` and `nbytes` give the totals.
    """

    @property
    def nbytes(self):
        return sum(e.nbytes for e in self._entries)

    @property
    def names(self):
        return [e.name for e in self._entries]

    @property
    def shapes(self):
        """{name: shape} of every tensor, from the structure (no data read)."""
        return {e.name: tuple(e.shape) for e in self._entries}

    # ------------------------------------------------------------ structure
    def _read_structure(self):
        self._scan()

    def _scan(self):
        src, size = self._file, len(self._file)
        self._body_end, self._expected_crc = size, None
        if size >= CRC_TRAILER and src[size - CRC_TRAILER:size - 10] == CRC_MARK:
            self._body_end = size - CRC_TRAILER
            self._expected_crc = int.from_bytes(src[size - 10:size], "big")
        entries, seen, current = [], {}, None
        try:
            for field, wire, value, at in fields(src, 0, self._body_end):
                if field != 1 or wire != 2:
                    self._fail(f"byte {at}: protobuf field {field} (wire type {wire}) where a "
                               f"Checkpoint.value belongs: not a MindSpore checkpoint")
                name, dims, dtype, content = self._value(value, at)
                end = value[0] + value[1]
                if current is not None and current.name == name and current.held < current.nbytes:
                    if (dims, dtype) != (current.shape, current.dtype):
                        self._fail(f"tensor {name!r}: slice {len(current.slices)} has dims {dims} of "
                                   f"{dtype}, the first slice has {current.shape} of {current.dtype}")
                    current.slices.append(content)
                    current.end = end
                    self._check_size(current, final=False)
                    continue
                if current is not None:
                    self._check_size(current, final=True)
                if name in seen:
                    self._fail(f"tensor {name!r} appears twice (values at bytes {seen[name]} and {at})")
                seen[name] = at
                current = _Tensor(name, dims, dtype, content, at, end)
                entries.append(current)
                self._check_size(current, final=False)
        except WireError as e:
            self._fail(f"not a readable MindSpore checkpoint (truncated or corrupt): {e} at byte {e.offset}")
        if current is None:
            self._fail("holds no tensors")
        self._check_size(current, final=True)
        self._entries = entries

    def _check_size(self, t, final):
        held, need = t.held, t.nbytes
        if held > need or (final and held != need):
            pieces = f" in {len(t.slices)} slices" if len(t.slices) > 1 else ""
            self._fail(f"tensor {t.name!r}: tensor_content holds {held} bytes{pieces}, "
                       f"dims {list(t.shape)} of {t.dtype} need {need}")

    def _value(self, span, at):
        """(name, dims tuple, prefetchd dtype name, content (offset, length)) of one Checkpoint.value."""
        src = self._file
        name = tensor = None
        for f, w, v, _ in fields(src, span[0], span[0] + span[1]):
            if f == 1 and w == 2:
                try:
                    name = src[v[0]:v[0] + v[1]].decode()
                except UnicodeDecodeError:
                    self._fail(f"byte {at}: value tag (parameter name) is not UTF-8")
            elif f == 2 and w == 2:
                tensor = v
            elif f == 3 and w == 2:
                self._fail(f"tensor {name!r} is a MapParameter (maptensor), which prefetchd cannot stage")
        if name is None:
            self._fail(f"byte {at}: a checkpoint value without a tag (parameter name)")
        problem = name_problem(name)
        if problem:
            self._fail(f"byte {at}: tensor {shown(name)}: {problem}")
        if tensor is None:
            self._fail(f"tensor {name!r}: value without a tensor")
        dims, type_name, content = [], None, (tensor[0], 0)
        for f, w, v, _ in fields(src, tensor[0], tensor[0] + tensor[1]):
            if f == 1 and w == 0:
                dims.append(as_int64(v))
            elif f == 1 and w == 2:                # packed dims
                p, stop = v[0], v[0] + v[1]
                while p < stop:
                    d, p = varint(src, p, stop)
                    dims.append(as_int64(d))
            elif f == 2 and w == 2:
                type_name = src[v[0]:v[0] + v[1]].decode(errors="replace")
            elif f == 3 and w == 2:
                content = v
        for i, d in enumerate(dims):
            if d < 0:
                self._fail(f"tensor {name!r}: dims[{i}] is {d} (negative)")
        if type_name is None:
            self._fail(f"tensor {name!r}: no tensor_type")
        dtype = dtypes.MINDSPORE_CKPT.get(type_name)
        if dtype is None:
            what = " (a string value)" if type_name == "str" else ""
            self._fail(f"tensor {name!r}: tensor_type {shown(type_name)}{what} has no numpy equivalent; "
                       f"prefetchd stages {', '.join(dtypes.MINDSPORE_CKPT)}")
        problem = shape_problem(dims, dtypes.itemsize(dtype))
        if problem:
            self._fail(f"tensor {name!r}: {problem}")
        return name, tuple(dims), dtype, content

    # ------------------------------------------------------------ data
    def _stream(self):
        crc, pos = 0, 0
        for t in self._entries:
            data, crc, pos = self._read(t, crc, pos)
            yield t.name, t.shape, dtypes.numpy_dtype(t.dtype), data
        if self._expected_crc is not None:
            crc = self._crc_of(pos, self._body_end, crc)
            if crc != self._expected_crc:
                self._fail(f"crc_num trailer says CRC-32 {self._expected_crc:#010x}, the content has "
                           f"{crc:#010x}: the file is damaged")

    def _read(self, t, crc, pos):
        """(t's bytes, its slices read one after the other into one buffer, the CRC-32 and the
        position it has reached): with a crc_num trailer, every byte counts, the protobuf
        framing between the slices included."""
        data, filled = buffer(t.nbytes), 0
        for off, n in t.slices:
            if self._expected_crc is not None:
                crc = self._crc_of(pos, off, crc)
            piece = data[filled:filled + n]
            self._file.read_into(piece, off)
            if self._expected_crc is not None:
                crc = zlib.crc32(piece, crc)
            filled, pos = filled + n, off + n
        if self._expected_crc is not None:
            crc = self._crc_of(pos, t.end, crc)
        return data, crc, t.end

    def _crc_of(self, start, end, crc):
        """The CRC-32 carried on over the file's bytes [start, end) (framing: a few bytes)."""
        while start < end:
            n = min(end - start, 1 << 20)
            crc = zlib.crc32(self._file[start:start + n], crc)
            start += n
        return crc
