"""Roofline vs Metis' measured layer times for OPT-350M, per profiled GPU type at micro-batch 1..8, tp 1.

Builds facebook/opt-350m's shape from ``transformers.OPTConfig`` on the meta device (hidden 1024, 24 blocks,
ffn 4096, 16 heads, vocab 50272, word_embed_proj_dim 512, post-LN, sequence 2048), captures it at batch 8
and prices each layer (``block_layers``: 0 embeddings, 1..24 blocks, 25 head + loss; forward + backward)
with the catalog's roofline at 1..8 samples, next to the profile's time (``LayerProfile``; sizes between
measured ones interpolated, marked ``~``). GPU types the catalog lacks are reported as such.

    python -m experiments.layer_profile_ratios --profiles /path/to/Metis/profiles [--dtype float16] [--json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

SEQ_LEN, MAX_MBS = 2048, 8


def build_graph(dtype: str):
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    import heterog

    cfg = OPTConfig(vocab_size=50272, hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
                    max_position_embeddings=2048, word_embed_proj_dim=512, do_layer_norm_before=False,
                    dropout=0.0, attention_dropout=0.0)
    with torch.device("meta"):
        model = OPTForCausalLM(cfg).to(getattr(torch, dtype))
    ids = torch.zeros(MAX_MBS, SEQ_LEN, dtype=torch.int64, device="meta")
    return heterog.capture(model, {"input_ids": ids, "labels": ids}, optimizer="adam", name=f"opt-350m-{dtype}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", required=True, help="Metis' profiles folder (holding OPT-350/<GPU>/...)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from heterog.baselines.expert import block_layers
    from heterog.cluster import CATALOG, load_cluster
    from heterog.cost import CostModel, LayerProfile

    lp = LayerProfile.load(args.profiles, model="OPT-350")
    graph = build_graph(args.dtype)
    layer_of, n_blocks = block_layers(graph)
    assert n_blocks + 2 == lp.num_layers, (n_blocks, lp.num_layers)
    fb = np.array([op.kind == "compute" and op.phase != "update" for op in graph.ops])
    in_catalog = [g for g in lp.gpus if lp.aliases.get(g, g) in CATALOG]
    yaml = "name: ratios\nswitch: {bandwidth: 100 Gbit/s}\nservers:\n" + "".join(
        f"  - name: s{k}\n    gpus: [{{type: {lp.aliases.get(g, g)}, count: 1}}]\n"
        f"    intra: {{kind: pcie, bandwidth: 12 GB/s, latency_us: 5}}\n"
        f"    nic: {{bandwidth: 100 Gbit/s, latency_us: 10}}\n" for k, g in enumerate(in_catalog))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "c.yaml").write_text(yaml)
        cost = CostModel(load_cluster(Path(tmp) / "c.yaml"))
    ops = np.nonzero(fb)[0]
    rows = []
    for gpu in lp.gpus:
        measured = sorted(b for g, b, t in lp.entries if g == gpu and t == 1)
        for mbs in range(1, MAX_MBS + 1):
            prof_s = lp.layer_times_s(gpu, mbs, 1.0)
            row = {"gpu": gpu, "type": lp.aliases.get(gpu, gpu), "mbs": mbs, "measured": mbs in measured,
                   "profile_block_ms": float(prof_s[1:-1].mean() * 1e3), "profile_embed_ms": float(prof_s[0] * 1e3),
                   "profile_head_ms": float(prof_s[-1] * 1e3), "profile_total_ms": float(prof_s.sum() * 1e3)}
            if gpu in in_catalog:
                d = in_catalog.index(gpu)
                t = cost.op_times(graph, ops, np.full(len(ops), d), np.full(len(ops), mbs / MAX_MBS))
                roof = np.bincount(layer_of[ops], weights=t, minlength=lp.num_layers)
                row.update(roofline_block_ms=float(roof[1:-1].mean() * 1e3), roofline_embed_ms=float(roof[0] * 1e3),
                           roofline_head_ms=float(roof[-1] * 1e3), roofline_total_ms=float(roof.sum() * 1e3))
                row["block_ratio"] = row["roofline_block_ms"] / row["profile_block_ms"]
                row["total_ratio"] = row["roofline_total_ms"] / row["profile_total_ms"]
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"OPT-350M ({args.dtype} capture), tp 1: roofline / profile per block (mean of 24) and whole model "
          f"(forward + backward of one micro-batch); ~ = interpolated or extrapolated size")
    print("| GPU | mbs | block roofline ms | block profile ms | block ratio | model roofline ms | model profile ms "
          "| model ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        mark = "" if r["measured"] else "~"
        if "block_ratio" in r:
            print(f"| {r['gpu']} | {mark}{r['mbs']} | {r['roofline_block_ms']:.2f} | {r['profile_block_ms']:.2f} | "
                  f"{r['block_ratio']:.2f} | {r['roofline_total_ms']:.1f} | {r['profile_total_ms']:.1f} | "
                  f"{r['total_ratio']:.2f} |")
        else:
            print(f"| {r['gpu']} | {mark}{r['mbs']} | n/a ({r['type']} not in catalog) | {r['profile_block_ms']:.2f} | "
                  f"| | {r['profile_total_ms']:.1f} | |")


if __name__ == "__main__":
    main()
