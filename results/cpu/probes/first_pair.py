# Probe: is the first timed pair of a compiled comparison special? In the waterfalls that
# settle the GPU before each timing (untimed steps of both, a full garbage collection before
# or after them, then the timed pairs), how often the incumbent's first timed call is its
# fastest, the candidate's first its slowest, the first pair's ratio (incumbent / candidate)
# the lowest of its pairs, and the fourth pair the slowest of both sides; and how often each
# would be by chance (1 in the number of pairs; 1 in its square for both sides).
#   python results/cpu/probes/first_pair.py results/h100/07_capstone_torch.json ...
import json, statistics, sys

SETTLED = sys.argv[1:]  # the waterfalls' JSONs
compared = 0
by_chance = 0.0
by_chance_both = 0.0
incumbent_fastest = 0
candidate_slowest = 0
first_lowest = 0
fourth_slowest = 0  # the fourth pair holds the slowest call of both sides
later_over_first = []  # the incumbent's later calls' median over its first, in %
for path in SETTLED:
    result = json.load(open(path))
    for row in result["rungs"]:
        candidate = row.get("step_ms")
        incumbent = row.get("incumbent_step_ms")
        settings = row["settings"]
        compiled = settings.get("compile", settings.get("jit"))
        if not candidate or not incumbent or not compiled or incumbent[0] > 1000:
            continue  # the first rung, an eager rung, or one timed against an op-by-op step
        ratios = [a / b for a, b in zip(incumbent, candidate)]
        compared += 1
        by_chance += 1 / len(ratios)
        by_chance_both += 1 / len(ratios) ** 2
        incumbent_fastest += incumbent[0] == min(incumbent)
        candidate_slowest += candidate[0] == max(candidate)
        first_lowest += ratios[0] == min(ratios)
        fourth_slowest += incumbent[3] == max(incumbent) and candidate[3] == max(candidate)
        later_over_first.append((statistics.median(incumbent[1:]) / incumbent[0] - 1) * 100)
        print(f"{path} {row['name']}: {len(ratios)} pairs, incumbent "
              f"{' '.join(f'{ms:.1f}' for ms in incumbent)}, candidate "
              f"{' '.join(f'{ms:.1f}' for ms in candidate)}, ratios "
              f"{' '.join(f'{r:.3f}' for r in ratios)}")
print(f"{compared} compiled comparisons; each count below would be {by_chance:.1f} by chance")
print(f"the incumbent's first timed call its fastest: {incumbent_fastest}")
print(f"the candidate's first timed call its slowest: {candidate_slowest}")
print(f"the first pair's ratio the lowest: {first_lowest}")
print(f"the fourth pair holds the slowest call of both sides: {fourth_slowest} "
      f"(by chance {by_chance_both:.1f})")
print(f"the incumbent's later calls (their median) over its first: median "
      f"{statistics.median(later_over_first):+.2f}% [{min(later_over_first):+.2f}%, "
      f"{max(later_over_first):+.2f}%]")
