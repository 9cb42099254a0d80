"""Encoding: one msgpack encoder, one typed decoder per inbox (built once), int32 token packing."""

from __future__ import annotations

import sys
from array import array
from typing import Any, Iterable

import msgspec

from protocol import messages as m

# array("i") is the platform's C int: 32 bits on every platform MLX runs on; checked once here.
assert array("i").itemsize == 4, "int32 token packing needs a 4-byte C int"
assert sys.byteorder == "little", "token bytes are little-endian on every supported host"

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decoder(union: Any) -> msgspec.msgpack.Decoder:
    """A typed decoder for one inbox's union (build it once per actor)."""
    return msgspec.msgpack.Decoder(union)


def pack_ids(ids: Iterable[int]) -> bytes:
    return array("i", ids).tobytes()


def unpack_ids(data: bytes) -> list[int]:
    out = array("i")
    out.frombytes(data)
    return out.tolist()


def split_counts(flat: list[int], counts: list[int]) -> list[list[int]]:
    """Cut a flat id list into consecutive pieces of the given lengths."""
    pieces, at = [], 0
    for n in counts:
        pieces.append(flat[at : at + n])
        at += n
    return pieces


# The decoders each actor builds once; tests use them too.
CLIENT_INBOUND = m.ClientInbound
CLIENT_OUTBOUND = m.ClientOutbound
