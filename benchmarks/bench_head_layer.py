"""The transformer head's decoder layer, hand-written (`ats.model.heads.TransformerHead`) vs transformers'
`LlamaDecoderLayer` with the same weights: does building the head on transformers' layer keep the speed (issue 23,
part 4)? And does the head's fused cached decoding step pay against the same layer decoding with transformers'
`DynamicCache`?

    python benchmarks/bench_head_layer.py --threads 1

Both arms run in the same process, interleaved, best of `--repeats`; the ratios are what to read (a shared machine
slows both arms alike). Writes benchmarks/results/head_layer.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_table import machine  # noqa: E402

SIZES = {"smollm2-135m (H 576)": 576, "qwen2.5-0.5b (H 896)": 896}


def llama_twin(head, hidden: int):
    """transformers' LlamaDecoderLayer (sdpa attention) and its rotary embedding, loaded with `head`'s weights."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    a, m = head.attn, head.mlp
    config = LlamaConfig(hidden_size=hidden, intermediate_size=m.gate_proj.out_features,
                         num_attention_heads=a.n_heads, num_key_value_heads=a.n_heads, rope_theta=10000.0,
                         rms_norm_eps=1e-6)
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.load_state_dict({
        "input_layernorm.weight": head.input_norm.weight, "post_attention_layernorm.weight": head.post_attn_norm.weight,
        "self_attn.q_proj.weight": a.q_proj.weight, "self_attn.k_proj.weight": a.k_proj.weight,
        "self_attn.v_proj.weight": a.v_proj.weight, "self_attn.o_proj.weight": a.o_proj.weight,
        "mlp.gate_proj.weight": m.gate_proj.weight, "mlp.up_proj.weight": m.up_proj.weight,
        "mlp.down_proj.weight": m.down_proj.weight}, strict=True)
    return config, layer, LlamaRotaryEmbedding(config)


def best(fns: dict, repeats: int) -> dict:
    """name -> best wall time of fn(), the arms interleaved within each repeat."""
    times = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k] = min(times[k], time.perf_counter() - start)
    return times


def measure(hidden: int, batch: int, length: int, decode_batches: tuple, past: int, repeats: int) -> dict:
    from transformers import DynamicCache

    from ats.model.heads import HeadCache, HeadConfig, build_head

    torch.manual_seed(0)
    head = build_head(HeadConfig(head_type="transformer", hidden_size=hidden))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    config, layer, rotary = llama_twin(head, hidden)
    x = torch.randn(batch, length, hidden)
    pos = torch.arange(length)[None].expand(batch, length)

    def twin_tau(h, position_ids, mask, cache=None):
        out = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary(h, position_ids),
                    cache=cache, use_cache=cache is not None)
        out = out[0] if isinstance(out, tuple) else out
        return head.proj(head.final_norm(out)).squeeze(-1)

    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    with torch.no_grad():  # the same numbers first
        err = (head(x) - twin_tau(x, pos, causal)).abs().max().item()

    def train_step(fn):
        def run():
            head.zero_grad(set_to_none=True)
            layer.zero_grad(set_to_none=True)
            fn().square().mean().backward()
        return run

    row = {"max_abs_diff": err, **{f"train_{k}": v for k, v in best({
        "ats": train_step(lambda: head(x)), "transformers": train_step(lambda: twin_tau(x, pos, causal))},
        repeats).items()}}
    for b in decode_batches:  # one cached decoding step after `past` positions
        prompt = torch.randn(b, past, hidden)
        step = torch.randn(b, 1, hidden)
        with torch.no_grad():
            cache = HeadCache()
            head(prompt, cache=cache)
            hf = DynamicCache(config=config)
            ppos = torch.arange(past)[None].expand(b, past)
            twin_tau(prompt, ppos, torch.full((past, past), float("-inf")).triu(1)[None, None], cache=hf)
            spos = torch.full((b, 1), past)

            def fused():  # the cache grows by one position a call (<= 20 over the repeats: a handicap for ats)
                head(step, torch.ones(b, cache.length + 1, dtype=torch.long), cache=cache)

            def twin():
                twin_tau(step, spos, None, cache=hf)
                hf.crop(-1)  # back to `past` positions

            times = best({"ats": fused, "transformers": twin}, repeats * 4)
        row.update({f"decode{b}_{k}": v for k, v in times.items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/head_layer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decode = (1, 16)
    rows = {name: measure(h, args.batch, args.length, decode, args.past, args.repeats) for name, h in SIZES.items()}
    lines = ["| head size | max abs diff | train step ats (s) | transformers (s) | transformers / ats | "
             + " | ".join(f"decode b{b} ats (ms) | transformers (ms) | transformers / ats" for b in decode) + " |",
             "|---|---:|---:|---:|---:|" + "---:|---:|---:|" * len(decode)]
    for name, r in rows.items():
        cells = [name, f"{r['max_abs_diff']:.1e}", f"{r['train_ats']:.3f}", f"{r['train_transformers']:.3f}",
                 f"{r['train_transformers'] / r['train_ats']:.2f}x"]
        for b in decode:
            cells += [f"{1e3 * r[f'decode{b}_ats']:.2f}", f"{1e3 * r[f'decode{b}_transformers']:.2f}",
                      f"{r[f'decode{b}_transformers'] / r[f'decode{b}_ats']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    command = "python " + " ".join(sys.argv)
    text = (f"# The head's decoder layer: hand-written vs transformers' LlamaDecoderLayer\n\nCommand: `{command}`; "
            f"machine: {machine()}. Train step: forward + backward of tau on "
            f"({args.batch}, {args.length}) hidden states; decode: one cached step after {args.past} positions "
            f"(the head's fused path with `HeadCache` vs the same layer with transformers' `DynamicCache`, cropped "
            f"back after each step). Best of {args.repeats} (decode: {4 * args.repeats}), arms interleaved.\n\n"
            + "\n".join(lines) + "\n")
    print(text)
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
