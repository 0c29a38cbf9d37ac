"""When zstd pays for itself: the bundle writer's per-chunk compression policy."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zstandard

from kernels.errors import FormatError
from sessionstore.migration.bundle_format import CODEC_RAW, CODEC_ZSTD, ZSTD_LEVEL

MIN_MEASURED_BYTES = 4 << 10  # shorter writes and chunks measure per-call overhead: not used
MAX_PROBE_INTERVAL = 256  # chunks between probes once compression keeps losing
PROBE_SAMPLE_BYTES = 256 << 10  # a probe compresses this much of its chunk, not all of it


@dataclass
class CompressionPolicy:
    """Decides per chunk whether zstd pays for itself.

    ``mode``: "none" (always raw), an int level (always try that level; a chunk that does not
    shrink is stored raw), or "auto", decided by measurement as the bundle streams:

    - the sink's cost per byte is timed on every write of 4 KiB or more (a pipe into ssh or an
      S3 upload blocks in ``write``: its speed is the link's);
    - now and then a *probe* compresses the first 256 KiB of a chunk (a sample: the cost of a
      probe on a fast disk is a sixteenth of a 4 MiB chunk's) to measure the saved fraction and
      the compressor's cost per byte: the first chunks until the sink has been measured, then
      every ``probe_every`` chunks, an interval that doubles (up to 256) each time compression
      loses, so a fast disk pays for a handful of small probes only; chunks under 4 KiB (a small
      manifest) are never probes and teach nothing; the probe chunk itself is then stored like
      any other (compressed only if that pays);
    - every other chunk is compressed only while ``saved_fraction * sink_seconds_per_byte >
      compress_seconds_per_byte``: the bytes saved must cost less to compress than to move
      (decompression on the far side is repaid likewise by its shorter read).

    A fast local disk therefore gets raw chunks; a slow link gets zstd. The choice never changes
    what a reader accepts.
    """

    mode: str | int = "auto"
    probe_every: int = 16
    level: int = ZSTD_LEVEL
    saved_fraction: float = 0.0  # latest measurements (EWMA)
    compress_s_per_byte: float = 0.0  # latest measurements (EWMA)
    sink_seconds: float = 0.0
    sink_bytes: int = 0
    _seen: int = 0  # chunks of at least MIN_MEASURED_BYTES
    measured: int = 0  # chunks whose compression was timed (each probe and each learning pack)
    _interval: int = 0
    _next_probe: int = 1
    compressor: Any = field(default=None, repr=False)  # a zstd compressor (None: one at ``level``)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)  # times the sink and the compressor

    def __post_init__(self) -> None:
        if isinstance(self.mode, int) and not isinstance(self.mode, bool):
            if not 1 <= self.mode <= 22:
                raise FormatError(f"zstd level {self.mode} outside 1..22")
            self.level = self.mode
        elif self.mode not in ("auto", "none"):
            raise FormatError(f"compression {self.mode!r}: expected auto, none or a level 1..22")
        self._interval = self.probe_every
        if self.compressor is None:
            self.compressor = zstandard.ZstdCompressor(level=self.level, write_checksum=False,
                                                       write_content_size=True)

    def note_sink(self, seconds: float, nbytes: int) -> None:
        """Account one write to the sink (short writes measure call overhead, not bandwidth)."""
        if nbytes >= MIN_MEASURED_BYTES:
            self.sink_seconds += seconds
            self.sink_bytes += nbytes

    def pays(self) -> bool:
        """Whether compressing the next chunk is expected to save more time than it costs."""
        if not self.sink_bytes or not self.measured:
            return False
        sink = self.sink_seconds / self.sink_bytes
        return self.saved_fraction * sink > self.compress_s_per_byte

    def encode(self, raw: bytes | bytearray | memoryview) -> tuple[int, bytes | bytearray | memoryview]:
        """(codec, payload) for one chunk."""
        if self.mode == "none":
            return CODEC_RAW, raw
        probe = False
        if self.mode == "auto":
            if len(raw) < MIN_MEASURED_BYTES:
                return self._pack(raw, learn=False) if self.pays() else (CODEC_RAW, raw)
            self._seen += 1
            probe = self._seen >= self._next_probe
            if not probe and not self.pays():
                return CODEC_RAW, raw
        if not probe:  # a fixed level, or auto while compression pays
            return self._pack(raw, learn=len(raw) >= MIN_MEASURED_BYTES)
        self._compress(memoryview(raw)[:PROBE_SAMPLE_BYTES], learn=True)
        if not self.sink_bytes:  # no verdict yet: probe the next chunk too
            self._next_probe = self._seen + 1
        else:
            self._interval = (self.probe_every if self.pays()
                              else min(2 * self._interval, MAX_PROBE_INTERVAL))
            self._next_probe = self._seen + self._interval
        return self._pack(raw, learn=False) if self.pays() else (CODEC_RAW, raw)

    def _pack(self, raw: bytes | bytearray | memoryview, *, learn: bool
              ) -> tuple[int, bytes | bytearray | memoryview]:
        packed = self._compress(raw, learn)
        if len(packed) >= len(raw):
            return CODEC_RAW, raw
        return CODEC_ZSTD, packed

    def _compress(self, raw: bytes | bytearray | memoryview, learn: bool) -> bytes:
        start = self.clock()
        packed = self.compressor.compress(raw)
        elapsed = self.clock() - start
        if not learn:
            return packed
        n = max(len(raw), 1)
        weight = 0.5 if self.measured else 1.0
        self.saved_fraction += weight * (max(0.0, 1.0 - len(packed) / n) - self.saved_fraction)
        self.compress_s_per_byte += weight * (elapsed / n - self.compress_s_per_byte)
        self.measured += 1
        return packed


def policy_of(compression: str | int | CompressionPolicy) -> CompressionPolicy:
    """A policy for ``compression``: a mode ("auto", "none", a level), or a policy given whole (its clock and
    compressor seams set by the caller)."""
    return compression if isinstance(compression, CompressionPolicy) else CompressionPolicy(compression)


__all__ = ["CompressionPolicy", "MIN_MEASURED_BYTES", "MAX_PROBE_INTERVAL", "PROBE_SAMPLE_BYTES", "policy_of"]

