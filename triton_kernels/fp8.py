"""float8 e4m3 (torch.float8_e4m3fn, Triton tl.float8e4nv) conversions done with integer arithmetic.

On a GPU the kernels convert with the hardware instruction (`x.to(tl.float8e4nv)`, round to nearest even,
saturating). Triton 3.9's interpreter gets that conversion wrong on this machine: values that round up
across a power of two (e.g. 127.0 -> 128) come out halved (64), ties round up instead of to even, and the
NaN code 0x7F decodes as 480. The kernels therefore use these bit-level versions when they run under the
interpreter (SOFT_FP8). They compute exactly what torch's float32 -> float8_e4m3fn cast computes for
inputs in [-448, 448] (round to nearest even, subnormals included) and NaN -> 0x7F; tests/triton checks
both directions against torch on every code and on random values, and bench/device_check.py checks the
hardware path against this one on the GPU.
"""
import triton
import triton.language as tl


@triton.jit
def encode_e4m3(x):
    """uint8 e4m3 codes of float32 `x`, which the caller has clamped to [-448, 448] (NaN stays NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23           # biased float32 exponent; e4m3 normals need exp - 127 >= -6
    mant = mag & 0x7FFFFF
    # normal: 3 of the 23 mantissa bits kept, the dropped 20 rounded to nearest even (a carry moves
    # into the exponent field, which is the right result)
    kept = mant >> 20
    dropped = mant & 0xFFFFF
    up = (dropped > 0x80000) | ((dropped == 0x80000) & ((kept & 1) == 1))
    normal = ((exp - 120) << 3) + kept + up.to(tl.int32)
    # subnormal: code = round(|x| * 2^9) = round(M * 2^(exp - 141)), M the 24-bit significand
    significand = mant | tl.where(exp > 0, 0x800000, 0)
    shift = tl.minimum(141 - tl.minimum(exp, 120), 25)  # >= 21; 25 already rounds every M to 0
    one = tl.full(shift.shape, 1, tl.int32)
    half = one << (shift - 1)
    kept_sub = significand >> shift
    dropped_sub = significand & ((one << shift) - 1)
    up_sub = (dropped_sub > half) | ((dropped_sub == half) & ((kept_sub & 1) == 1))
    subnormal = kept_sub + up_sub.to(tl.int32)
    code = tl.where(exp >= 121, normal, subnormal)
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def decode_e4m3(code):
    """float32 value of uint8 e4m3 `code`."""
    c = code.to(tl.int32)
    sign = c >> 7
    exp = (c >> 3) & 0xF
    mant = c & 0x7
    normal = ((sign << 31) | ((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    subnormal = mant.to(tl.float32) * 0.001953125  # mant * 2^-9
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    value = tl.where(exp == 0, subnormal, normal)
    return tl.where((c & 0x7F) == 0x7F, float("nan"), value)
