"""The canonical reduction's exposed communication time beyond one machine, estimated (docs/layouts.md,
"Cost at scale"): an alpha-beta model of the collectives, against DDP's ring all-reduce.

    .venv/bin/python bench/cost_model.py [--grad-mb 1000] [--alpha-us 5] [--gbps 25] [--backward-ms 300]
                                         [--buckets 25] [--sum-gbps 200] [--json]

Per rank, for a gradient of B bytes cut into buckets of b bytes, W ranks, latency alpha per message and
bandwidth beta per link:
  ring all-reduce (DDP, NCCL_ALGO=Ring): 2(W-1) steps, each alpha + (b/W)/beta, per bucket;
  canonical combine: an all-to-all ((W-1) messages of b/W: (W-1)(alpha + (b/W)/beta)), the fixed-order sum
  of W chunks of b/W (b bytes read at the sum bandwidth), and an all-gather (the ring's second half).
Both send 2(W-1)/W of the gradient. DDP overlaps every bucket but the last with the backward pass. The
canonical combine after the backward (parallel.overlap=false) exposes all of it; as built (the default)
its all-to-alls start in the backward as DDP's all-reduces do, while the sums and gathers wait for the
backward's end (distributed/buckets.py: a wait inside the backward could deadlock), so they are exposed;
"whole overlap" prices every bucket's whole combine started in the backward, which is not built.
Reported: seconds exposed per step and the step-time ratio to DDP for a given backward.

    .venv/bin/python bench/cost_model.py --tp [--message-mb 64] [--layers 32] [--microbatches 8]
                                         [--nvlink-gbps 450] [--nvlink-alpha-us 3] [--chunk-cost 0.03] [--json]

With --tp, tensor parallelism within a node (docs/layouts.md, "Tensor parallelism") at TP 2, 4 and 8 x DP
8 to 4,096: every decoder layer sums an activation-sized message across the T tensor ranks four times a
microbatch (two row-parallel outputs forward, two column-parallel input gradients backward), on the
critical path for plain TP and canonical TP alike. Plain TP: a ring all-reduce, 2(T-1)(alpha + m/(T beta)).
Canonical: on 2 ranks one all-gather of the two sums (alpha + m/beta) and their sum; beyond, the all-to-all,
the fixed-order sum of T chunks and the all-gather, the ring's messages and bytes. The chunked matmuls cost
``--chunk-cost`` of the step more (a fraction; smaller GEMMs). Each tensor rank's 1/T of the gradient is
combined over the DP ranks as above (DDP's ring against the canonical combine as built).

    .venv/bin/python bench/cost_model.py --pp [--tied-mb 0] [--microbatches 8] [--json]

With --pp, P pipeline stages x DP 8 to 512 (docs/layouts.md, "Pipeline parallelism"): the activations cross
the stages alike in both; each stage's 1/P of the gradient is combined over its DP ranks (DDP's ring against
the canonical combine as built), a head tied to the embedding (``--tied-mb``) crosses once a step after the
backward in plain pipelining (Megatron's embedding all-reduce), while the canonical path sends the embedding
gradient's rows of each microbatch's tokens (``--tied-rows-mb``) as the pipeline runs, the last microbatch's
exposed; the weight goes back after the update in both; and the norm's row sums and the loss cross the stages
(latency). "receipts' gather": what rank 0's receipts of the whole state cost a step
as built (the parameters and Adam's moments from the other stages over one link), not in the ratio.

    .venv/bin/python bench/cost_model.py --ep [--expert-mb 8000] [--split-cost 0.02] [--json]

With --ep, experts spread over groups of EP 8 or 64 within DP 64 to 4,096 (docs/layouts.md, "Expert
parallelism"): the all-to-alls move the same rows in both; the shared parameters' gradient (``--grad-mb``) is
combined over every DP rank and each expert's (``--expert-mb`` over EP ranks) over its DP / EP replicas, DDP's
ring against the canonical combine; an owner runs each expert once per source rank instead of once
(``--split-cost`` of the step).
"""

from __future__ import annotations

import argparse
import json
import sys


def ring_bucket(b: float, w: int, alpha: float, beta: float) -> float:
    return 2 * (w - 1) * (alpha + b / w / beta)


def canonical_bucket(b: float, w: int, alpha: float, beta: float, sum_bw: float) -> float:
    all_to_all = (w - 1) * (alpha + b / w / beta)
    all_gather = (w - 1) * (alpha + b / w / beta)
    return all_to_all + b / sum_bw + all_gather


def _hidden(per_bucket: float, buckets: int, backward: float) -> float:
    """What is left after the backward of work started bucket by bucket in it: bucket i runs while the
    backward produces the next ones, so at least the last bucket's, and all of it if it outlasts the backward."""
    return max(per_bucket, buckets * per_bucket - backward * (buckets - 1) / buckets)


def estimate(w: int, grad: float, buckets: int, alpha: float, beta: float, sum_bw: float, backward: float) -> dict:
    b = grad / buckets
    ring, canon = ring_bucket(b, w, alpha, beta), canonical_bucket(b, w, alpha, beta, sum_bw)
    ddp_exposed = _hidden(ring, buckets, backward)
    whole = buckets * canon  # the combine after the backward, bucket after bucket
    all_to_all = (w - 1) * (alpha + b / w / beta)
    built = _hidden(all_to_all, buckets, backward) + buckets * (canon - all_to_all)  # sums and gathers after it
    full = _hidden(canon, buckets, backward)
    step = backward * 1.5  # forward + backward + optimizer, as a step of a dense decoder roughly is
    return {
        "ranks": w,
        "ddp_exposed_ms": 1e3 * ddp_exposed,
        "canonical_exposed_ms": 1e3 * whole,
        "canonical_overlapped_exposed_ms": 1e3 * built,
        "canonical_whole_overlap_exposed_ms": 1e3 * full,
        "ratio_to_ddp": (step + whole) / (step + ddp_exposed),
        "ratio_to_ddp_overlapped": (step + built) / (step + ddp_exposed),
        "ratio_to_ddp_whole_overlap": (step + full) / (step + ddp_exposed),
    }


def tp_estimate(t: int, dp: int, a: argparse.Namespace) -> dict:
    """Exposed seconds per step of plain and canonical tensor parallelism at degree ``t`` over ``dp`` data
    ranks, and the step-time ratio (see the module docstring)."""
    m, alpha, beta, hbm = a.message_mb * 1e6, a.nvlink_alpha_us * 1e-6, a.nvlink_gbps * 1e9, a.hbm_gbps * 1e9
    ring = ring_bucket(m, t, alpha, beta)
    canon = (alpha + m / beta + m / hbm) if t == 2 else canonical_bucket(m, t, alpha, beta, hbm)
    count = 4 * a.layers * a.microbatches
    dp_rows = estimate(
        dp, a.grad_mb * 1e6 / t, a.buckets, a.alpha_us * 1e-6, a.gbps * 1e9, a.sum_gbps * 1e9, a.backward_ms * 1e-3
    )
    step = a.backward_ms * 1e-3 * 1.5
    plain = count * ring + dp_rows["ddp_exposed_ms"] * 1e-3
    canonical = count * canon + dp_rows["canonical_overlapped_exposed_ms"] * 1e-3 + a.chunk_cost * step
    return {
        "tp": t,
        "dp": dp,
        "ranks": t * dp,
        "plain_tp_sums_ms": 1e3 * count * ring,
        "canonical_tp_sums_ms": 1e3 * count * canon,
        "plain_dp_exposed_ms": dp_rows["ddp_exposed_ms"],
        "canonical_dp_exposed_ms": dp_rows["canonical_overlapped_exposed_ms"],
        "plain_tp_exposed_ms": 1e3 * plain,
        "canonical_tp_exposed_ms": 1e3 * canonical,
        "ratio_to_plain_tp": (step + canonical) / (step + plain),
    }


def pp_estimate(p: int, dp: int, a: argparse.Namespace) -> dict:
    """Exposed seconds per step of plain and canonical pipeline parallelism at ``p`` stages over ``dp`` data
    ranks, and the step-time ratio (see the module docstring)."""
    alpha, beta = a.alpha_us * 1e-6, a.gbps * 1e9
    dp_rows = estimate(dp, a.grad_mb * 1e6 / p, a.buckets, alpha, beta, a.sum_gbps * 1e9, a.backward_ms * 1e-3)
    step = a.backward_ms * 1e-3 * 1.5
    tied = a.tied_mb * 1e6
    plain = dp_rows["ddp_exposed_ms"] * 1e-3 + (alpha + tied / beta if tied else 0.0)
    joins = 2 * (p - 1) * alpha  # the norm's row sums and the loss over the stages (a few KB)
    # the first stage's rows of each microbatch cross as the pipeline runs; the last microbatch's are exposed
    rows = min(tied, a.tied_rows_mb * 1e6)
    canonical = dp_rows["canonical_overlapped_exposed_ms"] * 1e-3 + (alpha + rows / beta if tied else 0.0) + joins
    receipts = (p - 1) / p * 3 * a.grad_mb * 1e6 / beta  # param + Adam's moments, 12 B a parameter, to rank 0
    return {
        "pp": p,
        "dp": dp,
        "ranks": p * dp,
        "plain_exposed_ms": 1e3 * plain,
        "canonical_exposed_ms": 1e3 * canonical,
        "ratio_to_plain_pp": (step + canonical) / (step + plain),
        "receipts_gather_ms": 1e3 * receipts,
    }


def ep_estimate(g: int, dp: int, a: argparse.Namespace) -> dict:
    """Exposed seconds per step of the usual and canonical expert parallelism, experts over groups of ``g`` of
    ``dp`` data ranks, and the step-time ratio (see the module docstring)."""
    alpha, beta, sum_bw, bwd = a.alpha_us * 1e-6, a.gbps * 1e9, a.sum_gbps * 1e9, a.backward_ms * 1e-3
    shared = estimate(dp, a.grad_mb * 1e6, a.buckets, alpha, beta, sum_bw, bwd)
    replicas = dp // g
    experts = (
        estimate(replicas, a.expert_mb * 1e6 / g, a.buckets, alpha, beta, sum_bw, bwd)
        if replicas > 1
        else {"ddp_exposed_ms": 0.0, "canonical_overlapped_exposed_ms": 0.0}
    )
    step = bwd * 1.5
    plain = (shared["ddp_exposed_ms"] + experts["ddp_exposed_ms"]) * 1e-3
    canonical = (
        shared["canonical_overlapped_exposed_ms"] + experts["canonical_overlapped_exposed_ms"]
    ) * 1e-3 + a.split_cost * step
    return {
        "ep": g,
        "dp": dp,
        "plain_exposed_ms": 1e3 * plain,
        "canonical_exposed_ms": 1e3 * canonical,
        "ratio_to_plain_ep": (step + canonical) / (step + plain),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grad-mb", type=float, default=1000.0, help="gradient bytes per step (fp32: 4 per parameter)")
    ap.add_argument("--alpha-us", type=float, default=5.0, help="latency per message")
    ap.add_argument("--gbps", type=float, default=25.0, help="bandwidth per rank, GB/s (200 Gb/s InfiniBand)")
    ap.add_argument("--backward-ms", type=float, default=300.0)
    ap.add_argument("--buckets", type=int, default=25)
    ap.add_argument("--sum-gbps", type=float, default=200.0, help="memory bandwidth of the fixed-order sum")
    ap.add_argument("--tp", action="store_true", help="tensor parallelism at TP 2-8 x DP 8-4,096")
    ap.add_argument(
        "--message-mb",
        type=float,
        default=64.0,
        help="--tp: bytes of one activation sum (bf16 tokens x hidden of a microbatch)",
    )
    ap.add_argument("--layers", type=int, default=32, help="--tp: decoder layers")
    ap.add_argument("--microbatches", type=int, default=8, help="--tp: microbatches per step and rank")
    ap.add_argument("--nvlink-gbps", type=float, default=450.0, help="--tp: bandwidth per GPU within a node")
    ap.add_argument("--nvlink-alpha-us", type=float, default=3.0, help="--tp: latency per message within a node")
    ap.add_argument("--chunk-cost", type=float, default=0.03, help="--tp: the chunked matmuls' extra, of a step")
    ap.add_argument("--hbm-gbps", type=float, default=3000.0, help="--tp: device memory bandwidth of a sum")
    ap.add_argument("--pp", action="store_true", help="pipeline parallelism at PP 2-8 x DP 8-512")
    ap.add_argument(
        "--tied-mb",
        type=float,
        default=0.0,
        help="--pp: bytes of a weight tied across the first and last stage (0: an untied head)",
    )
    ap.add_argument(
        "--tied-rows-mb",
        type=float,
        default=134.0,
        help="--pp: the tied embedding gradient's rows of a microbatch's tokens (8,192 x 4,096 x 4 B)",
    )
    ap.add_argument("--ep", action="store_true", help="expert parallelism at EP 8-64 within DP 64-4,096")
    ap.add_argument("--expert-mb", type=float, default=8000.0, help="--ep: the experts' gradient bytes, all ranks'")
    ap.add_argument(
        "--split-cost",
        type=float,
        default=0.02,
        help="--ep: each expert's GEMMs per source rank instead of one, of a step",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.pp:
        return report(
            [pp_estimate(p, dp, a) for p in (2, 4, 8) for dp in (8, 64, 512)],
            a.json,
            ["PP x DP", "exposed, plain / canonical", "ratio to plain PP", "receipts' gather"],
            lambda r: [
                f"{r['pp']} x {r['dp']}",
                f"{r['plain_exposed_ms']:.1f} / {r['canonical_exposed_ms']:.1f} ms",
                f"{r['ratio_to_plain_pp']:.3f}x",
                f"{r['receipts_gather_ms']:.0f} ms",
            ],
        )
    if a.ep:
        return report(
            [ep_estimate(g, dp, a) for g in (8, 64) for dp in (64, 512, 4096)],
            a.json,
            ["EP in DP", "exposed, usual / canonical (+ split GEMMs)", "ratio to the usual EP"],
            lambda r: [
                f"{r['ep']} in {r['dp']}",
                f"{r['plain_exposed_ms']:.1f} / {r['canonical_exposed_ms']:.1f} ms",
                f"{r['ratio_to_plain_ep']:.3f}x",
            ],
        )
    if a.tp:
        return report(
            [tp_estimate(t, dp, a) for t in (2, 4, 8) for dp in (8, 64, 512, 4096)],
            a.json,
            [
                "TP x DP",
                "TP sums, plain / canonical",
                "DP exposed, DDP / canonical",
                "exposed, plain / canonical (+ chunks)",
                "ratio to plain TP",
            ],
            lambda r: [
                f"{r['tp']} x {r['dp']}",
                f"{r['plain_tp_sums_ms']:.1f} / {r['canonical_tp_sums_ms']:.1f} ms",
                f"{r['plain_dp_exposed_ms']:.1f} / {r['canonical_dp_exposed_ms']:.1f} ms",
                f"{r['plain_tp_exposed_ms']:.1f} / {r['canonical_tp_exposed_ms']:.1f} ms",
                f"{r['ratio_to_plain_tp']:.3f}x",
            ],
        )
    rows = [
        estimate(w, a.grad_mb * 1e6, a.buckets, a.alpha_us * 1e-6, a.gbps * 1e9, a.sum_gbps * 1e9, a.backward_ms * 1e-3)
        for w in (8, 64, 512, 4096)
    ]
    return report(
        rows,
        a.json,
        [
            "ranks",
            "DDP ring exposed",
            "canonical after backward",
            "ratio to DDP",
            "canonical as built",
            "ratio",
            "whole overlap",
            "ratio",
        ],
        lambda r: [
            str(r["ranks"]),
            f"{r['ddp_exposed_ms']:.1f} ms",
            f"{r['canonical_exposed_ms']:.1f} ms",
            f"{r['ratio_to_ddp']:.3f}x",
            f"{r['canonical_overlapped_exposed_ms']:.1f} ms",
            f"{r['ratio_to_ddp_overlapped']:.3f}x",
            f"{r['canonical_whole_overlap_exposed_ms']:.1f} ms",
            f"{r['ratio_to_ddp_whole_overlap']:.3f}x",
        ],
    )


def report(rows: list[dict], as_json: bool, header: list[str], cells) -> int:
    """Prints ``rows`` as JSON, or as a markdown table of ``header`` and each row's ``cells(row)``."""
    if as_json:
        print(json.dumps(rows))
        return 0
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(cells(r)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
