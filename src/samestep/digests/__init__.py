"""The tensor digest: an order-sensitive hash whose bits do not depend on the device, the thread
count or the reduction order (docs/digest.md, with test vectors). The ground floor: it imports nothing
else of samestep.

- ``spec``: the constants, weights, header and final hash that define it;
- ``rows``: the first level on a device (float64 or int8 matrix products, or the Triton kernel);
- ``triton_rows``: that kernel, for GPUs;
- ``lanes``: many tensors at once, and ``digest``/``digest_many``.
"""

from samestep.digests.lanes import Packed, digest, digest_many, lanes_many, lanes_packed, pack_into
from samestep.digests.spec import ROW_BYTES, VERSION, finish, header, rows_of

__all__ = [
    "ROW_BYTES",
    "VERSION",
    "Packed",
    "digest",
    "digest_many",
    "finish",
    "header",
    "lanes_many",
    "lanes_packed",
    "pack_into",
    "rows_of",
]
