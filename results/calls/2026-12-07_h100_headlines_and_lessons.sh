# One GPU, after the capstones' default runs (their final rungs are read from the same
# folder): both headlines, then lessons 01-05 at their default sizes, 04 also as a 24 GiB
# and a 12 GiB card.
#   bash results/calls/2026-12-07_gpu_headlines_and_lessons.sh
source results/calls/gpu_lib.sh
machine lessons
C=$R/$CARD
cp -r results/$CARD/. $C/ 2>/dev/null  # the final rungs the default runs wrote
run $CARD/07_capstone_torch_headline $(left 130) python3 07_capstone_torch.py --headline --out $C --json $C/07_capstone_torch_headline.json
repack lessons
run $CARD/07_capstone_jax_headline $(left 260) python3 07_capstone_jax.py --headline --out $C --json $C/07_capstone_jax_headline.json
repack lessons
run $CARD/01_roofline $(left 300) python3 01_roofline.py --out $C --json $C/01_roofline.json
run $CARD/02_hardware $(left 350) python3 02_hardware.py --out $C --json $C/02_hardware.json
run $CARD/03_compile $(left 400) python3 03_compile.py --out $C --json $C/03_compile.json
repack lessons
run $CARD/04_memory $(left 460) python3 04_memory.py --out $C --json $C/04_memory.json
run ${CARD}_24gb/04_memory $(left 510) python3 04_memory.py --memory-gb 24 --out $R/${CARD}_24gb --json $R/${CARD}_24gb/04_memory.json
run ${CARD}_12gb/04_memory $(left 560) python3 04_memory.py --memory-gb 12 --out $R/${CARD}_12gb --json $R/${CARD}_12gb/04_memory.json
repack lessons
run $CARD/05_ddp_scratch $(left 590) python3 05_ddp_scratch.py --out $C --json $C/05_ddp_scratch.json
repack lessons
grep -h "rc=\|Traceback\|FAILED" $R/*/*.txt | head -20
