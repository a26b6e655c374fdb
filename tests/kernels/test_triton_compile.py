"""The Triton kernels compile for real GPUs, checked without one: Triton's own compiler (and the ptxas
its wheel carries) builds them ahead of time for Hopper (sm_90) and Ampere (sm_80).

The interpreter (TRITON_INTERPRET=1, test_triton.py) runs the kernels as Python and checks their
arithmetic, but it does not type-check them: a kernel it ran bit for bit once failed to compile on an
H200 (a loop-carried value changed type). The compile runs in a fresh process, since test_triton.py
turns the interpreter on for this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")  # a test extra on Linux x86-64; no wheel elsewhere

DTYPES = ("fp32", "fp16", "bf16", "fp64")
SCRIPT = """
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from samestep.ops import triton_kernels as tk
from samestep.digests import triton_rows as dt


@triton.jit
def _retyped_loop_value(out_ptr, idx_ptr, n, TILE, BLOCK: tl.constexpr):
    cur = 0  # int32, then int64 in the loop: the mistake the interpreter let through (negative control)
    for s in range(0, n):
        t = tl.load(idx_ptr + s) // TILE
        if t != cur:
            cur = t
    tl.store(out_ptr, cur)


def signature(kernel, dtype):
    if kernel == "_fold_segments":
        return {"out_ptr": f"*{dtype}", "src_ptr": f"*{dtype}", "perm_ptr": "*i64", "rows_ptr": "*i64",
                "starts_ptr": "*i64", "D": "i32", "TILE": "i32", "BLOCK": "constexpr"}
    if kernel == "_fold_tile_into_slot":
        return {"slots_ptr": f"*{dtype}", "src_ptr": f"*{dtype}", "index_ptr": "*i64", "N": "i32", "R": "i32",
                "D": "i32", "TILE": "i32", "BLOCK": "constexpr"}
    if kernel == "_level_rows":
        return {"words_ptr": "*i16", "w_ptr": "*i64", "p_ptr": "*i64", "c_ptr": "*i64", "out_ptr": "*i64",
                "rows": "i32", "BLOCK": "constexpr", "COLS_": "constexpr", "LANES_": "constexpr"}
    return {"out_ptr": "*i64", "idx_ptr": "*i64", "n": "i32", "TILE": "i32", "BLOCK": "constexpr"}


CONSTS = {"_level_rows": {"BLOCK": dt.PROGRAM_ROWS, "COLS_": dt.COLS, "LANES_": dt.LANES}}


result = {}
for arch in (90, 80):
    for kernel, dtypes in (("_fold_segments", sys.argv[1:]), ("_fold_tile_into_slot", sys.argv[1:]),
                           ("_level_rows", ["i16"]), ("_retyped_loop_value", ["i64"])):
        fn = getattr(tk, kernel, None) or getattr(dt, kernel, None) or globals()[kernel]
        for dtype in dtypes:
            try:
                consts = CONSTS.get(kernel, {"BLOCK": 128})
                k = triton.compile(ASTSource(fn=fn, signature=signature(kernel, dtype), constexprs=consts),
                                   target=GPUTarget("cuda", arch, 32))
                result[f"sm_{arch}/{kernel}/{dtype}"] = "cubin %d bytes" % len(k.asm["cubin"])
            except Exception as e:
                result[f"sm_{arch}/{kernel}/{dtype}"] = "error: " + str(e).strip().splitlines()[-1][:300]
print(json.dumps(result))
"""


def test_kernels_compile_for_hopper_and_ampere(tmp_path):
    """The ops kernels compile to cubin for sm_90 and sm_80 in every float dtype, and so does the digest
    kernel; the same compile refuses a
    kernel with the H200's compile error (negative control), which the interpreter runs happily."""
    script = tmp_path / "compile_kernels.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # explicit (and silences Triton's warning); these kernels only add
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), *DTYPES], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = {k: v for k, v in result.items() if "_retyped_loop_value" not in k and not v.startswith("cubin")}
    assert not bad, bad
    assert len(result) == 2 * (2 * len(DTYPES) + 2)
    for arch in (90, 80):
        control = result[f"sm_{arch}/_retyped_loop_value/i64"]
        assert control.startswith("error") and "cur" in control, control
