# Probe: where our ring all-reduce (05_ddp_scratch.ring_all_reduce) loses to NCCL's over
# NVLink at 64 MiB - 1 GiB on 2 ranks: the wire (two send/recv exchanges of S/2), the add, and
# piece sizes; run under NCCL environment variants by the calling script (one torchrun each).
import importlib.util, os, statistics, sys, time
sys.path.insert(0, ".")
import torch, torch.distributed as dist

spec = importlib.util.spec_from_file_location("l05", "05_ddp_scratch.py")
l05 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(l05)
local = int(os.environ["LOCAL_RANK"])
dev = torch.device("cuda", local)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
rank, world = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % world, (rank - 1) % world

def timed(fn, reps=20, warmup=5):  # host clock, synchronised: the slowest rank's median
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    v = torch.tensor([statistics.median(times), min(times)], device=dev, dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return v.tolist()

def wait(reqs):
    for r in reqs:
        r.wait()

label = os.environ.get("PROBE_LABEL", "default")
for mib in (64, 256, 1024):
    n = mib * 2**20 // 4
    x = torch.zeros(n, device=dev)  # values do not change the time; sums never overflow
    half_a, half_b = torch.empty(n // 2, device=dev), torch.empty(n // 2, device=dev)
    rows = {"library": lambda: dist.all_reduce(x)}
    for piece in (None, 256, 128, 64, 32):
        pb = 2**62 if piece is None else piece * 2**20
        rows[f"ring pieces {piece or 'none'} MiB"] = lambda pb=pb: l05.ring_all_reduce(x, pb)
    rows["wire: 2 exchanges of S/2"] = lambda: [wait(l05.exchange(half_a, right, half_b, left))
                                                 for _ in range(2)]
    rows["1 exchange of S/2"] = lambda: wait(l05.exchange(half_a, right, half_b, left))
    rows["add of S/2"] = lambda: half_a.add_(half_b)
    lib = None
    for name, fn in rows.items():
        med, best = timed(fn)
        lib = lib or med
        if rank == 0:
            print(f"{label:28s} {mib:5d} MiB  {name:26s} {med * 1e3:7.3f} ms (min {best * 1e3:7.3f})"
                  f"  algbw {mib * 2**20 / med / 1e9:6.1f} GB/s  library/this {lib / med:5.1%}",
                  flush=True)
    del x, half_a, half_b
    torch.cuda.empty_cache()
dist.destroy_process_group()
