#!/usr/bin/env python3
"""The bundled model with its trained MTP head (tests/data/mtp) as a second shard, in a new
directory: config.json with mtp_num_hidden_layers 1, both safetensors files linked, an index naming
every tensor's file, the tokenizer linked. For `--draft` runs (tools/gpu-check.sh spec).

  tools/make_mtp_dir.py OUT
"""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "qwen36moe-code-14m")
SHARD = os.path.join(ROOT, "tests", "data", "mtp", "qwen36moe-code-14m.mtp.safetensors")


def names(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def make(out):
    """Writes the directory at out (made if missing)."""
    os.makedirs(out, exist_ok=True)
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    cfg.get("text_config", cfg)["mtp_num_hidden_layers"] = 1
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    wmap = {}
    for name, src in {"model-00001-of-00002.safetensors": os.path.join(MODEL, "model.safetensors"), "model-00002-of-00002.safetensors": SHARD}.items():
        dst = os.path.join(out, name)
        if not os.path.lexists(dst):
            os.symlink(os.path.realpath(src), dst)
        wmap.update({k: name for k in names(src)})
    json.dump({"metadata": {}, "weight_map": wmap}, open(os.path.join(out, "model.safetensors.index.json"), "w"))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src, dst = os.path.join(MODEL, f), os.path.join(out, f)
        if os.path.exists(src) and not os.path.lexists(dst):
            os.symlink(os.path.realpath(src), dst)


if __name__ == "__main__":
    make(sys.argv[1])
