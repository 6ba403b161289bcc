# Probe: the verdicts of every committed waterfall made under the keep rule as it was (every
# per-pair ratio above 1; its rows have no "ratio_set_aside") decided again from their raw
# step times by the rule as it is now (the same, with the pair whose two calls took longest
# together set aside from 6 pairs on). Prints each comparison the new rule sets a pair aside
# in, and every verdict that changes.
#   python results/cpu/probes/redecide_rungs.py
import glob, json, statistics

SET_ASIDE_FROM = 6
compared = 0
set_aside = 0
changed = 0
for path in sorted(glob.glob("results/*/07_capstone_*.json")):
    result = json.load(open(path))
    for row in result.get("rungs", []):
        if not row.get("ratios") or "timed against" in row.get("verdict", ""):
            continue
        if "ratio_set_aside" in row:  # decided by the new rule already
            continue
        compared += 1
        ratios = [a / b for a, b in zip(row["incumbent_step_ms"], row["step_ms"])]
        old = min(ratios) > 1
        new = old
        if len(ratios) >= SET_ASIDE_FROM:
            set_aside += 1
            totals = [a + b for a, b in zip(row["incumbent_step_ms"], row["step_ms"])]
            slowest = totals.index(max(totals))
            new = min(ratios[:slowest] + ratios[slowest + 1:]) > 1
            print(f"{path} {row['name']}: pair {slowest + 1} set aside "
                  f"(ratio {ratios[slowest]:.3f}), kept {old} -> {new}")
        if new != old:
            changed += 1
            print(f"  CHANGED: median {statistics.median(ratios):.3f}, ratios "
                  f"{[round(r, 3) for r in ratios]}")
print(f"{compared} comparisons, {set_aside} with {SET_ASIDE_FROM} pairs or more, "
      f"{changed} verdicts changed")
