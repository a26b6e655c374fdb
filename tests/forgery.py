"""Checkpoints edited as a forger who knows the format would: a file changed and every digest the manifest
holds of it recomputed, and the manifest's own (tests of what catches such a checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch


def reseal(step_dir: Path, name: str, data: bytes) -> None:
    """Writes ``data`` as the checkpoint's file ``name`` and recomputes every digest the manifest holds of it,
    and the manifest's own: what a forger who knows the format does."""
    import hashlib
    import json

    from safetensors.torch import load as load_tensors

    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_bytes())
    entry = manifest["files"][name]
    entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    if "tensors" in entry:
        for key, t in load_tensors(data).items():
            h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            entry["tensors"][key] = h.hexdigest()
    reseal_manifest(step_dir, manifest)


def reseal_manifest(step_dir: Path, manifest: dict) -> None:
    import hashlib
    import json

    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    manifest["manifest_sha256"] = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def flip_a_weight(data: bytes) -> bytes:
    from safetensors.torch import load as load_tensors
    from safetensors.torch import save as save_tensors

    tensors = load_tensors(data)
    name = sorted(tensors)[0]
    t = tensors[name].clone()
    t.view(-1).view(torch.int32)[0] ^= 1
    tensors[name] = t
    return save_tensors(tensors)


def move_cursor(data: bytes) -> bytes:
    import json

    state = json.loads(data)
    state["data_cursor"]["position"] += 2
    return (json.dumps(state, indent=1, sort_keys=True) + "\n").encode()


def rewrite_receipts(path: Path, change) -> None:
    """Applies ``change(receipts)`` to a receipts file and rehashes its chain from the header's genesis: what a
    forger who knows the format does."""
    import json

    from samestep.records.receipts import read_receipts, receipt_hash

    header, receipts = read_receipts(path)
    change(receipts)
    prev = header["genesis"]
    for r in receipts:
        r["prev"] = prev
        r["hash"] = prev = receipt_hash(r)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in [header, *receipts]))
