# Probe: does torch take the allocator's expandable segments when PYTORCH_ALLOC_CONF is set
# after `import torch` but before the first CUDA tensor, as the torch capstone sets it?
# Three fresh processes: the setting before the import, after it, and not at all. Each
# allocates 256 MiB twice and prints its segments as the memory snapshot gives them.
#   python .probes/allocator_setting.py
import subprocess, sys

CHILD = """
import os, sys
if sys.argv[1] == "before":
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
import torch
if sys.argv[1] == "after":
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
a = torch.empty(2**26, device="cuda")
b = torch.empty(2**26, device="cuda")
segments = torch.cuda.memory_snapshot()
print(sys.argv[1], "torch", torch.__version__, "segments", len(segments))
for s in segments:
    print("   ", {k: s.get(k) for k in ("total_size", "segment_type", "is_expandable")})
"""

for when in ("before", "after", "unset"):
    subprocess.run([sys.executable, "-c", CHILD, when], check=True)
