"""Per-rank trace streams: the capture ladder (step, module, op), digested off the training thread.

- ``start``: ``samestep.trace(...)``, which starts a ``Recorder`` for a loop of the user's own;
- ``recorder``: the protocol (step, microbatch, grads, state, close) and the flushes;
- ``step_level``, ``module_level``, ``op_level``, ``collectives``: each level's records;
- ``staging``, ``batch``: what is staged for digesting, and a flush's records as columns;
- ``thread_worker``, ``process_worker`` (``wire``, ``process_child``), ``writer``: digests and writes;
- ``stream``: the stream format, read and written; ``selection``, ``perturb``, ``hooks``: helpers.
"""

from samestep.tracing.perturb import Perturb
from samestep.tracing.recorder import Recorder
from samestep.tracing.selection import LEVELS, WORKERS, format_selection, parse_selection
from samestep.tracing.start import trace
from samestep.tracing.stream import FORMAT, KEY, VERSION, TraceStream, read_stream, stream_path

__all__ = [
    "FORMAT",
    "KEY",
    "LEVELS",
    "VERSION",
    "WORKERS",
    "Perturb",
    "Recorder",
    "TraceStream",
    "format_selection",
    "parse_selection",
    "read_stream",
    "stream_path",
    "trace",
]
