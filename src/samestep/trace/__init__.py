"""Tensor digests and per-rank trace streams (the capture ladder: step, module, op)."""

from samestep.trace.digest import digest, digest_many
from samestep.trace.recorder import LEVELS, WORKERS, Perturb, Recorder, parse_selection, trace
from samestep.trace.stream import FORMAT, KEY, VERSION, TraceStream, read_stream, stream_path

__all__ = ["FORMAT", "KEY", "LEVELS", "VERSION", "WORKERS", "Perturb", "Recorder", "TraceStream", "digest",
           "digest_many", "parse_selection", "read_stream", "stream_path", "trace"]
