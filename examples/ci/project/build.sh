#!/bin/sh
# The untrusted build step: compile, test, produce an artifact in dist/.
set -eu
python3 -m compileall -q src
python3 -c 'import sys; sys.path.insert(0, "src"); from greet import greet; assert greet("ci") == "hello, ci"'
mkdir -p dist
tar -czf dist/greet.tar.gz src
echo "build ok"
