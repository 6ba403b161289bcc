# One GPU, back to back: what torch's allocator is set to, the torch capstone's default
# waterfall (its allocator in expandable segments, each rung sized beside the next rung's
# weights and moments), nanoGPT's own bench.py at the capstones' batch, then the torch
# capstone as a 12 GiB card.
#   bash results/calls/2026-12-07_gpu_capstone_torch_default_and_12gb.sh
# nanoGPT (github.com/karpathy/nanoGPT: bench.py, model.py, configurator.py at the commit in
# .nanogpt/COMMIT) is brought beside the repository, not into it.
source results/calls/gpu_lib.sh
machine capstone_torch
C=$R/$CARD
M=$R/${CARD}_12gb
run $CARD/probes/allocator_setting 30 python3 -c "
import os, torch
os.environ['PYTORCH_ALLOC_CONF'] = 'expandable_segments:True'  # after import, as 07 does
x = torch.empty(2**28, device='cuda')
print('set after import torch:', torch._C._accelerator_getAllocatorSettings())
print('segments:', [s.get('segment_type', '?') for s in torch.cuda.memory_snapshot()])"
run $CARD/07_capstone_torch $(left 230) python3 07_capstone_torch.py --out $C --json $C/07_capstone_torch.json
repack capstone_torch
(cd .nanogpt && run $CARD/probes/nanogpt_bench_batch64 $(left 280) python3 bench.py --batch_size=64 --real_data=False --compile=True)
repack capstone_torch
run ${CARD}_12gb/07_capstone_torch $(left 575) python3 07_capstone_torch.py --memory-gb 12 --out $M --json $M/07_capstone_torch.json
repack capstone_torch
grep -h "rc=\|Traceback\|Error" $R/*/*.txt $R/*/*/*.txt | head -20
