"""Plot the committed fusion benchmark results (no GPU needed; needs matplotlib).

python benchmarks/plot_fusion.py      # writes benchmarks/results/fusion.png
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (name, world) in zip(axes[:2], [("fusion_op_h200x2.json", 2), ("fusion_op_h200x4.json", 4)]):
        rows = load(name)["rows"]
        for hidden, style in ((4096, "-"), (8192, "--")):
            sel = [r for r in rows if r["hidden"] == hidden]
            tokens = [r["tokens"] for r in sel]
            ax.plot(
                tokens, [r["us"]["nccl_torch"] for r in sel], "k" + style, label=f"NCCL + torch, h{hidden}"
            )
            ax.plot(
                tokens,
                [r["us"]["raw_1shot"] for r in sel],
                "C1" + style,
                label=f"raw flashinfer 1-shot, h{hidden}",
            )
            best = [min(t for t in (r["us"]["pk_1shot"], r["us"]["pk_2shot"]) if t) for r in sel]
            ax.plot(
                tokens,
                best,
                "C0" + style,
                marker="o",
                ms=3,
                label=f"passkit op (best of 1/2-shot), h{hidden}",
            )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="tokens",
            ylabel="us per call (CUDA graph)",
            title=f"all-reduce + add + RMSNorm, {world}x H200, bf16",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    e2e = load("fusion_e2e_w2.json")  # every variant in one run (format with "variants")
    for i, variant in enumerate(v for v in e2e["variants"] if v != "inductor"):
        rows = [r for r in e2e["rows"] if f"{variant}_us" in r]
        ax.plot(
            [r["tokens"] for r in rows],
            [r["inductor_us"] / r[f"{variant}_us"] for r in rows],
            f"C{i}",
            marker="o",
            label=f"TP=2 {variant}",
        )
    fp8 = load("fusion_e2e_fp8_w2.json")
    ax.plot(
        [r["tokens"] for r in fp8["rows"]],
        [r["inductor_us"] / r["allreduce_rmsnorm_us"] for r in fp8["rows"]],
        "C4",
        marker="s",
        label="TP=2 FP8 linears, allreduce_rmsnorm + quant",
    )
    old = load("fusion_e2e_w4.json")["rows"]  # the first TP=4 run: allreduce_rmsnorm, one compile
    ax.plot(
        [r["tokens"] for r in old],
        [r["speedup"] for r in old],
        "C7--",
        marker=".",
        label="TP=4 allreduce_rmsnorm (11-22)",
    )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.99, color="r", lw=0.8, ls=":", label="0.99x (never slower)")
    ax.set(
        xscale="log",
        xlabel="tokens",
        ylabel="speedup vs torch.compile as is",
        title="one step, 8-layer Llama-8B shape, H200",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = RESULTS / "fusion.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
