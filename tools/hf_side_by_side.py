#!/usr/bin/env python3
"""Hugging Face transformers on a synthetic Qwen3.6-35B-A3B slice (same shapes, random bf16
weights, N layers), timed like `qflash bench`: prefill of P tokens, then G-1 single-token decode
steps with the KV/recurrent cache. Prints one table beside qflash's numbers from a
`qflash bench --json` file. Runs where PyTorch and transformers are (the GPU machine).

  python3 tools/hf_side_by_side.py --layers 4 --prompt-len 512 --gen-len 64 --qflash out.json
"""
import argparse
import json
import statistics
import time

import torch


def make_model(layers, device, dtype):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    kinds = (["linear_attention"] * 3 + ["full_attention"]) * 10
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=layers, layer_types=kinds[:layers],
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}, tie_word_embeddings=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return model.eval()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def run(model, P, G, device, runs):
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, P), device=device)
    out = []
    for r in range(runs + 1):
        sync(device)
        t0 = time.perf_counter()
        o = model(input_ids=ids, use_cache=True)
        nxt = o.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        t1 = time.perf_counter()
        cache, itl = o.past_key_values, []
        for _ in range(G - 1):
            s0 = time.perf_counter()
            o = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            sync(device)
            itl.append(time.perf_counter() - s0)
        if r > 0:  # run 0 warms up
            out.append({"prefill_ms": (t1 - t0) * 1e3, "itl_ms": 1e3 * statistics.mean(itl) if itl else float("nan")})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--qflash", help="a qflash bench --json file of the same shapes")
    a = ap.parse_args()
    import transformers
    model = make_model(a.layers, a.device, torch.bfloat16)
    peak = torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else 0
    rs = run(model, a.prompt_len, a.gen_len, a.device, a.runs)
    pre = statistics.median(r["prefill_ms"] for r in rs)
    itl = statistics.median(r["itl_ms"] for r in rs)
    rows = [("HF transformers %s (torch %s), %s" % (transformers.__version__, torch.__version__, a.device), pre, a.prompt_len / pre * 1e3,
             itl, 1e3 / itl, itl / a.layers, peak)]
    if a.qflash:
        j = json.load(open(a.qflash))
        c = [c for c in j["configs"] if c["concurrency"] == 1][0]
        rows.append(("qflash (%s)" % j.get("device", "?"), c["prefill_ms"]["median"], c["prefill_tok_s"]["median"], c["itl_ms"]["mean"],
                     c["decode_tok_s_per_stream"]["median"], c["itl_ms"]["mean"] / j["model"]["layers"], j.get("peak_device_bytes") or 0))
        if c["prompt_len"] != a.prompt_len or j["model"]["layers"] != a.layers:
            print("note: qflash ran prompt %d, %d layers" % (c["prompt_len"], j["model"]["layers"]))
    print("synthetic Qwen3.6-35B-A3B, %d layers, prompt %d, %d tokens, batch 1, median of %d runs after 1 warm-up" % (
        a.layers, a.prompt_len, a.gen_len, a.runs))
    print("%-52s %11s %11s %9s %9s %12s %10s" % ("engine", "prefill ms", "prefill/s", "ITL ms", "tok/s", "ms/layer/tok", "peak MiB"))
    for name, p, ps, i, ts, pl, pk in rows:
        print("%-52s %11.1f %11.1f %9.3f %9.1f %12.4f %10.0f" % (name[:52], p, ps, i, ts, pl, pk / 2 ** 20))


if __name__ == "__main__":
    main()
