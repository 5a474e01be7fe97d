"""Per seed: a receiver's withheld-slice pass@1 at the best-validation checkpoint (final in
brackets) and the whole test split at the best-validation checkpoint, for every arm of an
experiment (what the report averages over seeds).

    python bench/selection_by_seed.py --config bench/paper_miniature_carry.yaml --receiver qwen3
"""

from __future__ import annotations

import argparse

from graft_fed.experiment import collect_selection, load_experiment_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--receiver", required=True)
    args = ap.parse_args()
    cfg = load_experiment_config(args.config)
    best, final, whole = (collect_selection(cfg, m) for m in ("best_val/withheld", "final/withheld", "best_val/all"))
    print("| arm | peer | " + " | ".join(f"seed {s}" for s in cfg.seeds) + " |")
    print("|---|---|" + "---|" * len(cfg.seeds))
    for key in sorted(k for k in best if k[0] == args.receiver):
        cells = []
        for s in cfg.seeds:
            if s not in best[key]:
                cells.append("-")
                continue
            fin = final.get(key, {}).get(s)
            cells.append(f"{100 * best[key][s]:.1f} ({'-' if fin is None else f'{100 * fin:.1f}'}); "
                         f"all {100 * whole.get(key, {}).get(s, float('nan')):.1f}")
        print(f"| {key[2]} | {key[1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
