#!/usr/bin/env bash
# Packaging smoke test: build the wheel (make dist), install it into a fresh venv outside the
# source tree (the pinned CPU torch first, then the wheel without extras) and use it from
# outside the source tree, as a user would: the version, `gradkit info`, one computation, the
# demo refusing without its extra (exit 2, naming it), then the demo with the extra.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH PYTHONHOME

start=$SECONDS
say() { echo "wheel smoke [$((SECONDS - start)) s]: $*"; }
fail() {
    echo "wheel smoke: FAILED: $*" >&2
    exit 1
}

say "building the wheel (make dist)"
make dist
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' src/gradkit/_version.py)
[[ -n $version ]] || fail "no __version__ = \"...\" line in src/gradkit/_version.py"
wheel=$ROOT/dist/gradkit-$version-py3-none-any.whl
[[ -f $wheel ]] || fail "make dist built no $wheel (dist/ has: $(ls dist 2>/dev/null))"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/gradkit-wheel-smoke.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
case $tmp/ in "$ROOT"/*) fail "the temporary folder $tmp is inside the source tree" ;; esac
venv=$tmp/venv
py=$venv/bin/python
mkdir "$tmp/work"
cd "$tmp/work" # nothing of the source tree is importable from here

say "fresh venv in $venv; $TORCH_SPEC first"
"$PYTHON" -m venv "$venv"
"$py" -m pip install -q "$TORCH_SPEC" || fail "pip install $TORCH_SPEC"
torch_before=$("$py" -c "import torch; print(torch.__version__)")
say "the wheel, no extras ($(basename "$wheel"))"
"$py" -m pip install -q "$wheel" || fail "pip install $wheel"
torch_after=$("$py" -c "import torch; print(torch.__version__)")
[[ $torch_after == "$torch_before" ]] ||
    fail "installing the wheel replaced torch $torch_before by $torch_after"

where=$("$py" -c "import gradkit; print(gradkit.__file__)")
case $where in "$venv"/*) ;; *) fail "gradkit imported from $where, not from the wheel in $venv" ;; esac
say "gradkit imported from $where"

got=$("$venv/bin/gradkit" --version) || fail "gradkit --version exited $?"
[[ $got == "gradkit $version" ]] || fail "gradkit --version says '$got', want 'gradkit $version'"
say "gradkit --version: $got"

"$venv/bin/gradkit" info || fail "gradkit info exited $?"

say "one computation: per-example norms of a Linear against the loop oracle"
"$py" - <<'EOF' || fail "the computation with the installed wheel failed"
import torch
import torch.nn.functional as F
from torch import nn

import gradkit

torch.manual_seed(0)
model = nn.Linear(4, 3)
x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
with gradkit.per_example.track(model, "variance", "batch_l2") as stats:
    F.cross_entropy(model(x), y).backward()
loop = gradkit.testing.per_example_grads(model, F.cross_entropy, x, y)
want = sum((g.flatten(1) ** 2).sum(1) for g in loop.values())
gradkit.testing.assert_close(stats.batch_l2(), want.float(), name="batch_l2")
assert stats["weight"].variance.shape == model.weight.shape
print(f"batch_l2 of {len(x)} examples equals the loop's (gradkit {gradkit.__version__})")
EOF

say "gradkit demo without the demo extra: must exit 2 and name the extra"
rc=0
"$venv/bin/gradkit" demo --quick --no-progress --out "$tmp/refused" 2>"$tmp/stderr" >"$tmp/stdout" || rc=$?
cat "$tmp/stderr"
[[ $rc -eq 2 ]] || fail "gradkit demo without the demo extra exited $rc, want 2"
grep -q "gradkit\[demo\]" "$tmp/stderr" || fail "gradkit demo's message does not name the demo extra"
[[ ! -e $tmp/refused ]] || fail "the refused gradkit demo wrote $tmp/refused"

say "the demo extra, then gradkit demo --quick"
"$py" -m pip install -q "$wheel[demo]" || fail "pip install $wheel[demo]"
torch_after=$("$py" -c "import torch; print(torch.__version__)")
[[ $torch_after == "$torch_before" ]] ||
    fail "installing the demo extra replaced torch $torch_before by $torch_after"
"$venv/bin/gradkit" demo --quick --no-progress --out "$tmp/runs" || fail "gradkit demo exited $?"
report=$(find "$tmp/runs" -name report.md | head -n 1)
[[ -n $report && -s $report ]] || fail "gradkit demo wrote no report.md under $tmp/runs"
say "report written: ${report#"$tmp"/}"

say "passed (wheel gradkit $version, torch $torch_before)"
