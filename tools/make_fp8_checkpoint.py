#!/usr/bin/env python3
"""Converts a bf16 Qwen3.5/3.6 MoE checkpoint to the block-FP8 layout of the official
Qwen3.6-35B-A3B-FP8 release, as published descriptions give it: the linear weights of the
routed experts (per expert), the shared expert, attention (q/k/v/o) and DeltaNet (in_proj_qkv,
in_proj_z, out_proj) become F8_E4M3 with one `<name>_scale_inv` per 128 x 128 block
(w ~= e4m3 * scale_inv); the router, the shared-expert gate, DeltaNet's A_log / conv1d / dt_bias /
in_proj_a / in_proj_b / norm, every norm, the embeddings and lm_head stay as they are. config.json
gains a quantization_config (quant_method fp8, e4m3, weight_block_size [128, 128]).

Standard library only (no numpy): meant for the small test checkpoints qflash's FP8 loader is
tested on, e.g.

  tools/make_fp8_checkpoint.py tests/data/qwen35moe-tiny tests/data/qwen35moe-tiny-fp8

e4m3 here is the OCP "fn" variant (largest 448, no infinities), rounded to nearest even and
saturated, as qflash's src/base/quant.c encodes it. A block's scale_inv is its largest |w| / 448,
rounded to the scale's dtype first, so that what is stored dequantises exactly as it is read.
"""
import argparse
import json
import math
import os
import re
import shutil
import struct

FP8_NAMES = re.compile(r"\.(mlp\.experts\.\d+\.(gate|up|down)_proj|mlp\.shared_expert\.(gate|up|down)_proj|"
                       r"self_attn\.(q|k|v|o)_proj|linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj))\.weight$")
BLOCK = 128


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    return header, data, meta


def bf16_to_floats(raw):
    return [struct.unpack("<f", b"\x00\x00" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]


def f32_to_bf16_bits(x):
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    u += 0x7FFF + ((u >> 16) & 1)  # to nearest even
    return (u >> 16) & 0xFFFF


def bf16_bits_to_f32(b):
    return struct.unpack("<f", struct.pack("<I", b << 16))[0]


def to_e4m3(x):
    if math.isnan(x):
        return 0x7F
    s = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a >= 448.0:
        return s | 0x7E
    if a < 2.0 ** -6:
        return s | int(round(a * 2.0 ** 9))  # round(): to nearest even
    m, e = math.frexp(a)
    q = int(round(m * 16))
    if q == 16:
        q, e = 8, e + 1
    return s | ((e - 1 + 7) << 3) | (q & 7)


def convert(name, info, data, scale_dtype):
    rows, cols = info["shape"]
    start, end = info["data_offsets"]
    raw = data[start:end]
    if info["dtype"] == "BF16":
        w = bf16_to_floats(raw)
    elif info["dtype"] == "F32":
        w = list(struct.unpack("<%df" % (rows * cols), raw))
    else:
        raise SystemExit("%s: dtype %s cannot be converted" % (name, info["dtype"]))
    br, bc = (rows + BLOCK - 1) // BLOCK, (cols + BLOCK - 1) // BLOCK
    scales = []
    for i in range(br):
        for j in range(bc):
            amax = max((abs(w[r * cols + c]) for r in range(i * BLOCK, min(rows, (i + 1) * BLOCK))
                        for c in range(j * BLOCK, min(cols, (j + 1) * BLOCK))), default=0.0)
            s = amax / 448.0 if amax > 0 else 1.0
            if scale_dtype == "BF16":
                s = bf16_bits_to_f32(f32_to_bf16_bits(s))
            scales.append(s)
    q = bytes(to_e4m3(w[r * cols + c] / scales[(r // BLOCK) * bc + c // BLOCK]) for r in range(rows) for c in range(cols))
    if scale_dtype == "BF16":
        sraw = b"".join(struct.pack("<H", f32_to_bf16_bits(s)) for s in scales)
    else:
        sraw = struct.pack("<%df" % len(scales), *scales)
    return q, [br, bc], sraw


def write_safetensors(path, tensors, meta):
    header, blobs, at = {}, [], 0
    if meta:
        header["__metadata__"] = meta
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--scale-dtype", choices=["bf16", "f32"], default="bf16")
    a = ap.parse_args()
    scale_dtype = a.scale_dtype.upper()
    header, data, meta = read_safetensors(os.path.join(a.src, "model.safetensors"))
    os.makedirs(a.out, exist_ok=True)
    out, n_fp8 = [], 0
    for name, info in header.items():
        start, end = info["data_offsets"]
        if FP8_NAMES.search(name) and len(info["shape"]) == 2:
            q, sshape, sraw = convert(name, info, data, scale_dtype)
            out.append((name, "F8_E4M3", info["shape"], q))
            out.append((name + "_scale_inv", scale_dtype, sshape, sraw))
            n_fp8 += 1
        else:
            out.append((name, info["dtype"], info["shape"], data[start:end]))
    write_safetensors(os.path.join(a.out, "model.safetensors"), out, meta)
    with open(os.path.join(a.src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                  "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "linear_attn.in_proj_a",
                                                             "linear_attn.in_proj_b", "linear_attn.conv1d", "model.visual"]}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(a.src, extra)):
            shutil.copy(os.path.join(a.src, extra), os.path.join(a.out, extra))
    print("%s: %d weights in FP8 (scales %s), %d tensors" % (a.out, n_fp8, scale_dtype, len(out)))


if __name__ == "__main__":
    main()
