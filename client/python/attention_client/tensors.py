"""numpy (or torch) <-> attention.v1.Tensor conversion.

Tensors travel as raw little-endian bytes. numpy has no bfloat16, so bfloat16 is produced
from the float32 bit pattern (round to nearest even, NaN kept quiet) and widened back by a
16-bit shift, both on uint32 views. torch tensors are accepted wherever numpy arrays are;
torch is never imported unless the caller passed a torch tensor.
"""

import sys

import numpy as np

from . import stubs

# Wire enum values (attention.v1.DataType).
FLOAT32, FLOAT16, BFLOAT16, BOOL = 1, 2, 3, 4
_NAMES = {"float32": FLOAT32, "float16": FLOAT16, "bfloat16": BFLOAT16, "bool": BOOL}


def dtype_enum(dtype):
    """'float32' | 'float16' | 'bfloat16' | 'bool' | torch dtype | wire enum value -> wire
    enum value."""
    if is_torch(dtype):
        dtype = str(dtype).rsplit(".", 1)[-1]
    if isinstance(dtype, str):
        try:
            return _NAMES[dtype.lower()]
        except KeyError:
            raise ValueError("unknown dtype %r; use one of %s" % (dtype, sorted(_NAMES)))
    return int(dtype)


def is_torch(value):
    return type(value).__module__.split(".")[0] == "torch"


def to_numpy(value):
    """numpy array, torch tensor (any device, bfloat16 widened) or nested list -> ndarray."""
    if is_torch(value):
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype != sys.modules["torch"].float64:
            value = value.float()  # numpy has no bfloat16; float16 / bfloat16 widen exactly
        return value.numpy()
    return np.asarray(value)


def natural_dtype(value):
    """The wire dtype of an input when the caller names none: float16 and bfloat16 inputs
    travel as such (their values are exact there), everything else as float32."""
    name = str(getattr(value, "dtype", "")).replace("torch.", "")
    return {"float16": FLOAT16, "bfloat16": BFLOAT16}.get(name, FLOAT32)


def like(array, wire_dtype, reference):
    """Decoded float32 `array` as the caller's kind of tensor: numpy stays numpy; for a
    torch `reference`, a torch tensor in the wire dtype on the reference's device."""
    if not is_torch(reference):
        return array
    torch = sys.modules["torch"]
    dtype = {FLOAT16: torch.float16, BFLOAT16: torch.bfloat16}.get(wire_dtype, torch.float32)
    if array.dtype == np.bool_:
        dtype = torch.bool
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=reference.device, dtype=dtype)


def float32_to_bfloat16_bits(values):
    """float32 array -> uint16 array of bfloat16 bit patterns (round to nearest even)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # keep sign, force quiet NaN
    return out


def bfloat16_bits_to_float32(bits):
    """uint16 array of bfloat16 bit patterns -> float32 array."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_dtype(values, dtype):
    """What the values become after a trip through `dtype` (float32 result)."""
    dtype = dtype_enum(dtype)
    values = np.asarray(values, dtype=np.float32)
    if dtype == FLOAT16:
        return values.astype(np.float16).astype(np.float32)
    if dtype == BFLOAT16:
        return bfloat16_bits_to_float32(float32_to_bfloat16_bits(values)).reshape(values.shape)
    return values


def encode(array, dtype=None, out=None):
    """numpy array or torch tensor -> attention.v1.Tensor. dtype defaults to BOOL for bool
    arrays, else natural_dtype(array). `out` is an existing Tensor message to fill (e.g.
    request.query)."""
    pb2 = stubs.load()[0]
    natural = natural_dtype(array)
    array = to_numpy(array)
    if dtype is None:
        dtype = BOOL if array.dtype == np.bool_ else natural
    dtype = dtype_enum(dtype)
    if dtype == FLOAT32:
        raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
    elif dtype == FLOAT16:
        raw = np.ascontiguousarray(array, dtype="<f2").tobytes()
    elif dtype == BFLOAT16:
        raw = float32_to_bfloat16_bits(array).astype("<u2").tobytes()
    elif dtype == BOOL:
        raw = np.ascontiguousarray(array != 0, dtype=np.uint8).tobytes()
    else:
        raise ValueError("cannot encode dtype %d" % dtype)
    tensor = out if out is not None else pb2.Tensor()
    tensor.Clear()
    tensor.dtype = dtype
    tensor.shape.extend(int(d) for d in array.shape)
    tensor.raw_data = raw
    return tensor


def decode(tensor):
    """attention.v1.Tensor -> numpy array (float32 for float dtypes, bool for BOOL)."""
    shape = tuple(int(d) for d in tensor.shape)
    if len(tensor.float_data) and not tensor.raw_data:
        return np.asarray(tensor.float_data, dtype=np.float32).reshape(shape)
    raw = tensor.raw_data
    dtype = tensor.dtype
    if dtype == FLOAT32:
        values = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    elif dtype == FLOAT16:
        values = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif dtype == BFLOAT16:
        values = bfloat16_bits_to_float32(np.frombuffer(raw, dtype="<u2"))
    elif dtype == BOOL:
        values = np.frombuffer(raw, dtype=np.uint8) != 0
    else:
        raise ValueError("cannot decode dtype %d" % dtype)
    return values.reshape(shape)
