"""The code codec: one image's VQGAN codes <-> a few bytes, and the checks that make a hostile record harmless.

A shard row stores an image as its codes (the paper streams these instead of images, about 18x fewer bytes), packed
in as few bits as the codebook needs and Brotli-compressed when that is smaller. ``decode_codes`` bounds every size
a record declares (count, Brotli window, output) before it allocates anything.
"""

from __future__ import annotations

import logging

import brotli
import numpy as np

from collab_kit.errors import CollabKitError

logger = logging.getLogger(__name__)

MAX_CODEBOOK_SIZE = 2**16  # a code is stored in at most 16 bits
MAX_CODES_PER_IMAGE = 2**16 - 1  # the count is stored in 16 bits
_BROTLI_FLAG = 0x80  # header bit: the payload is Brotli-compressed
# the largest Brotli window a record may declare: brotli.compress's default, which the kit's first shards used. The
# decoder allocates the window (4 MiB here) before it writes a byte; a stream declaring 16 MiB (lgwin 24) would cost
# that much memory even when the output is cut at a few bytes
MAX_BROTLI_WINDOW_BITS = 22


# ---------------------------------------------------------------------------------------------
# the code codec: integer codes <-> a few bytes
#
# One image's codes are stored as ``[header: 1 byte][count: uint16 LE][payload]``. The header's low
# bits give the bits per code b; the payload packs every code in b bits (little-endian bit order),
# Brotli-compressed when that is smaller. A codebook of 8192 needs 13 bits: 1024 codes take 1664
# bytes however random they are, where int16 + Brotli takes about 1775. Codes of a trained tokenizer
# repeat patterns that byte-aligned int16 shows Brotli better, so the encoder also tries that (b = 16)
# and keeps the smallest form.


def bits_per_code(codebook_size: int) -> int:
    """The bits one code needs: 13 for a codebook of 8192."""
    if not 2 <= codebook_size <= MAX_CODEBOOK_SIZE:
        raise ValueError(f"codebook_size={codebook_size} is not allowed: expected 2 .. {MAX_CODEBOOK_SIZE}")
    return int(codebook_size - 1).bit_length()


def _pack(codes: np.ndarray, bits: int) -> bytes:
    if bits == 16:
        return codes.astype("<u2").tobytes()
    bit_matrix = (codes.astype(np.uint32)[:, None] >> np.arange(bits, dtype=np.uint32)) & 1
    return np.packbits(bit_matrix.astype(np.uint8).ravel(), bitorder="little").tobytes()


def _unpack(payload: bytes, bits: int, count: int) -> np.ndarray:
    if len(payload) != (count * bits + 7) // 8:
        raise ValueError(f"holds {len(payload)} bytes of codes where its header says {count} codes of {bits} bits")
    if bits == 16:
        codes = np.frombuffer(payload, dtype="<u2")
    else:
        flat = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), count=count * bits, bitorder="little")
        codes = flat.reshape(count, bits).astype(np.uint32) @ (1 << np.arange(bits, dtype=np.uint32))
    return codes.astype(np.int64)


def encode_codes(codes: np.ndarray, codebook_size: int | None = None, quality: int = 11) -> bytes:
    """Store one image's codes in as few bytes as this codec can.

    :param codes: integers in [0, codebook_size), any shape (stored flat, in C order)
    :param codebook_size: the tokenizer's codebook (8192 in the paper); default: just enough for the largest code
    :param quality: Brotli's effort, 0..11
    """
    codes = np.asarray(codes).ravel()
    if codes.size > MAX_CODES_PER_IMAGE:
        raise ValueError(f"an image of {codes.size} codes is too large: at most {MAX_CODES_PER_IMAGE}")
    largest = int(codes.max()) if codes.size else 0
    if codebook_size is None:
        codebook_size = max(2, largest + 1)
    if codes.size and (codes.min() < 0 or largest >= codebook_size):
        raise ValueError(
            f"codes must lie in [0, {codebook_size}) (the codebook), got values in [{codes.min()}, {largest}]"
        )
    header_count = codes.size.to_bytes(2, "little")
    candidates = []
    for bits in sorted({bits_per_code(codebook_size), 16}):
        packed = _pack(codes, bits)
        candidates.append(bytes([bits]) + header_count + packed)
        # a window just large enough for the payload: what the decoder must allocate to read it
        window = min(MAX_BROTLI_WINDOW_BITS, max(10, len(packed).bit_length()))
        candidates.append(
            bytes([bits | _BROTLI_FLAG]) + header_count + brotli.compress(packed, quality=quality, lgwin=window)
        )
    return min(candidates, key=len)


class InvalidCodesError(CollabKitError, ValueError):
    """A sample's stored codes cannot be decoded: the only error ``decode_codes`` raises, whatever the bytes."""


def _brotli_window_bits(payload: bytes) -> int | None:
    """The window a Brotli stream declares in its first bits (RFC 7932, 9.1); None for the large-window extension or
    a reserved value."""
    if not payload:
        return None
    bits = payload[0] | (payload[1] << 8 if len(payload) > 1 else 0)
    if bits & 1 == 0:
        return 16
    if (bits >> 1) & 7:
        return 17 + ((bits >> 1) & 7)
    value = (bits >> 4) & 7
    if value == 1:
        return None
    return 8 + value if value else 17


def _decompress_bounded(payload: bytes, size: int) -> bytes:
    """Brotli-decompress ``payload``, which must hold exactly ``size`` bytes, in memory and time bounded by ``size``.

    A record of a few hundred bytes can expand to gigabytes (a decompression bomb): its window is checked first
    (the decoder's memory), and the decompressor is never let past ``size``, so such a record costs at most what a
    legal one does before it is refused.
    """
    window = _brotli_window_bits(payload)
    if window is None or window > MAX_BROTLI_WINDOW_BITS:
        raise InvalidCodesError(
            f"a sample's codes declare a Brotli window of "
            f"{'an unknown size' if window is None else f'{2**window} bytes'}, more than a "
            f"record of at most 131,070 bytes needs (at most {2**MAX_BROTLI_WINDOW_BITS}): "
            f"refused (a damaged record, or a decompression bomb)"
        )
    decompressor = brotli.Decompressor()
    try:
        # the output buffer stops growing at the limit (brotli rounds it up to its next block, some 32 KiB)
        data = decompressor.process(payload, output_buffer_limit=size + 1)
    except brotli.error as e:
        raise InvalidCodesError(f"a sample's codes are not valid Brotli data ({e}): the shard is corrupt") from None
    if len(data) > size or not decompressor.can_accept_more_data():
        raise InvalidCodesError(
            f"a sample's codes decompress to more than the {size} bytes its header announces "
            f"(a damaged record, or a decompression bomb): refused"
        )
    if not decompressor.is_finished():
        raise InvalidCodesError(
            f"a sample's codes are cut short: {len(data)} of the {size} bytes its header "
            f"announces, and the Brotli stream does not end"
        )
    return data


def decode_codes(data: bytes, expected_length: int | None = None) -> np.ndarray:
    """The codes ``encode_codes`` stored, as a flat int64 array.

    Any bytes at all can be given: what is not a valid record raises InvalidCodesError (a ValueError), in time and
    memory bounded by the largest legal record (65,535 codes of 16 bits: 131,070 bytes of payload).

    :param expected_length: if given, raise InvalidCodesError when the sample holds another number of codes
    :raises InvalidCodesError: the bytes are not a record of this codec, or not the expected number of codes
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidCodesError(
            f"a sample's codes are a {type(data).__name__}, not bytes: the shard's codes "
            f"column must be binary (written by collab_kit.data.shards.write_shard)"
        )
    data = bytes(data)
    if len(data) < 3 or not 1 <= (data[0] & ~_BROTLI_FLAG) <= 16:
        raise InvalidCodesError(
            "a sample's codes are not in collab_kit's format (a header of bits per code and a "
            "count): the shard is corrupt or was written by something else"
        )
    bits, count, payload = data[0] & ~_BROTLI_FLAG, int.from_bytes(data[1:3], "little"), data[3:]
    if expected_length is not None and count != expected_length:
        raise InvalidCodesError(
            f"a sample holds {count} image codes but the model expects {expected_length}: "
            f"the shards were made for another image size"
        )
    size = (count * bits + 7) // 8
    if data[0] & _BROTLI_FLAG:
        payload = _decompress_bounded(payload, size)
    try:
        return _unpack(payload, bits, count)
    except ValueError as e:
        raise InvalidCodesError(f"a sample's codes are damaged: it {e}") from None
