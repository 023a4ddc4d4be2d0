"""Just enough of the protobuf wire format to walk a MindSpore checkpoint without copying it."""

MAX_VARINT_BYTES = 10


class WireError(ValueError):
    """Malformed wire data; `offset` is the byte where it was found."""

    def __init__(self, message, offset):
        super().__init__(message)
        self.offset = offset


def varint(buf, pos, end):
    """(value as unsigned 64-bit, position after it)."""
    result = shift = 0
    start = pos
    while True:
        if pos >= end:
            raise WireError("truncated varint", start)
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
        if pos - start >= MAX_VARINT_BYTES:
            raise WireError("varint longer than 10 bytes", start)


def as_int64(value):
    """An unsigned 64-bit varint read back as the int64 it encodes (negative ints use 10 bytes)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def fields(buf, start, end):
    """(field number, wire type, value, key offset) for each field of the message in buf[start:end].

    value: an int for varints, (offset, length) for length-delimited fields,
    None for fixed 32/64-bit fields (skipped: a checkpoint has none we use).
    """
    pos = start
    while pos < end:
        at = pos
        key, pos = varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0", at)
        if wire == 0:
            value, pos = varint(buf, pos, end)
        elif wire == 2:
            length, pos = varint(buf, pos, end)
            if length > end - pos:
                raise WireError(f"field {field} of {length} bytes runs past the end of its message", at)
            value = (pos, length)
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise WireError(f"fixed-size field {field} runs past the end of its message", at)
            value = None
        else:
            raise WireError(f"unsupported protobuf wire type {wire}", at)
        yield field, wire, value, at
