"""Random checkpoints of two families for the throughput benchmark: a Mixtral (MoE) and a sliding-window Mistral.

Tiny but not toy-sized (a few hundred MB of float32 weights), seeded, saved
with transformers' `save_pretrained`, with the default model's tokenizer and
vocabulary (49152) copied in so that pagedkv and vLLM run them as they run
any checkpoint folder:

  mixtral         8 layers, hidden 512, 8 experts of width 1024, top-2, 8/2 heads of 64   (~0.5 GB fp32)
  mistral-window  12 layers, hidden 576, MLP 1536, 9/3 heads of 64, every layer slides with window 256

Usage:
    python3 bench/family_checkpoints.py mixtral OUT_DIR
    python3 bench/bench_throughput.py --model OUT_DIR --systems pagedkv,vllm --out bench/results/OUT.md
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

FAMILIES = ("mixtral", "mistral-window")
WINDOW = 256


def _config(family: str):
    import transformers as T

    common = dict(vocab_size=49152, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=True, initializer_range=0.05, rms_norm_eps=1e-5)
    if family == "mixtral":
        cfg = T.MixtralConfig(**common, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                              num_experts_per_tok=2, sliding_window=None)
        return T.MixtralForCausalLM, cfg
    if family == "mistral-window":
        cfg = T.MistralConfig(**common, hidden_size=576, intermediate_size=1536, num_hidden_layers=12,
                              num_attention_heads=9, num_key_value_heads=3, head_dim=64, sliding_window=WINDOW)
        return T.MistralForCausalLM, cfg
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def write_checkpoint(family: str, out: Path, seed: int = 0) -> Path:
    """Writes the random `family` checkpoint (and the default model's tokenizer) to `out`; returns `out`."""
    from pagedkv.model.default_model import ensure_default_model

    cls, cfg = _config(family)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    source = Path(ensure_default_model())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", choices=FAMILIES)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    path = write_checkpoint(args.family, args.out, args.seed)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"{args.family}: {path} ({size / 2**20:.0f} MiB of weights)")


if __name__ == "__main__":
    main()
