"""A random bf16 MoE checkpoint larger than this machine's RAM, and the streamed record/emulate benchmark on it.

`python scripts/bigmodel.py write --out DIR [--layers 12] [--hidden 2048] [--experts 512]
[--moe-intermediate 512] [--top-k 10] [--shared 512] [--vocab 4096] [--shard-gb 1]` writes a
Hugging Face checkpoint shard by shard (never more than one shard in memory): Qwen2-MoE
architecture (a shared expert with its gate, like Qwen3-Next) at Qwen3-Next-80B-A3B's per-layer
expert shape by default, per-expert tensors in the usual `mlp.experts.E.{gate,up,down}_proj`
layout, a byte-level BPE tokenizer trained on the evaluation text, and `calib.txt` beside it.
12 layers are 38.6 GB: above the 24 GiB of this machine.

`python scripts/bigmodel.py bench --model DIR --text FILE [--tokens 2048] [--max-memory 8]
[--policies rule-0.15,quality-first,fetch-every-miss] [--out results.json]` runs, each in its own
process under `/usr/bin/time -f %M`: the trace recording, then the emulation of the policies;
it reports wall time, peak RSS, bytes read from the shards per token, per stage.
It is a benchmark, not a test (reports/peak_memory.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def write(a: argparse.Namespace) -> None:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerFast, Qwen2MoeConfig

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    H, E, I, heads = a.hidden, a.experts, a.moe_intermediate, 16  # noqa: E741 - the papers' name
    cfg = Qwen2MoeConfig(vocab_size=a.vocab, hidden_size=H, num_hidden_layers=a.layers, num_attention_heads=heads,
                         num_key_value_heads=2, intermediate_size=4 * H, moe_intermediate_size=I, num_experts=E,
                         num_experts_per_tok=a.top_k, shared_expert_intermediate_size=a.shared, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, dtype="bfloat16")
    cfg.save_pretrained(out)
    g = torch.Generator().manual_seed(a.seed)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    hd = H // heads
    tensors: list[tuple[str, object]] = [("model.embed_tokens.weight", lambda: rnd(a.vocab, H, std=1.0))]
    for lay in range(a.layers):
        p = f"model.layers.{lay}."
        tensors += [(p + "input_layernorm.weight", lambda: torch.ones(H, dtype=torch.bfloat16)),
                    (p + "post_attention_layernorm.weight", lambda: torch.ones(H, dtype=torch.bfloat16)),
                    (p + "self_attn.q_proj.weight", lambda: rnd(heads * hd, H, std=H ** -0.5)),
                    (p + "self_attn.q_proj.bias", lambda: torch.zeros(heads * hd, dtype=torch.bfloat16)),
                    (p + "self_attn.k_proj.weight", lambda: rnd(2 * hd, H, std=H ** -0.5)),
                    (p + "self_attn.k_proj.bias", lambda: torch.zeros(2 * hd, dtype=torch.bfloat16)),
                    (p + "self_attn.v_proj.weight", lambda: rnd(2 * hd, H, std=H ** -0.5)),
                    (p + "self_attn.v_proj.bias", lambda: torch.zeros(2 * hd, dtype=torch.bfloat16)),
                    (p + "self_attn.o_proj.weight", lambda: rnd(H, heads * hd, std=(heads * hd) ** -0.5)),
                    (p + "mlp.gate.weight", lambda: rnd(E, H, std=3 * H ** -0.5)),  # a spread router
                    (p + "mlp.shared_expert_gate.weight", lambda: rnd(1, H, std=H ** -0.5)),
                    (p + "mlp.shared_expert.gate_proj.weight", lambda: rnd(a.shared, H, std=H ** -0.5)),
                    (p + "mlp.shared_expert.up_proj.weight", lambda: rnd(a.shared, H, std=H ** -0.5)),
                    (p + "mlp.shared_expert.down_proj.weight", lambda: rnd(H, a.shared, std=a.shared ** -0.5))]
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            tensors += [(q + "gate_proj.weight", lambda: rnd(I, H, std=H ** -0.5)),
                        (q + "up_proj.weight", lambda: rnd(I, H, std=H ** -0.5)),
                        (q + "down_proj.weight", lambda: rnd(H, I, std=I ** -0.5))]
    tensors += [("model.norm.weight", lambda: torch.ones(H, dtype=torch.bfloat16)),
                ("lm_head.weight", lambda: rnd(a.vocab, H, std=H ** -0.5))]
    limit = int(a.shard_gb * 1e9)
    shard: dict[str, torch.Tensor] = {}
    size, names, weight_map, total = 0, [], {}, 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(names) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            names.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for key, make in tqdm(tensors, desc="write", unit="tensor", miniters=max(1, len(tensors) // 200)):
        t = make()
        nb = t.numel() * t.element_size()
        if size + nb > limit:
            flush()
        shard[key] = t
        size += nb
        total += nb
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}, indent=1))
    text = Path(a.text).read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text[i : i + 4096] for i in range(0, len(text), 4096)],
                            trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    (out / "calib.txt").write_text(text[len(text) // 2 :][:200_000])
    print(f"{out}: {total / 1e9:.1f} GB in {len(names)} shards")


def bench(a: argparse.Namespace) -> None:
    stages = [("record", [sys.executable, "-m", "runtime.record", "--model", a.model, "--text", a.text, "--out",
                          str(Path(a.work) / "trace.parquet"), "--max-tokens", str(a.tokens), "--max-memory",
                          str(a.max_memory), "--depth", str(a.depth)]),
              ("emulate", [sys.executable, "-m", "runtime.emulate", "--model", a.model, "--text", a.text,
                           "--max-tokens", str(a.tokens), "--max-memory", str(a.max_memory), "--json",
                           "--calib-max-tokens", str(a.tokens), "--batch-windows", str(a.batch_windows),
                           *[x for p in a.policies.split(",") for x in ("--policy", p)]])]
    wanted = a.stages.split(",")
    if bad := sorted(set(wanted) - {n for n, _ in stages}):
        sys.exit(f"bigmodel bench: --stages {a.stages!r}: unknown stage {bad[0]!r} (record, emulate)")
    stages = [(n, c) for n, c in stages if n in wanted]
    weights = sum(f.stat().st_size for f in Path(a.model).glob("*.safetensors"))
    rows = []
    for name, cmd in stages:
        t0 = time.perf_counter()
        r = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KB %M", *cmd], capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(f"bigmodel bench: {name} failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
        peak = int(next(ln for ln in r.stderr.splitlines() if ln.startswith("PEAK_RSS_KB")).split()[1])
        passes = 1 if name == "record" else 2  # the emulation: the warm-start calibration, then one pass for all
        row = {"stage": name, "wall_s": round(wall, 1), "peak_rss_GiB": round(peak / 2**20, 2),
               "checkpoint_GB": round(weights / 1e9, 2), "passes": passes,
               "bytes_read_per_token": round(passes * weights / a.tokens)}
        if name == "emulate":
            res = json.loads(r.stdout)
            res = res if "perplexity" not in res else {a.policies: res}
            row["policies"] = {k: {"ppl_change_pct": round(v["ppl_change_pct"], 3), "fetches": v["fetches"],
                                   "substitutions": v["substitutions"], "seconds": round(v["seconds"], 1),
                                   "streamed": v["streamed"]} for k, v in res.items()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        Path(a.out).write_text(json.dumps({"tokens": a.tokens, "max_memory_GiB": a.max_memory, "stages": rows}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--out", required=True)
    w.add_argument("--text", default=str(ROOT / "tests" / "data" / "kernel_source.txt"), help="tokenizer training text (and calib.txt)")
    for flag, default in (("--layers", 12), ("--hidden", 2048), ("--experts", 512), ("--moe-intermediate", 512),
                          ("--top-k", 10), ("--shared", 512), ("--vocab", 4096), ("--seed", 0)):
        w.add_argument(flag, type=int, default=default)
    w.add_argument("--shard-gb", type=float, default=1.0)
    b = sub.add_parser("bench")
    b.add_argument("--model", required=True)
    b.add_argument("--text", required=True)
    b.add_argument("--tokens", type=int, default=2048)
    b.add_argument("--depth", type=int, default=64)
    b.add_argument("--batch-windows", type=int, default=8)
    b.add_argument("--max-memory", type=float, default=8.0)
    b.add_argument("--policies", default="rule-0.15,quality-first,fetch-every-miss")
    b.add_argument("--stages", default="record,emulate", help="comma list of the stages to run")
    b.add_argument("--work", default="/tmp")
    b.add_argument("--out", default=None)
    a = p.parse_args()
    write(a) if a.cmd == "write" else bench(a)


if __name__ == "__main__":
    main()
