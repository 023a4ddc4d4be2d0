"""DLPack "dltensor" capsules over raw memory: how a framework tensor is made to view a home.

`mindspore.utils.dlpack.from_dlpack(capsule)` returns a tensor over the
capsule's address with no copy. The device type picks the memory: kDLExtDev
is MindSpore's Ascend device, kDLCPU host memory (which is how the layout is
tested on a machine without an NPU).
"""
import ctypes
import threading

import numpy as np

KDL_CPU = 1
KDL_EXT_DEV = 12      # MindSpore maps it to its Ascend device target

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_live = {}          # address of a DLManagedTensor -> what it points into, until its consumer deletes it
_live_lock = threading.Lock()


@_DELETER
def _delete(managed):
    with _live_lock:
        _live.pop(ctypes.addressof(managed.contents), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_DL_CODES = {"f": 2, "i": 0, "u": 1, "b": 6}


def dlpack_capsule(address, shape, dtype, device_type, device_id=0, owner=None):
    """A "dltensor" capsule over `address` (C-contiguous `shape` of `dtype`).

    `owner` (e.g. the Home) is kept alive until the consumer calls the deleter,
    i.e. as long as the framework tensor made from the capsule lives.
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in _DL_CODES:
        raise TypeError(f"dtype {dtype} has no DLPack type code")
    shape = tuple(int(s) for s in shape)
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    c_shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    c_strides = (ctypes.c_int64 * max(len(shape), 1))(*strides)
    managed = DLManagedTensor()
    managed.dl_tensor = _DLTensor(address, _DLDevice(device_type, device_id), len(shape),
                                  _DLDataType(_DL_CODES[dtype.kind], dtype.itemsize * 8, 1),
                                  c_shape, c_strides, 0)
    managed.deleter = _delete
    with _live_lock:
        _live[ctypes.addressof(managed)] = (managed, c_shape, c_strides, owner)
    return _capsule_new(ctypes.addressof(managed), b"dltensor", None)


def read_capsule(capsule):
    """(address, shape, dtype, device_type, device_id) of a dltensor capsule (tests, fakes)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    t = DLManagedTensor.from_address(get(capsule, b"dltensor")).dl_tensor
    kind = {v: k for k, v in _DL_CODES.items()}[t.dtype.code]
    dtype = np.dtype(f"{kind}{t.dtype.bits // 8}") if kind != "b" else np.dtype(bool)
    return t.data, tuple(t.shape[i] for i in range(t.ndim)), dtype, t.device.device_type, t.device.device_id
