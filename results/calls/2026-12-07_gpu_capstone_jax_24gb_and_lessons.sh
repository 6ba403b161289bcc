# One GPU, back to back: the JAX capstone as the book's 24 GiB card, then 02, and 04 at its
# default, as a 24 GiB and as a 12 GiB card.
#   bash results/calls/2026-12-07_gpu_capstone_jax_24gb_and_lessons.sh
source results/calls/gpu_lib.sh
machine capstone_jax_24gb_and_lessons
C=$R/$CARD
run ${CARD}_24gb/07_capstone_jax $(left 400) python3 07_capstone_jax.py --memory-gb 24 --out $R/${CARD}_24gb --json $R/${CARD}_24gb/07_capstone_jax.json
repack capstone_jax_24gb_and_lessons
run $CARD/02_hardware $(left 475) python3 02_hardware.py --out $C --json $C/02_hardware.json
repack capstone_jax_24gb_and_lessons
run $CARD/04_memory $(left 520) python3 04_memory.py --out $C --json $C/04_memory.json
run ${CARD}_24gb/04_memory $(left 555) python3 04_memory.py --memory-gb 24 --out $R/${CARD}_24gb --json $R/${CARD}_24gb/04_memory.json
run ${CARD}_12gb/04_memory $(left 580) python3 04_memory.py --memory-gb 12 --out $R/${CARD}_12gb --json $R/${CARD}_12gb/04_memory.json
repack capstone_jax_24gb_and_lessons
grep -h "rc=\|Traceback\|Error" $R/*/*.txt | head -20
