"""Does a 128-token prefill chunk hide under a decode step? Measured kernels and the cost model.

Chunked prefill (Sarathi-Serve) rests on a decode step being memory-bound: its
projections read every weight for a handful of tokens, so a prefill chunk added
to the step should ride on the same weight reads. Under a hard `max(memory,
compute)` roofline (`roofline_max`) that is exact until the chunk's FLOPs pass
the weight reads; real kernels do not run at the roofline's corner. This prints,
for a decode step of B sequences (B = 8, 32, 128) and the same step with one
128-token chunk added (B + 128 tokens):

1. one decoder layer's token-wise kernels (norms, QKV, rope, output projection,
   MLP, residual adds: every kernel but attention) as Vidur measured them
   (`<gpu>_<model>_mlp.csv`, tensor parallel 1, the rows at B and B + 128 tokens)
   and as the per-operation roofline prices the same kernels;
2. a whole step at decode context C (512 and 2,048 tokens; the chunk is a prompt's
   tokens C - 127..C, attending to C): the measured layers times the layer count
   plus the cost model's attention, embedding, final norm, LM head and step
   overhead (attention is not in the files); the cost model's `per_op` step
   (priced ragged: real tokens only); and its `roofline_max` step.

    python benchmarks/chunk_under_decode.py [--profiles=DIR]

Raw output: benchmarks/results/chunk_under_decode.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from orca_jax.sim import cost_model, kernel_profiles
from orca_jax.sim.kernel_profiles import LayerProfile

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT.parent / "shared" / "profiles" / "vidur_a100_h100"
CHUNK = 128
BATCHES = (8, 32, 128)
CONTEXTS = (512, 2048)
# (Vidur's file, the model preset, the hardware preset it was measured on)
CASES = (("a100_llama-2-7b_mlp.csv", "llama2-7b", "a100-80gb"),
         ("a100_meta-llama-3-8b_mlp.csv", "llama3-8b", "a100-80gb"),
         ("h100_llama-2-7b_mlp.csv", "llama2-7b", "h100-sxm"))
# Vidur's kernels of one layer, with launches per layer (two residual adds).
LAYER_OPS = {"input_layernorm": 1, "attn_pre_proj": 1, "attn_rope": 1, "attn_post_proj": 1,
             "post_attention_layernorm": 1, "mlp_up_proj": 1, "mlp_act": 1,
             "mlp_down_proj": 1, "add": 2}
# The roofline's kinds of those kernels (its `norm` also counts the final norm).
LAYER_KINDS = ("qkv_proj", "rope", "attn_out_proj", "mlp_up_proj", "mlp_act", "mlp_down_proj",
               "residual_add")


def measured_layer_s(profile: LayerProfile, num_tokens: int) -> float:
    """Seconds of one layer's measured token-wise kernels at `num_tokens` (a measured row)."""
    total = 0.0
    for times in profile.ops:
        if times.tp == 1 and times.op in LAYER_OPS:
            row = np.flatnonzero(times.num_tokens == num_tokens)
            if row.size == 0:
                raise ValueError(f"{profile.name}: no row at {num_tokens} tokens")
            total += LAYER_OPS[times.op] * float(times.seconds[row[0]])
    return total


def modelled_layer_s(profile: LayerProfile, num_tokens: int) -> float:
    """The same kernels as the per-operation roofline prices them."""
    tokens = np.array([num_tokens], np.int64)
    return sum(count * float(kernel_profiles.predicted_seconds(
        profile.model, profile.hardware, 1, op, tokens)[0]) for op, count in LAYER_OPS.items())


def step_lengths(batch: int, context: int, chunk: bool) -> tuple[np.ndarray, np.ndarray]:
    """`(q_lens, kv_lens)` of B decodes at `context`, plus the chunk if asked."""
    q = np.ones(batch, np.int64)  # [B]
    k = np.full(batch, context, np.int64)  # [B]
    if chunk:
        q, k = np.append(q, CHUNK), np.append(k, context)
    return q, k


def hybrid_step_s(config: cost_model.CostModelConfig, profile: LayerProfile, batch: int,
                  context: int, chunk: bool) -> float:
    """A step with the measured layers and the cost model's attention, head and overhead."""
    q, k = step_lengths(batch, context, chunk)
    layers = config.model_config.num_layers
    parts = config.per_op_roofline.breakdown(q, k)
    modelled_layers = (sum(parts[kind] for kind in LAYER_KINDS)
                       + parts["norm"] * 2 * layers / (2 * layers + 1))
    step = cost_model.roofline_seconds(config, q, k)
    return step - modelled_layers + layers * measured_layer_s(profile, int(q.sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, default=PROFILES,
                        help="Vidur's profiles (default: ../shared/profiles/vidur_a100_h100)")
    args = parser.parse_args()
    if not args.profiles.is_dir():
        print(f"--profiles={args.profiles}: no such folder (Vidur's files: see "
              "docs/calibration.md)", file=sys.stderr)
        sys.exit(2)
    print(f"one decoder layer's token-wise kernels (no attention), tp 1: B decodes vs B + "
          f"{CHUNK} tokens (a {CHUNK}-token chunk added)")
    print(f"{'gpu, file':34s} {'B':>4s} {'measured us':>12s} {'+chunk us':>10s} {'ratio':>6s}"
          f" {'model us':>9s} {'+chunk us':>10s} {'ratio':>6s}")
    for file, _, _ in CASES:
        profile = kernel_profiles.load_layer_profile(args.profiles / file)
        for batch in BATCHES:
            m0, m1 = measured_layer_s(profile, batch), measured_layer_s(profile, batch + CHUNK)
            p0, p1 = modelled_layer_s(profile, batch), modelled_layer_s(profile, batch + CHUNK)
            print(f"{profile.name:34s} {batch:4d} {m0 * 1e6:12.0f} {m1 * 1e6:10.0f} "
                  f"{m1 / m0:6.2f} {p0 * 1e6:9.0f} {p1 * 1e6:10.0f} {p1 / p0:6.2f}")
    print(f"\nwhole step (ms) at decode context C, B decodes vs the same plus one {CHUNK}-token "
          "chunk: measured layers + modelled attention/head/overhead ('measured'), the cost "
          "model's per_op step (ragged), its roofline_max step")
    print(f"{'model @ gpu':22s} {'B':>4s} {'C':>5s} {'measured':>9s} {'+chunk':>7s} {'ratio':>6s}"
          f" {'per_op':>7s} {'+chunk':>7s} {'ratio':>6s} {'max':>6s} {'+chunk':>7s} {'ratio':>6s}")
    for file, model, hardware in CASES:
        profile = kernel_profiles.load_layer_profile(args.profiles / file)
        per_op = cost_model.CostModelConfig(model=model, hardware=hardware)
        hard_max = dataclasses.replace(per_op, mode="roofline_max")
        for batch in BATCHES:
            for context in CONTEXTS:
                h0, h1 = (hybrid_step_s(per_op, profile, batch, context, c) for c in (False, True))
                s0, s1 = (cost_model.roofline_seconds(per_op, *step_lengths(batch, context, c))
                          for c in (False, True))
                x0, x1 = (cost_model.roofline_seconds(hard_max, *step_lengths(batch, context, c))
                          for c in (False, True))
                print(f"{model + ' @ ' + hardware:22s} {batch:4d} {context:5d} {h0 * 1e3:9.2f} "
                      f"{h1 * 1e3:7.2f} {h1 / h0:6.2f} {s0 * 1e3:7.2f} {s1 * 1e3:7.2f} "
                      f"{s1 / s0:6.2f} {x0 * 1e3:6.2f} {x1 * 1e3:7.2f} {x1 / x0:6.2f}")


if __name__ == "__main__":
    main()
