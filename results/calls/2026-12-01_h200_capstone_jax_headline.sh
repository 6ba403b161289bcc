#!/usr/bin/env bash
# One H200: 07_capstone_jax.py --headline with the committed code, as many times in a row as the
# time left allows (each must pass). No network there: --tokenizer bytes.
source results/calls/gpu_lib.sh
machine h200
for n in _current _current_2; do
  run h200/07_capstone_jax_headline$n $(left 250) python3 07_capstone_jax.py --headline \
      --tokenizer bytes --json $R/h200/07_capstone_jax_headline$n.json --out $R/h200/fig$n
  repack capstone_jax_headline
done
grep -h "derived:\|check\|rc=" $R/h200/*.txt
