"""Raw encoders for the fuzz job (tools/fuzz/job.py): msgpack and JSON that can say what the
server's own encoders refuse to (strings that are not UTF-8, ints at the msgpack limits, float32
NaNs, ext types, spliced pre-encoded bytes such as 100,000 levels of nesting), and the reading
of the server's msgspec schemas (field types and numeric bounds) the strategies are built from.
Pure: no sockets, no hypothesis."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import inspect as mi

INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1


@dataclass(frozen=True)
class Str:
    """A string whose bytes go out as they are: maybe not UTF-8."""

    data: bytes


@dataclass(frozen=True)
class Raw:
    """Bytes already encoded, spliced in as they are (deep nesting, broken syntax)."""

    data: bytes


@dataclass(frozen=True)
class F32:
    """A msgpack float32 (msgspec itself always writes float64)."""

    value: float


@dataclass(frozen=True)
class Ext:
    """A msgpack extension value (code -1 is the timestamp msgspec decodes to a datetime)."""

    code: int
    data: bytes


def _head(n: int, fix: int, fix_max: int, codes: tuple[int, int, int]) -> bytes:
    """Length prefix of a str/bin/array/map: the fix form when it fits, else 8/16/32 bits."""
    if fix >= 0 and n < fix_max:
        return bytes([fix | n])
    for code, width, fmt in zip(codes, (1 << 8, 1 << 16, 1 << 32), ("B", ">H", ">I")):
        if code and n < width:
            return bytes([code]) + struct.pack(fmt, n)
    raise ValueError(f"msgpack cannot hold {n} items")


def _pack_int(n: int) -> bytes:
    if 0 <= n < 128:
        return bytes([n])
    if -32 <= n < 0:
        return struct.pack("b", n)
    table = ((0xCC, "B", 0, 1 << 8), (0xCD, ">H", 0, 1 << 16), (0xCE, ">I", 0, 1 << 32),
             (0xCF, ">Q", 0, 1 << 64)) if n > 0 else (
        (0xD0, "b", -(1 << 7), 0), (0xD1, ">h", -(1 << 15), 0), (0xD2, ">i", -(1 << 31), 0),
        (0xD3, ">q", INT64_MIN, 0))
    for code, fmt, lo, hi in table:
        if lo <= n < hi:
            return bytes([code]) + struct.pack(fmt, n)
    raise ValueError(f"msgpack cannot hold the int {n}")


def pack(obj: Any) -> bytes:
    """msgpack of plain values plus Str, Raw, F32 and Ext. A str with lone surrogates goes out
    as the (invalid) UTF-8 bytes of them."""
    match obj:
        case Raw():
            return obj.data
        case None:
            return b"\xc0"
        case bool():
            return b"\xc3" if obj else b"\xc2"
        case int():
            return _pack_int(obj)
        case F32():
            return b"\xca" + struct.pack(">f", obj.value)
        case float():
            return b"\xcb" + struct.pack(">d", obj)
        case str():
            return pack(Str(obj.encode("utf-8", "surrogatepass")))
        case Str():
            return _head(len(obj.data), 0xA0, 32, (0xD9, 0xDA, 0xDB)) + obj.data
        case bytes():
            return _head(len(obj), -1, 0, (0xC4, 0xC5, 0xC6)) + obj
        case Ext():
            fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}.get(len(obj.data))
            head = bytes([fixed]) if fixed else _head(len(obj.data), -1, 0, (0xC7, 0xC8, 0xC9))
            return head + struct.pack("b", obj.code) + obj.data
        case list() | tuple():
            return _head(len(obj), 0x90, 16, (0, 0xDC, 0xDD)) + b"".join(map(pack, obj))
        case dict():
            return _head(len(obj), 0x80, 16, (0, 0xDE, 0xDF)) + b"".join(
                pack(k) + pack(v) for k, v in obj.items())
    raise TypeError(f"cannot pack {type(obj).__name__}")


def to_json(obj: Any) -> bytes:
    """JSON of plain values plus Str (raw bytes between quotes) and Raw; NaN and Infinity as
    Python's json writes them; lone surrogates as \\udXXX escapes (valid syntax, no UTF-16)."""
    match obj:
        case Raw():
            return obj.data
        case Str():
            return b'"' + obj.data + b'"'
        case None | bool() | str():
            return json.dumps(obj).encode()
        case int():
            return str(obj).encode()
        case float():
            return (b"NaN" if math.isnan(obj) else b"Infinity" if obj > 0 else b"-Infinity") \
                if not math.isfinite(obj) else repr(obj).encode()
        case list() | tuple():
            return b"[" + b",".join(map(to_json, obj)) + b"]"
        case dict():
            return b"{" + b",".join(
                (to_json(k) if isinstance(k, (str, Str)) else to_json(str(k))) + b":" + to_json(v)
                for k, v in obj.items()) + b"}"
    return to_json(str(obj))


def nest(depth: int, json_mode: bool, maps: bool) -> Raw:
    """`depth` nested arrays (or one-key maps) around a null."""
    if json_mode:
        return Raw(b'{"a":' * depth + b"null" + b"}" * depth if maps
                   else b"[" * depth + b"]" * depth)
    return Raw((b"\x81\xa1a" if maps else b"\x91") * depth + b"\xc0")


# -- the schemas -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bounds:
    """A numeric field's range from its msgspec Meta (None: open)."""

    kind: type  # int or float
    lo: float | None = None
    lo_open: bool = False
    hi: float | None = None
    hi_open: bool = False

    def holds(self, v: float) -> bool:
        if isinstance(v, float) and math.isnan(v):
            return self.lo is None and self.hi is None
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return not (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))

    def clip(self, lo: float, hi: float) -> tuple[float, float]:
        """[lo, hi] narrowed to what this range holds (open ends moved inward a little)."""
        if self.lo is not None:
            lo = max(lo, self.lo + (1 if self.kind is int else 1e-3) * self.lo_open)
        if self.hi is not None:
            hi = min(hi, self.hi - (1 if self.kind is int else 1e-3) * self.hi_open)
        return lo, hi


def plain_type(t: mi.Type) -> tuple[mi.Type, bool]:
    """A type with None taken out of its union, and whether None was in it."""
    if isinstance(t, mi.UnionType):
        rest = [u for u in t.types if not isinstance(u, mi.NoneType)]
        nullable = len(rest) < len(t.types)
        return (rest[0] if len(rest) == 1 else mi.UnionType(tuple(rest))), nullable
    return t, False


def bounds_of(t: mi.Type) -> Bounds | None:
    t = plain_type(t)[0]
    if isinstance(t, (mi.IntType, mi.FloatType)):
        kind = int if isinstance(t, mi.IntType) else float
        lo, lo_open = (t.gt, True) if t.gt is not None else (t.ge, False)
        hi, hi_open = (t.lt, True) if t.lt is not None else (t.le, False)
        return Bounds(kind, lo, lo_open, hi, hi_open)
    return None


def fields_of(struct_type: type) -> dict[str, mi.Field]:
    return {f.name: f for f in mi.type_info(struct_type).fields}


def tag_of(struct_type: type) -> tuple[str, Any]:
    info = mi.type_info(struct_type)
    return info.tag_field, info.tag


# msgpack/JSON value categories, and which ones a schema type takes (for wrong-type values).
CATEGORIES = ("nil", "bool", "int", "float", "str", "bin", "list", "map", "ext")


def accepted(t: mi.Type) -> set[str]:
    match t:
        case mi.NoneType():
            return {"nil"}
        case mi.BoolType():
            return {"bool"}
        case mi.IntType():
            return {"int"}
        case mi.FloatType():
            return {"int", "float"}
        case mi.StrType():
            return {"str"}
        case mi.BytesType():
            return {"bin", "str"}
        case mi.ListType() | mi.TupleType() | mi.VarTupleType() | mi.SetType():
            return {"list"}
        case mi.DictType() | mi.StructType() | mi.TypedDictType() | mi.DataclassType():
            return {"map"}
        case mi.UnionType():
            return set().union(*(accepted(u) for u in t.types))
        case mi.Metadata():
            return accepted(t.type)
    return set(CATEGORIES)  # Any, or something new: every category is a right type


def decodes(payload: bytes, union: Any) -> Any:
    """The server's own typed decoding of a frame, or None when it refuses it."""
    try:
        return msgspec.msgpack.decode(payload, type=union)
    except Exception:  # every refusal counts the same here, RecursionError included
        return None


def claimed_req_id(payload: bytes) -> str | None:
    """The req_id a frame carries when it decodes at all (the server can name it in its reply),
    else None."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception:
        return None
    rid = raw.get("req_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else None


def parses_json(body: bytes) -> tuple[bool, Any]:
    """Whether a body is JSON for Python's json or for msgspec, even once its invalid UTF-8 is
    replaced (a server decoding into a struct skips unknown keys unchecked, so one with a
    broken key is served), and the value (or None)."""
    for text in (body, body.decode("utf-8", "replace")):
        for parse in (json.loads, msgspec.json.decode):
            try:
                return True, parse(text)
            except Exception:  # RecursionError and UnicodeDecodeError included
                continue
    return False, None
