#!/bin/sh
# A stand-in for an AI coding agent: look around, fix the bug, run the tests, leave a report.
set -u
echo "== $AGENT_NAME: where am I?"
echo "uid=$(id -u)  network interfaces: $(ls /sys/class/net | tr '\n' ' ')"
grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status | tr '\n' ' '; echo
if touch /usr/bin/evil 2>/dev/null; then echo "root filesystem: WRITABLE"; else echo "root filesystem: read-only"; fi
echo "== tests before the fix"
python3 -m unittest -q test_calc 2>&1 | tail -1
sed -i 's/return a - b  # BUG: the agent fixes this/return a + b/' calc.py
echo "== tests after the fix"
python3 -m unittest -q test_calc 2>&1 | tail -1
printf 'fixed add() in calc.py; tests pass\n' > REPORT.txt
echo "== wrote REPORT.txt"
