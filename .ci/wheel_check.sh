#!/usr/bin/env bash
# Build the wheel, install it (not editable) into a fresh venv that sees the machine's packages
# (torch, megatron-core, ... are already installed; the wheel brings only megatron-rl), and run
# the package from there: `megatron-rl --help`, `megatron-rl config` on the quick start's recipe,
# an import of every module the source tree has, and the packaged data files.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "wheel check: building in $work"
$PYTHON -m build --wheel --no-isolation --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/megatron_rl-*.whl)
$PYTHON -m venv --system-site-packages "$work/venv"
# The venv sees the editable install of the checkout too; --force-reinstall --no-deps puts the
# wheel's copy in the venv's own site-packages, which wins.
"$work/venv/bin/python" -m pip install -q --no-deps --force-reinstall --root-user-action=ignore \
  --disable-pip-version-check "$wheel"
cd "$work"  # away from the checkout, so nothing is imported from the source tree
"$work/venv/bin/megatron-rl" --help >/dev/null
"$work/venv/bin/megatron-rl" config "$OLDPWD/examples/quickstart.yaml" >/dev/null
"$work/venv/bin/python" - "$OLDPWD" <<'PY'
import importlib, pathlib, sys
src = pathlib.Path(sys.argv[1]) / "megatron_rl"
import megatron_rl
where = pathlib.Path(megatron_rl.__file__).resolve().parent
assert where != src.resolve(), f"imported from the checkout ({where}), not the wheel"
names = sorted(".".join(p.relative_to(src.parent).with_suffix("").parts).removesuffix(".__init__")
               for p in src.rglob("*.py") if "__pycache__" not in p.parts and p.name != "__main__.py")
for name in names:
    importlib.import_module(name)
for data in ("data/samples/aime_sample.jsonl", "quickstart/recipe.yaml"):
    assert (where / data).is_file(), f"package data missing from the wheel: {data}"
print(f"wheel check: {len(names)} modules import from {where}; package data present")
PY
