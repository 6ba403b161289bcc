#!/usr/bin/env bash
# One H200: lessons 01-04 at their default sizes, one after the other, after their rewrite
# in plain Python (printed lines changed; what they measure did not).
source results/calls/gpu_lib.sh
machine h200
H=$R/h200
run h200/01_roofline 120 python3 01_roofline.py --json $H/01_roofline.json --out $H/fig01
run h200/02_hardware 200 python3 02_hardware.py --json $H/02_hardware.json --out $H/fig02
run h200/03_compile 120 python3 03_compile.py --json $H/03_compile.json --out $H/fig03
run h200/04_memory 150 python3 04_memory.py --json $H/04_memory.json --out $H/fig04
pack lessons_01_04
grep -h "rc=\|FAILED\|Traceback\|Error" $H/*.txt | head -20
