"""What Google's side of the simulated Drive holds, seen directly (not through nbresume).

A checkpoint has *landed* when its folder on the cloud holds a manifest that parses and every
file the manifest names, with the manifest's size and hash: exactly what a fresh VM would
download and verify. Written from the format's specification with plain ``json``, ``hashlib`` and
``xxhash``, so that it cannot agree with nbresume merely by sharing its code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import xxhash
from colab_standin.cloud import Cloud


def landed(cloud: Cloud, parts: Sequence[str]) -> dict[int, bool]:
    """{step: landed} for every step folder below ``parts`` on the cloud (not in the trash)."""
    out: dict[int, bool] = {}
    for run in cloud.find("/".join(parts)):
        for folder in cloud.children(run.id, trashed=False):
            if folder.is_folder and folder.name.isdigit():
                out[int(folder.name)] = out.get(int(folder.name), False) or _complete(
                    cloud, folder.id
                )
    return out


def _complete(cloud: Cloud, folder_id: str) -> bool:
    files = {i.name: i for i in cloud.children(folder_id, trashed=False) if not i.is_folder}
    if "manifest.json" not in files:
        return False
    try:
        manifest = json.loads(cloud.read(files["manifest.json"]))
        listed = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return False
    for name, entry in listed.items():
        item = files.get(name)
        if item is None or item.size != entry["size"]:
            return False
        data = cloud.read(item)
        if "sha256" in entry:
            digest, recorded = hashlib.sha256(data).hexdigest(), entry["sha256"]
        else:
            digest, recorded = xxhash.xxh3_128(data).hexdigest(), entry.get("xxh3-128")
        if digest != recorded:
            return False
    return True
